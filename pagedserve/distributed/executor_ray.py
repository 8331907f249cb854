"""The Ray executor (``--distributed-executor-backend ray``): one Ray actor per rank, placed by
a placement group with one bundle per rank, so the ranks may span several hosts.

The step protocol is the multiprocess one (``worker_proc``): every actor runs the same calls
in the same order; the ``SchedulerOutput`` is put into Ray's object store once per step and
every actor's call reads it; only rank 0's call returns sampled tokens.

Failure handling: a dead actor fails its pending calls with ``RayActorError`` (Ray notices
the process exit); every wait watches all ranks' calls, so the engine raises a
``WorkerError`` naming the rank instead of waiting on rank 0's collective forever.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, NoReturn

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.executor import (
    PendingOutput,
    WorkerGroupExecutor,
    require_mask_in_plan,
)
from pagedserve.distributed.ray_worker import NodeInfo, RayWorker, visible_devices_per_rank
from pagedserve.distributed.worker_proc import STEP, WorkerSpec
from pagedserve.distributed.worker_watch import GRACE_S, worker_failure
from pagedserve.platform import platform_for

if TYPE_CHECKING:
    from pagedserve.structured_output.bitmask import GrammarBitmask

PLACEMENT_TIMEOUT_S = 60.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend: ray needs the ray package "
            "(pip install 'pagedserve[ray]')"
        ) from e
    return ray


class _StepReply:
    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor = executor
        self.refs = refs

    def get_output(self) -> ModelRunnerOutput:
        output = self.executor.wait(self.refs, "execute_model", num_needed=1)[0]
        return ModelRunnerOutput.empty() if output is None else output


class RayExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ray = ray = _import_ray()
        if not ray.is_initialized():
            ray.init()  # joins the cluster named by RAY_ADDRESS, else starts a local one
        # One bundle per rank: a GPU (its actor needs no CPU slot), or a CPU on the CPU.
        bundle, actor_resources = platform_for(config.device).ray_resources()
        self.placement_group = self._place(bundle)
        self.actors = self._start_actors(actor_resources)
        self._finalizer = weakref.finalize(self, _stop, ray, self.actors, self.placement_group)
        self._last_step: list[Any] = []
        self.nodes: list[NodeInfo] = []
        """Host, GPUs and pid of each rank's actor."""
        self._init_workers()

    # ---- start-up -----------------------------------------------------------------------------

    def _place(self, bundle: dict[str, float]) -> Any:
        from ray.util.placement_group import placement_group

        size = self.tensor_parallel_size
        group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        try:
            self.ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.util.remove_placement_group(group)
            raise RuntimeError(
                f"tensor_parallel_size: {size} Ray bundles of {bundle} could not be placed "
                f"within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{self.ray.available_resources()} available"
            ) from None
        return group

    def _start_actors(self, resources: dict[str, int]) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self.ray.remote(RayWorker)
        return [
            actor_class.options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.tensor_parallel_size)
        ]

    def _init_workers(self) -> None:
        """Find each rank's host and GPU, meet on rank 0's host, join the group."""
        size = self.tensor_parallel_size
        nodes = self.wait([a.node_info.remote() for a in self.actors], "start-up", size)
        self.nodes = nodes
        devices = visible_devices_per_rank(nodes)
        host = nodes[0].ip
        port = self.wait([self.actors[0].free_port.remote()], "start-up", 1)[0]
        refs = [
            actor.start.remote(
                WorkerSpec(self.config, rank, size, local_rank, f"tcp://{host}:{port}"), visible
            )
            for rank, (actor, (visible, local_rank)) in enumerate(
                zip(self.actors, devices, strict=True)
            )
        ]
        self.wait(refs, "start-up", size)

    def _collect(self, method: str, *args: Any) -> list[Any]:
        refs = [actor.call.remote(method, *args) for actor in self.actors]
        return self.wait(refs, method, len(refs))

    # ---- steps --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        plan = self.ray.put(scheduler_output)  # one copy in the object store for every rank
        self._last_step = [actor.call.remote(STEP, plan) for actor in self.actors]

    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> PendingOutput:
        require_mask_in_plan(grammar_bitmask)  # a mask went with the plan
        return _StepReply(self, self._last_step)

    def wait(self, refs: list[Any], what: str, num_needed: int) -> list[Any]:
        """The results of ranks ``0 .. num_needed - 1`` of ``refs`` (one call per rank, in
        rank order): all ranks for start-up calls, rank 0 alone for a step. Any rank's
        failure seen meanwhile raises, naming the rank."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while not all(rank in results for rank in range(num_needed)):
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError:
                    self._fail(refs, what)
        return [results[rank] for rank in range(num_needed)]

    def _fail(self, refs: list[Any], what: str) -> NoReturn:
        """Give the other ranks ``GRACE_S`` to fail too, then stop them and raise."""
        ray = self.ray
        ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)
        dead: dict[int, str] = {}
        reported: dict[int, tuple[BaseException, str]] = {}
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                pid = self.nodes[rank].pid if self.nodes else "unknown"
                reason = str(e).strip().splitlines()[0].rstrip(".")
                dead[rank] = f"(Ray actor, pid {pid}) died ({reason})"
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                reported[rank] = (cause, str(e))
            except ray.exceptions.GetTimeoutError:
                continue  # still running: stuck in a collective with a dead peer
        self.shutdown()
        raise worker_failure(what, dead, reported)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(ray: Any, actors: list[Any], placement_group: Any) -> None:
    if not ray.is_initialized():  # the cluster connection is gone, and the actors with it
        return
    for actor in actors:
        ray.kill(actor)
    ray.util.remove_placement_group(placement_group)
