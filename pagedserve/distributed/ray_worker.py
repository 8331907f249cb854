"""The Ray actor of one tensor-parallel rank: a ``Worker`` behind Ray method calls.

This module does not import Ray: ``RayExecutor`` wraps ``RayWorker`` with ``ray.remote`` and
the actor imports Ray only inside its methods (it runs in a Ray worker process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedserve.distributed.parallel_state import free_port
from pagedserve.distributed.worker_proc import Worker, WorkerSpec


@dataclass(frozen=True)
class NodeInfo:
    """Where an actor landed: its host and the GPUs Ray gave it."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]
    pid: int


def visible_devices_per_rank(nodes: list[NodeInfo]) -> list[tuple[str | None, int]]:
    """(CUDA_VISIBLE_DEVICES, local rank) for each rank.

    Ray shows each GPU actor only its own GPU; NCCL needs to see the peers on the same host to
    use NVLink / P2P. So every rank sees all the GPUs of the ranks on its host, and picks its
    own by index. CPU ranks (no GPU ids): (None, 0).
    """
    on_node: dict[str, set[str]] = {}
    for node in nodes:
        on_node.setdefault(node.node_id, set()).update(node.gpu_ids)
    result: list[tuple[str | None, int]] = []
    for node in nodes:
        if not node.gpu_ids:
            result.append((None, 0))
            continue
        visible = sorted(on_node[node.node_id], key=int)
        result.append((",".join(visible), visible.index(node.gpu_ids[0])))
    return result


class RayWorker:
    """One rank as a Ray actor; ``start`` must come before any ``call``."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_info(self) -> NodeInfo:
        import ray

        context = ray.get_runtime_context()
        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        return NodeInfo(context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid())

    def free_port(self) -> int:
        return free_port("")  # any interface: the other hosts' ranks connect to this one

    def start(self, spec: WorkerSpec, visible_devices: str | None) -> None:
        """Join the group and build this rank's runner (before any CUDA call in this process,
        so ``visible_devices`` still takes effect)."""
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.worker = Worker(spec)

    def call(self, method: str, *args: Any) -> Any:
        if self.worker is None:
            raise RuntimeError(f"RayWorker.call({method!r}) before start")
        return self.worker.call(method, args)
