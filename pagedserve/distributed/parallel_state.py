"""Tensor-parallel process groups and the collectives the layers call.

A process is one rank. Layers that communicate take ``all_reduce`` / ``all_gather`` callables
from a ``TensorParallelGroup``; the single-rank group (TP=1, the default) never touches
``torch.distributed``.

The collectives are torch's functional collectives (``torch.ops._c10d_functional``): out-of-
place ops that torch.compile keeps in the traced graph and that CUDA graphs capture (NCCL), and
that run eagerly over gloo on the CPU.

Process state: a worker process joins exactly one group, once, before it builds its model
(``init_tensor_parallel``); ``get_tp_group`` returns it (the single-rank group until then).
This mirrors ``torch.distributed``'s own default group, which is process state as well.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.platform import platform_for

WORKER_ENV = {
    "NCCL_NVLS_ENABLE": "0",  # no NVLink SHARP multicast: not available on every host
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # same for torch's symmetric memory
}
"""Environment of every worker process, set before its first collective."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in its tensor-parallel group and the collectives over it.

    ``group_name`` is the torch.distributed name of the group ("" for a single rank): the
    functional collectives find the group by name, so the ops stay traceable.
    """

    rank: int
    size: int
    group_name: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} is not in [0, size={self.size})")
        if self.size > 1 and not self.group_name:
            raise ValueError(f"group_name: a group of {self.size} ranks needs one")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (any shape), as a new tensor; ``x`` on one rank."""
        if self.size == 1:
            return x
        out = torch.ops._c10d_functional.all_reduce(x, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., n]`` on every rank -> ``[..., size * n]``: the ranks' tensors side by side
        along the last dim, in rank order (the vocabulary slices of the LM head)."""
        if self.size == 1:
            return x
        out = torch.ops._c10d_functional.all_gather_into_tensor(
            x.contiguous(), self.size, self.group_name
        )
        gathered = torch.ops._c10d_functional.wait_tensor(out)  # [size * x.shape[0], ...]
        stacked = gathered.view(self.size, *x.shape).movedim(0, -2)  # [..., size, n]
        return stacked.reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE_RANK = TensorParallelGroup(rank=0, size=1, group_name="")

_tp_group: TensorParallelGroup = SINGLE_RANK


def get_tp_group() -> TensorParallelGroup:
    """The group this process joined with ``init_tensor_parallel`` (else the single rank)."""
    return _tp_group


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device
) -> TensorParallelGroup:
    """Join the group of ``size`` ranks that meet at ``init_method`` (``tcp://host:port``):
    NCCL for CUDA devices, gloo for the CPU. Called once per worker process."""
    global _tp_group
    if _tp_group.size > 1 or dist.is_initialized():
        raise RuntimeError("init_tensor_parallel: this process already joined a group")
    os.environ.update(WORKER_ENV)
    platform = platform_for(device)
    dist.init_process_group(
        platform.dist_backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        device_id=platform.process_group_device(),
    )
    world = dist.group.WORLD
    assert world is not None  # init_process_group just created it
    _tp_group = TensorParallelGroup(rank, size, world.group_name)
    return _tp_group


def destroy_tensor_parallel() -> None:
    """Leave the group (end of a worker); the process is single-rank again."""
    global _tp_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_group = SINGLE_RANK


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the rendezvous port of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
