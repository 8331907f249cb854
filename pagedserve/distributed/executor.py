"""The engine's handle on the model runners: one call per runner call, for every rank.

``EngineCore`` talks to an ``Executor`` exactly as it would to one ``ModelRunner``: load the
model, size and allocate the KV cache, capture graphs, then per step ``execute_model`` and
``sample_tokens``. The executor runs each call on every tensor-parallel rank; only rank 0's
sampled tokens come back (every rank samples the same tokens from the same gathered logits).

Backends (``ParallelConfig.distributed_executor_backend``): ``uni`` (the runner in this
process, TP=1), ``mp`` (one worker process per rank on this host), ``ray`` (one Ray actor per
rank, placed by a placement group). None picks ``uni`` for TP=1 and ``mp`` above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagedserve.distributed.worker_proc import ModelInfo
    from pagedserve.structured_output.bitmask import GrammarBitmask


class PendingOutput(Protocol):
    """A step's sampled tokens on their way to the engine (``AsyncOutput`` for one rank)."""

    def get_output(self) -> ModelRunnerOutput: ...


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the message names the rank(s)."""


class Executor(ABC):
    """Set by ``load_model``: what the engine needs to know about rank 0's model."""

    hf_config: PretrainedConfig
    max_model_len: int
    dtype: torch.dtype
    device: torch.device

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    @property
    def model_runner(self) -> Any:
        """The in-process ``ModelRunner`` (TP=1, ``uni`` only: benchmarks and the trace)."""
        raise AttributeError(
            f"model_runner: with tensor_parallel_size={self.tensor_parallel_size} the model "
            f"runners live in worker processes; read hf_config, dtype and device from the "
            f"executor ({type(self).__name__})"
        )

    @abstractmethod
    def load_model(self) -> None:
        """Load every rank's shard; then ``hf_config``, ``max_model_len``, ``dtype`` and
        ``device`` (rank 0's) are set."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every rank (the smallest rank's count)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def capture_graphs(self) -> None:
        """Capture CUDA graphs on every rank (a no-op on the CPU or with enforce_eager)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run one step on every rank (always called, even with no tokens: it frees slots)."""

    samples_separately = False
    """Whether ``sample_tokens_async`` is a call of its own after ``execute_model`` (the
    runner in this process), so a grammar bitmask can be handed to it; otherwise each rank
    runs a step as one call and the mask travels in the plan (``grammar_bitmask``)."""

    @abstractmethod
    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> PendingOutput:
        """The tokens of the last ``execute_model``; ``get_output()`` waits for them. A
        ``grammar_bitmask`` is applied to the constrained rows' logits (``samples_separately``
        executors only)."""

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.sample_tokens_async().get_output()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their devices; the executor is unusable afterwards."""



def require_mask_in_plan(grammar_bitmask: GrammarBitmask | None) -> None:
    """Executors that run a step as one call on every rank take the mask in the plan."""
    if grammar_bitmask is not None:
        raise ValueError("grammar_bitmask: this executor takes the mask in the plan")


class WorkerGroupExecutor(Executor):
    """An executor whose ranks live in workers (processes or Ray actors): every start-up call
    runs on all ranks through one ``_collect``, and rank 0's answer describes the model."""

    @abstractmethod
    def _collect(self, method: str, *args: Any) -> list[Any]:
        """Run the worker's ``method`` on every rank; their results in rank order."""

    def load_model(self) -> None:
        info: ModelInfo = self._collect("load_model")[0]
        self.hf_config, self.max_model_len = info.hf_config, info.max_model_len
        self.dtype, self.device = info.dtype, info.device

    def determine_num_blocks(self) -> int:
        return min(self._collect("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._collect("initialize_kv_cache", num_blocks)

    def capture_graphs(self) -> None:
        self._collect("capture_graphs")


def select_backend(config: EngineConfig) -> str:
    """The executor backend ``config`` asks for (``uni`` / ``mp`` / ``ray``), checked."""
    parallel = config.parallel
    backend = parallel.distributed_executor_backend
    if backend is None:
        return "uni" if parallel.tensor_parallel_size == 1 else "mp"
    if backend == "uni" and parallel.tensor_parallel_size > 1:
        raise ValueError(
            f"distributed_executor_backend: uni runs one rank in the engine process; "
            f"tensor_parallel_size {parallel.tensor_parallel_size} needs mp or ray"
        )
    if backend not in ("uni", "mp", "ray"):
        raise ValueError(f"distributed_executor_backend: {backend!r} is not uni, mp or ray")
    return backend


def create_executor(config: EngineConfig) -> Executor:
    """The executor for ``config.parallel`` (``config.device`` already resolved)."""
    backend = select_backend(config)
    if backend == "uni":
        from pagedserve.distributed.executor_uni import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "mp":
        from pagedserve.distributed.executor_mp import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedserve.distributed.executor_ray import RayExecutor

    return RayExecutor(config)
