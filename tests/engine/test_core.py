"""EngineCore start-up failures: one line naming the cause, not a traceback."""

from __future__ import annotations

import types

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine import core


class _ExecutorOutOfMemory:
    """Loads, then fails to allocate the KV cache as torch's CPU allocator does."""

    def load_model(self) -> None:
        pass

    def determine_num_blocks(self) -> int:
        return 10**9

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 17179869184000 bytes.\nsecond line"
        )


class _ExecutorBug(_ExecutorOutOfMemory):
    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise RuntimeError("shape mismatch")


@pytest.fixture
def fake_executor(monkeypatch):
    import pagedserve.distributed.executor as executor

    def use(executor_cls):
        monkeypatch.setattr(executor, "create_executor", lambda config: executor_cls())

    quiet = types.SimpleNamespace(configure_process=lambda: None, async_scheduling=False)
    monkeypatch.setattr(core, "platform_for", lambda device: quiet)
    return use


def test_too_little_memory_is_one_line(fake_executor) -> None:
    fake_executor(_ExecutorOutOfMemory)
    with pytest.raises(core.NotEnoughMemoryError) as info:
        core.EngineCore(EngineConfig(device="cpu"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("not enough memory to allocate the KV cache: [enforce fail")
    assert "--kv-cache-memory" in message


def test_other_runtime_errors_pass_through(fake_executor) -> None:
    fake_executor(_ExecutorBug)
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        core.EngineCore(EngineConfig(device="cpu"))
