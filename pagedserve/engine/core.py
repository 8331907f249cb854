"""EngineCore: the step loop that joins the scheduler and the model runner.

One ``step()`` is one engine step (docs/architecture.md#one-engine-step):
``Scheduler.schedule()`` plans which tokens run, ``ModelRunner.execute_model`` runs them,
``sample_tokens`` samples the next token of every request whose prompt is complete, and
``Scheduler.update_from_output`` appends the tokens, applies stop conditions and frees the
blocks of finished requests. The runner calls go through
an ``Executor`` (``distributed/``): the runner in this process (TP=1), or one per
tensor-parallel rank in worker processes or Ray actors.

The core sees token ids only (no tokenizer, no text); the input and output processors live in
the frontend (``LLM`` or the server), which may run in another process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.stats import SchedulerStats
from pagedserve.engine.chat_messages import load_chat_template
from pagedserve.engine.gc_heap import freeze_startup_heap
from pagedserve.lora.request import LoRARequest
from pagedserve.model.loader import get_max_model_len, model_class_of
from pagedserve.model.resolve import ResolvedModel, resolve_model_config
from pagedserve.platform import platform_for, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from pagedserve.distributed.executor import PendingOutput
    from pagedserve.lora.check import AdapterFiles
    from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
_MAX_STEPS_IN_FLIGHT = 2
"""Async scheduling: the step the device runs plus the one being planned and queued."""
_GRAMMAR_WAIT_S = 0.005
"""How long an idle core blocks on a compiling grammar before it looks at its input again."""


@dataclasses.dataclass
class _Step:
    """A launched step. ``deferred``: its sampling (and, where the executor runs a step as one
    call, the whole step) waits until the step before it is appended, because a constrained
    request's mask needs that step's token (docs/architecture.md#structured-outputs)."""

    plan: SchedulerOutput
    pending: PendingOutput | None
    deferred: bool = False


@contextmanager
def _timed(phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    logger.info("engine start-up: %s took %.2f s", phase, time.perf_counter() - start)


OUT_OF_MEMORY_MARKS = ("out of memory", "can't allocate memory")
"""How torch's allocators word a failed allocation (CUDA's ``OutOfMemoryError``, the CPU's
``DefaultCPUAllocator``); both are ``RuntimeError``."""


class NotEnoughMemoryError(MemoryError):
    """The model or its KV cache does not fit at start-up; the message says what to lower."""


@contextmanager
def _out_of_memory_as_one_line(phase: str) -> Iterator[None]:
    """A failed allocation during start-up ``phase`` as a ``NotEnoughMemoryError`` whose
    message is one line, instead of the allocator's traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, RuntimeError) and not any(m in first_line for m in OUT_OF_MEMORY_MARKS):
            raise
        raise NotEnoughMemoryError(
            f"not enough memory to {phase}: {first_line} (lower --max-model-len, "
            "--max-num-seqs, --gpu-memory-utilization or --kv-cache-memory, or use a smaller "
            "model or dtype)"
        ) from e


def resolve_device_and_dtype(config: EngineConfig) -> EngineConfig:
    """Fill ``device``, ``model.dtype`` and ``scheduler.async_scheduling`` with concrete values
    (``auto`` / None resolved once, here).

    Cheap: reads no model file. Idempotent, so processes that call it agree.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.model.dtype, device)
    model = dataclasses.replace(config.model, dtype=str(dtype).removeprefix("torch."))
    scheduler = config.scheduler
    if scheduler.async_scheduling is None:
        scheduler = dataclasses.replace(scheduler,
                                        async_scheduling=platform_for(device).async_scheduling)
    return dataclasses.replace(config, model=model, scheduler=scheduler, device=str(device))


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, ResolvedModel]:
    """For frontends that want a bad model to fail before the engine starts: the model's files
    and config, with ``device``, ``dtype`` and ``max_model_len`` filled in; an architecture the
    engine does not implement is refused here (``CheckpointError``, one line), and so is a
    ``chat_template`` that is neither a readable file nor valid Jinja.

    It reads the model's config (seconds for a GGUF file), so ``EngineCore`` does not call it:
    the model runner reads that config once while loading.
    """
    resolved = resolve_model_config(config.model)
    model_class_of(resolved)
    if config.model.chat_template is not None:
        load_chat_template(config.model.chat_template)
    config = resolve_device_and_dtype(config)
    max_model_len = get_max_model_len(config.model, resolved.hf_config)
    model = dataclasses.replace(config.model, max_model_len=max_model_len)
    return dataclasses.replace(config, model=model), resolved


