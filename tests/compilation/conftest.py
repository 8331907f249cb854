"""Fixtures of the compilation tests: a 4-layer tiny Llama (so it has repeated middle pieces)
and CPU runners on it, compiled or eager.

Every test gets its own compile cache directory, and saved forwards are off unless a test turns
them on (``aot_cache``): the other tests pin Dynamo's JIT path (one trace per CompiledForward),
which a saved forward from an earlier test would skip."""

from __future__ import annotations

import os

# These runners are CPU runners; the one-token forward's Triton kernels run in the interpreter,
# which must be chosen before triton loads (torch's Inductor imports it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pagedserve.compilation import compile_cache  # noqa: E402
from pagedserve.compilation.aot_forward import AOT_ENV, ARTIFACT_DIR  # noqa: E402
from pagedserve.config import (  # noqa: E402
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402
from tests.worker.conftest import (  # noqa: E402, F401 (the tiny Llama's fixtures)
    hf_tiny_llama,
    make_runner,
    tiny_llama_dir,
)

DEEP_LLAMA = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def deep_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DEEP_LLAMA)).to(torch.float32).eval()
    path = tmp_path_factory.mktemp("deep_llama")
    model.save_pretrained(path)
    return path


def _runner(model_dir: Path, mode: str) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        compilation=CompilationConfig(mode=mode, piece_compiler="eager"),
        device="cpu",
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


@pytest.fixture
def deep_runner(deep_llama_dir: Path) -> Callable[[str], ModelRunner]:
    """``deep_runner("compile")`` / ``deep_runner("none")``: a CPU runner, 64 blocks of 4."""
    return functools.partial(_runner, deep_llama_dir)


@pytest.fixture(autouse=True)
def _private_compile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh compile cache per test (``TORCHINDUCTOR_CACHE_DIR``: Inductor's entries and the
    saved forwards), saved forwards off. ``XDG_CACHE_HOME`` is left alone: the CPU kernels
    built there are not under test, and a fresh one would build them again."""
    cache = tmp_path / "compile"
    monkeypatch.setenv(compile_cache.INDUCTOR_CACHE_ENV, str(cache))
    monkeypatch.setenv(AOT_ENV, "0")
    return cache


@pytest.fixture
def aot_cache(_private_compile_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Saved forwards on; returns the folder they are saved in."""
    monkeypatch.setenv(AOT_ENV, "1")
    return _private_compile_cache / ARTIFACT_DIR
