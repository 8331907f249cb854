"""The multiprocess executor (one worker process per rank, gloo on the CPU): TP=2 gives the
TP=1 tokens exactly and logprobs within 1e-4; a killed worker ends the engine with an error
naming its rank within 10 s."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve import LLM
from pagedserve.distributed.executor import WorkerError
from pagedserve.distributed.executor_mp import MultiprocExecutor
from tests.distributed.tiny_tp import (
    ARCHS,
    ENGINE_ARGS,
    assert_same_outputs,
    generate,
    generate_until_killed,
)

# Qwen2 also runs with async scheduling: each worker launches step N+1 before it waits for N.
EXTRA_ARGS = {"llama": {}, "qwen2": {"async_scheduling": True}}


@pytest.fixture(scope="module")
def tp2_engine(checkpoint):
    """arch -> a TP=2 LLM on the mp backend, started once for the module."""
    engines: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in engines:
            engines[arch] = LLM(
                str(checkpoint(arch)), tensor_parallel_size=2, **ENGINE_ARGS, **EXTRA_ARGS[arch]
            )
        return engines[arch]

    yield get
    for llm in engines.values():
        llm.engine_core.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1(arch, tp2_engine, tp1_outputs) -> None:
    llm = tp2_engine(arch)
    assert isinstance(llm.engine_core.executor, MultiprocExecutor)
    assert_same_outputs(generate(llm), tp1_outputs(arch))
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0  # every block came back


def test_model_runner_is_in_the_workers(tp2_engine) -> None:
    with pytest.raises(AttributeError, match="tensor_parallel_size=2"):
        _ = tp2_engine("llama").engine_core.model_runner


def test_killed_worker_ends_the_engine_naming_its_rank(tp2_engine) -> None:
    """Last in the module: it takes the Llama engine down."""
    llm = tp2_engine("llama")
    processes = llm.engine_core.executor.processes
    error, seconds = generate_until_killed(llm, lambda: os.kill(processes[1].pid, signal.SIGKILL))
    assert isinstance(error, WorkerError), repr(error)
    assert "rank 1" in str(error) and "SIGKILL" in str(error), str(error)
    assert seconds < 10.0
    assert not any(p.is_alive() for p in processes)  # rank 0 was stopped too