class EngineCore:
    """Owns the executor (the model runners) and the scheduler; advances every request by one
    step at a time.

    Callers add ``Request`` objects (from the ``InputProcessor``), call ``step()`` while
    ``has_unfinished_requests()``, and pass the returned outputs to the ``OutputProcessor``.
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.distributed.executor import create_executor  # torch-heavy; on use

        start = time.perf_counter()
        self.config = resolve_device_and_dtype(config)
        # CPU: thread count (adjusted before each step), allocator
        self._before_step = platform_for(self.config.device).configure_process()
        # uni / mp / ray, from config.parallel (tensor_parallel_size, distributed_executor_backend)
        self.executor = create_executor(self.config)
        with _timed("load model"), _out_of_memory_as_one_line("load the model"):
            self.executor.load_model()
        with _timed("size KV cache"), _out_of_memory_as_one_line("allocate the KV cache"):
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(num_blocks)
        with _timed("capture CUDA graphs"), _out_of_memory_as_one_line("capture CUDA graphs"):
            self.executor.capture_graphs()  # a no-op on the CPU or with enforce_eager
        self.num_blocks = num_blocks
        model = dataclasses.replace(self.config.model, max_model_len=self.max_model_len)
        self.config = dataclasses.replace(self.config, model=model)
        self._in_flight: deque[_Step] = deque()
        """Steps launched and not yet completed, oldest first (at most one without async
        scheduling)."""
        lora = self.config.lora
        self.scheduler = Scheduler(
            self.config.scheduler, self.config.cache, self.max_model_len, num_blocks,
            lora.max_loras if lora.enable_lora else 0,
        )
        spec = self.config.scheduler.speculative_config
        if spec is not None and spec.method == "draft_model":
            from pagedserve.spec_decode.draft_model import DraftModelProposer

            with _timed("load the draft model"), _out_of_memory_as_one_line("load the draft"):
                self.scheduler.proposer = DraftModelProposer(
                    self.config, spec, self.max_model_len, self.vocab_size, num_blocks)
        self._adapter_files: AdapterFiles | None = None
        """Built by the first request with a LoRA adapter."""
        self._structured_output: StructuredOutputManager | None = None
        """Built by the first constrained request (it loads the tokenizer on a thread)."""
        # What start-up built lives as long as the engine: out of the collector's walks, so that
        # no full collection stalls a step later (``gc_heap``).
        freeze_startup_heap(self)
        logger.info(
            "engine ready in %.2f s: %s on %s (%s), max_model_len %d, KV cache of %d tokens "
            "(%d blocks of %d)",
            time.perf_counter() - start,
            self.config.model.model,
            self.config.device,
            self.config.model.dtype,
            self.max_model_len,
            num_blocks * self.config.cache.block_size,
            num_blocks,
            self.config.cache.block_size,
        )

    @property
    def model_runner(self) -> Any:
        """The in-process ``ModelRunner`` (TP=1 with the ``uni`` executor only)."""
        return self.executor.model_runner

    @property
    def max_model_len(self) -> int:
        """The context length (``max_model_len``, else the model's position limit)."""
        return int(self.executor.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.executor.hf_config.vocab_size)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for TP=1 in process)."""
        if self._structured_output is not None:
            self._structured_output.shutdown()
        self.executor.shutdown()

    def add_request(self, request: Request) -> None:
        if request.lora_request is not None:
            error = self._adapter_error(request.lora_request)
            if error is not None:  # the runner would fail on it, and the step with it
                self.scheduler.reject(request, error)
                return
        if request.sampling_params.structured_outputs is not None:
            self._structured_output_manager().register(request)
        self.scheduler.add_request(request)

    def _adapter_error(self, lora_request: LoRARequest) -> str | None:
        """Why the adapter's folder cannot be read now (removed or changed since the front end
        checked it), or None: such a request ends here rather than failing the runner's
        step."""
        if not self.config.lora.enable_lora:  # it would wait forever for an adapter slot
            return "lora_request: this engine serves no LoRA adapters (enable_lora is off)"
        if self._adapter_files is None:
            from pagedserve.lora.check import AdapterFiles

            self._adapter_files = AdapterFiles(self.executor.hf_config,
                                               self.config.lora.max_lora_rank)
        return self._adapter_files.error(lora_request)

    def _structured_output_manager(self) -> StructuredOutputManager:
        if self._structured_output is None:
            from pagedserve.model.tokenizer import get_tokenizer
            from pagedserve.structured_output.manager import StructuredOutputManager

            eos = getattr(self.executor.hf_config, "eos_token_id", None)
            eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            model_config = self.config.model
            self._structured_output = StructuredOutputManager(
                lambda: get_tokenizer(model_config), self.vocab_size, eos_ids)
        return self._structured_output

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort requests by id (unknown ids are ignored); their blocks return to the pool.
        Returns one ``finish_reason="abort"`` output per aborted request."""
        return self.scheduler.abort_requests(list(request_ids))

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """Finish requests with ``status`` (e.g. FINISHED_STOPPED after a stop string)."""
        return self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        if self._structured_output is None:
            return stats
        grammar = self._structured_output.stats
        return dataclasses.replace(
            stats, grammar_compiles=grammar.num_compiled,
            grammar_compile_seconds=grammar.compile_seconds,
            grammar_cache_queries=grammar.cache_hits + grammar.cache_misses,
            grammar_cache_hits=grammar.cache_hits)

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the outputs of the requests that advanced or finished.

        With async scheduling the next step is planned and launched before the host waits for
        the current one's tokens (the device reads them from ``last_sampled_tokens``), so the
        GPU does not idle while the host schedules; each call still completes one step."""
        self._before_step()
        if self.config.scheduler.async_scheduling:
            while (
                len(self._in_flight) < _MAX_STEPS_IN_FLIGHT
                and self.scheduler.has_unfinished_requests()
            ):
                if self._in_flight and not self._may_plan_past(self._in_flight[-1]):
                    break
                self._in_flight.append(self._launch())
                if self._in_flight[-1].deferred:
                    break  # nothing is planned past a step that waits for its predecessor
        elif self.scheduler.has_unfinished_requests():
            self._in_flight.append(self._launch())
        outputs = self.scheduler.take_rejected()
        if not self._in_flight:
            return outputs
        step = self._in_flight.popleft()
        with self._plan_lost_on_error(step.plan):
            runner_output = (ModelRunnerOutput.empty() if step.pending is None
                             else step.pending.get_output())
        outputs += self.scheduler.update_from_output(step.plan, runner_output)
        if self._in_flight and self._in_flight[0].deferred:
            with self._plan_lost_on_error(self._in_flight[0].plan):
                self._finish_launch(self._in_flight[0])
        return outputs

    def _may_plan_past(self, step: _Step) -> bool:
        """Whether the next step may be planned while ``step`` runs. Not past a deferred step,
        nor past one that verifies drafts: how many it accepts sets the next step's
        positions. Nor while speculation is on: drafts are proposed from known tokens only,
        so the step that may draft is planned once the one before it is appended, as a
        deferred step's sampling is (docs/architecture.md#speculative-decoding)."""
        return not (step.deferred or step.plan.scheduled_spec_decode_tokens
                    or self.scheduler.speculating())

    def _launch(self) -> _Step:
        """Schedule a step and queue its work on the device; nothing here waits for it.

        A step that runs a constrained request while another step is in flight is deferred:
        its mask needs the token that step samples. Where sampling is its own call (one
        process) the forward is queued now and only the sampling waits; otherwise the whole
        step waits."""
        plan = self.scheduler.schedule()
        with self._plan_lost_on_error(plan):
            if plan.total_num_scheduled_tokens == 0:
                self.executor.execute_model(plan)  # it frees the slots of finished requests
                if self.scheduler.waiting_for_grammar and self._structured_output is not None:
                    self._structured_output.wait_for_any(self.scheduler.waiting_for_grammar,
                                                         _GRAMMAR_WAIT_S)
                return _Step(plan, None)
            step = _Step(plan, None, deferred=bool(self._in_flight) and self._constrained(plan))
            if self.executor.samples_separately:
                self.executor.execute_model(plan)  # the host fills the mask while this runs
            if not step.deferred:
                self._finish_launch(step)
            return step

    def _finish_launch(self, step: _Step) -> None:
        """Fill the step's bitmask from the matchers as they are now and queue the sampling
        (with the forward, where the executor runs both in one call: the mask then travels
        with the plan to every rank)."""
        grammar = None
        if self._structured_output is not None and self.scheduler.num_constrained_requests:
            grammar = self._structured_output.grammar_bitmask(step.plan,
                                                              self.scheduler.requests)
        step.deferred = False
        if not self.executor.samples_separately:
            step.plan.grammar_bitmask, grammar = grammar, None
            self.executor.execute_model(step.plan)
        step.pending = self.executor.sample_tokens_async(grammar)

    def _constrained(self, plan: SchedulerOutput) -> bool:
        if not self.scheduler.num_constrained_requests:
            return False
        requests = self.scheduler.requests
        return any(
            (r := requests.get(rid)) is not None and r.structured_output is not None
            for rid in plan.num_scheduled_tokens
        )

    @contextmanager
    def _plan_lost_on_error(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        """If a step fails after it was planned (an exception, Ctrl-C), that plan and the ones
        still in flight are dropped: the slots they released go into the next plan again
        (freeing an unknown slot is a no-op), and the requests they advanced are rewound, so
        that aborting them uncaches the blocks whose KV was never written. Aborting those
        requests is the caller's job (``LLM`` does it in a ``finally``)."""
        try:
            yield
        except BaseException:
            lost = [scheduler_output] + [step.plan for step in self._in_flight
                                         if step.plan is not scheduler_output]
            self._in_flight.clear()
            for plan in lost:
                self._rewind(plan)
            raise

    def _rewind(self, plan: SchedulerOutput) -> None:
        self.scheduler.finished_req_ids |= plan.finished_req_ids | plan.preempted_req_ids
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                request.num_computed_tokens = max(0, request.num_computed_tokens - num_tokens)
