"""The Ray executor on a local Ray cluster started here (2 CPUs: one bundle per rank): TP=2
gives the TP=1 tokens exactly and logprobs within 1e-4; a killed actor ends the engine with
an error naming its rank within 10 s. Skipped, saying why, where Ray cannot run."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve import LLM
from pagedserve.distributed.executor import WorkerError
from tests.distributed.tiny_tp import (
    ENGINE_ARGS,
    assert_same_outputs,
    generate,
    generate_until_killed,
)

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagedserve[ray]')")


@pytest.fixture(scope="module")
def ray_cluster():
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # no Ray on this machine: the reason goes into the skip
        pytest.skip(f"Ray cannot start a local cluster on this machine: {type(e).__name__}: {e}")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tp2_engine(ray_cluster, checkpoint):
    """arch -> a TP=2 LLM on the Ray backend. The cluster has room for one engine (two
    1-CPU bundles), so asking for another architecture shuts the previous engine down."""
    current: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in current:
            for llm in current.values():
                llm.engine_core.shutdown()
            current.clear()
            current[arch] = LLM(
                str(checkpoint(arch)),
                tensor_parallel_size=2,
                distributed_executor_backend="ray",
                **ENGINE_ARGS,
            )
        return current[arch]

    yield get
    for llm in current.values():
        llm.engine_core.shutdown()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # Llama last: the kill test reuses it
def test_tp2_matches_tp1(arch, tp2_engine, tp1_outputs) -> None:
    llm = tp2_engine(arch)
    assert type(llm.engine_core.executor).__name__ == "RayExecutor"
    assert_same_outputs(generate(llm), tp1_outputs(arch))


def test_killed_actor_ends_the_engine_naming_its_rank(tp2_engine) -> None:
    llm = tp2_engine("llama")
    pid = llm.engine_core.executor.nodes[1].pid
    error, seconds = generate_until_killed(llm, lambda: os.kill(pid, signal.SIGKILL))
    assert isinstance(error, WorkerError), repr(error)
    assert "rank 1" in str(error), str(error)
    assert seconds < 10.0
