"""Which executor a config gets, and how worker failures read (no processes started)."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.distributed.executor import WorkerError, select_backend
from pagedserve.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from pagedserve.distributed.ray_worker import NodeInfo, visible_devices_per_rank
from pagedserve.distributed.worker_watch import describe_exit, worker_failure


@pytest.mark.parametrize(
    ("tp", "backend", "expected"),
    [(1, None, "uni"), (2, None, "mp"), (1, "mp", "mp"), (2, "ray", "ray"), (1, "uni", "uni")],
)
def test_backend_follows_the_parallel_config(tp, backend, expected) -> None:
    config = EngineConfig.from_kwargs(tensor_parallel_size=tp, distributed_executor_backend=backend)
    assert select_backend(config) == expected


def test_uni_backend_refuses_several_ranks() -> None:
    config = EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend: uni .* needs mp or ray"):
        select_backend(config)


def test_group_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="rank: 2 is not in"):
        TensorParallelGroup(2, 2, "g")
    with pytest.raises(ValueError, match="group_name"):
        TensorParallelGroup(0, 2, "")


def test_single_rank_collectives_are_the_identity() -> None:
    import torch

    x = torch.arange(6.0).view(2, 3)
    assert SINGLE_RANK.all_reduce(x) is x
    assert SINGLE_RANK.all_gather(x) is x


def test_a_dead_rank_is_named_before_the_ranks_it_took_down() -> None:
    error = worker_failure(
        "execute_model",
        {1: f"(pid 42) {describe_exit(-9)}"},
        {0: (RuntimeError("gloo: connection reset"), "traceback text")},
    )
    assert isinstance(error, WorkerError)
    assert str(error) == (
        "tensor-parallel worker rank 1 (pid 42) was killed by signal SIGKILL during "
        "execute_model; rank 0 then failed: RuntimeError: gloo: connection reset"
    )


def test_a_reported_exception_keeps_its_type_and_names_the_rank() -> None:
    cause = ValueError("tensor_parallel_size: 3 does not split the model evenly")
    error = worker_failure("load_model", {}, {2: (cause, "Traceback: ..."), 1: (cause, "")})
    assert error is cause
    assert "raised in tensor-parallel worker rank 1 during load_model" in error.__notes__[0]


def test_exit_descriptions() -> None:
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(-15) == "was killed by signal SIGTERM"
    assert describe_exit(None) == "is still running"


def test_each_gpu_rank_sees_the_gpus_of_its_host() -> None:
    nodes = [
        NodeInfo("a", "10.0.0.1", ("3",), 1),
        NodeInfo("a", "10.0.0.1", ("1",), 2),
        NodeInfo("b", "10.0.0.2", ("0",), 3),
        NodeInfo("a", "10.0.0.1", ("10",), 4),
    ]
    assert visible_devices_per_rank(nodes) == [
        ("1,3,10", 1),
        ("1,3,10", 0),
        ("0", 0),
        ("1,3,10", 2),
    ]
    cpu = [NodeInfo("a", "10.0.0.1", (), 1)]
    assert visible_devices_per_rank(cpu) == [(None, 0)]
