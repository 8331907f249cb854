"""AsyncLLM: the server's engine handle, the API process's half of the engine.

The API process validates and tokenizes requests (``InputProcessor``), sends them to the engine
core in its own process (``EngineCoreClient``), and turns the core's per-step outputs into
``RequestOutput`` objects (``OutputProcessor``: detokenization, stop strings, ``n`` fan-in).
One background task, the output loop, receives every step and routes each output to the
stream of its request. A caller that stops iterating ``generate`` (a client that went away)
has its request aborted in the core at once, so its KV blocks are freed; so has a request
past its ``timeout``, and on shutdown ``drain`` lets the in-flight requests finish for a while,
then aborts the rest (see ``request_stream.py`` for the ways a request ends).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, Protocol

from pagedserve.beam_search import BeamSearchParams
from pagedserve.config import EngineConfig
from pagedserve.core.request import RequestStatus
from pagedserve.core.request_queue import check_priority
from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.core.stats import SchedulerStats
from pagedserve.engine.beam_search_stream import BeamSearchStream
from pagedserve.engine.chat_messages import ChatRenderOptions
from pagedserve.engine.core_client import EngineCoreClient, EngineProcess
from pagedserve.engine.core_proc import EngineDeadError, EngineInfo, StepResult
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.request_stream import (
    EngineNotReadyError,
    EngineOverloadedError,
    RequestStream,
    RequestTimeoutError,
    ServerShuttingDownError,
)
from pagedserve.engine.stats_logger import StatsLogger
from pagedserve.lora.check import LoRAChecker, lora_checker
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput, RequestOutputKind
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_POLL_S = 1.0
"""How often the stats task hands the latest step's stats to the ``StatsLogger`` (which logs
a line only once per its interval)."""
DRAIN_POLL_S = 0.05
"""How often ``drain`` looks whether the in-flight requests have finished."""
TOKENIZER_THREADS = 1
"""Threads that tokenize long text and apply chat templates, off the event loop (the tokenizer
releases the GIL while it encodes, so a long prompt does not stall the other requests). One:
the engine and the event loop keep the other cores."""
WATCHDOG_MAX_PERIOD_S = 1.0
"""The output loop looks at least this often whether the engine is still making progress."""
INLINE_TEXT_CHARS = 4096
"""Prompts up to this many characters are tokenized on the event loop: quicker than a thread
hop, and they never queue behind a long prompt."""

__all__ = [
    "AsyncLLM",
    "EngineNotReadyError",
    "EngineOverloadedError",
    "EngineState",
    "RequestStream",
    "RequestTimeoutError",
    "ServerShuttingDownError",
]


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    """SIGTERM: no new requests; the in-flight ones finish (or are cut at the timeout)."""
    DEAD = "dead"
    STOPPED = "stopped"


class StatsObserver(Protocol):
    """Receives what the metrics need (see ``entrypoints/openai/metrics.py``)."""

    def on_step(self, stats: SchedulerStats, queue_times: list[float]) -> None: ...

    def on_first_token(self, ttft: float) -> None: ...

    def on_inter_token(self, itl: float) -> None: ...

    def on_completion_finished(self, finish_reason: str) -> None: ...

    def on_request_finished(self, e2e: float) -> None: ...

    def on_engine_dead(self) -> None:
        """The engine process is gone: nothing runs, no KV block is held."""
        ...


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        model_path: Path,
        engine: EngineProcess,
        observer: StatsObserver | None = None,
        parse_special_tokens_in_content: bool = False,
        engine_timeout: float | None = None,
        lora: LoRAChecker | None = None,
    ) -> None:
        """``lora``: the checker of requests' adapters, where the caller has one (the server
        checks its --lora-modules with it before the engine starts); else one of its own."""
        self.config = config
        self.lora = lora if lora is not None else lora_checker(config)
        self.engine_timeout = engine_timeout
        """Seconds the engine may go without a step while requests are in flight before it
        is declared hung (killed, requests failed); None: never."""
        self._last_progress = time.monotonic()
        self.parse_special_tokens_in_content = parse_special_tokens_in_content
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.engine = engine
        """The engine process, spawned by the caller (it loads the model meanwhile)."""
        self.observer = observer
        self.state = EngineState.STARTING
        self.dead_reason: str | None = None
        self.info: EngineInfo | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor = OutputProcessor(tokenizer)
        self.latest_stats: SchedulerStats | None = None
        self.stats_logger = StatsLogger()
        self._stats_task: asyncio.Task | None = None
        self._client: EngineCoreClient | None = None
        self._streams: dict[str, RequestStream] = {}
        self._stream_of_child: dict[str, RequestStream] = {}
        """Engine-core request id (a child, for n > 1) -> its request's stream."""
        self._searches: set[BeamSearchStream] = set()
        """Beam searches in flight (between two rounds they have no stream in ``_streams``)."""
        self._output_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="pagedserve-tokenize"
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait for the engine process to load its model; raises if it fails."""
        self._client = EngineCoreClient(self.engine)
        try:
            self.info = await self._client.wait_ready()
        except EngineDeadError as e:
            self._mark_dead(str(e))
            raise
        self.input_processor = InputProcessor.for_model(
            self.tokenizer,
            self.model_path,
            self.info.max_model_len,
            self.info.vocab_size,
            self.parse_special_tokens_in_content,
            self.config.model.chat_template,
            self.lora,
        )
        self.state = EngineState.READY
        self._output_task = asyncio.create_task(self._output_loop(), name="pagedserve-output-loop")
        self.stats_logger = StatsLogger()  # its first window starts now, not at the load
        self._stats_task = asyncio.create_task(self._stats_loop(), name="pagedserve-stats-log")

    async def drain(self, timeout: float) -> int:
        """Graceful shutdown's first half: refuse new requests (``ServerShuttingDownError``),
        give the in-flight ones up to ``timeout`` s to finish, then end the rest with
        ``ServerShuttingDownError`` and abort them in the core. Returns how many were cut."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        deadline = time.monotonic() + timeout
        # Polled, up to the deadline: the output loop drops each stream as it finishes.
        while (self._streams or self._searches) and self.state is EngineState.DRAINING and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(DRAIN_POLL_S)
        cut: list[RequestStream] = [*self._searches, *self._streams.values()]
        error = ServerShuttingDownError(
            f"the server is shutting down: the request did not finish within the shutdown "
            f"timeout ({timeout:g} s) and was aborted"
        )
        for stream in cut:
            stream.fail(error)
            if isinstance(stream, BeamSearchStream):
                stream.cancel()  # its running round is among the streams cut
                continue
            with contextlib.suppress(EngineDeadError):  # a dead core holds no blocks
                await self.abort(stream.request_id)
        if cut:
            logger.warning("shutdown: %d request(s) cut after %g s", len(cut), timeout)
        return len(cut)

    def cut_drain(self) -> None:
        """End a running ``drain`` now (a second Ctrl-C): it cuts the requests still in
        flight at its next poll instead of waiting out its timeout."""
        if self.state is EngineState.DRAINING:
            self.state = EngineState.STOPPED

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._fail_all(EngineDeadError("the server is shutting down"))
        for task in (self._output_task, self._stats_task):
            if task is not None:
                task.cancel()
        if self._client is not None:
            await self._client.shutdown(timeout)
        self.engine.close()  # stops an engine that start() never reached; idempotent
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def engine_pid(self) -> int | None:
        return self.engine.proc.pid

    @property
    def max_model_len(self) -> int:
        return self._ready_processor().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._ready_processor().vocab_size

    def check_ready(self) -> None:
        """Raise ``EngineNotReadyError`` / ``ServerShuttingDownError`` / ``EngineDeadError``
        unless requests can be served."""
        if self.state is EngineState.STARTING:
            raise EngineNotReadyError("the engine is starting (loading the model)")
        if self.state is EngineState.DRAINING:
            raise ServerShuttingDownError("the server is shutting down; it takes no new request")
        if self.state is not EngineState.READY:
            raise EngineDeadError(self.dead_reason or "the engine is not running")

    def _ready_processor(self) -> InputProcessor:
        self.check_ready()
        assert self.input_processor is not None
        return self.input_processor

    # -- requests ------------------------------------------------------------------------------

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatRenderOptions
    ) -> dict[str, Any]:
        return self._ready_processor().render_chat(messages, options)

    async def render_chat_async(
        self, messages: list[dict[str, Any]], options: ChatRenderOptions
    ) -> dict[str, Any]:
        """``render_chat``, in a tokenizer thread for a long conversation."""
        processor = self._ready_processor()
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict))
        if chars <= INLINE_TEXT_CHARS:
            return processor.render_chat(messages, options)
        return await self._in_tokenizer_thread(processor.render_chat, messages, options)

    async def encode_async(self, field: str, text: str, add_special_tokens: bool) -> list[int]:
        """``InputProcessor.encode`` in a tokenizer thread."""
        processor = self._ready_processor()
        if len(text) <= INLINE_TEXT_CHARS:
            return processor.encode(field, text, add_special_tokens)
        return await self._in_tokenizer_thread(processor.encode, field, text, add_special_tokens)

    def process_inputs(
        self, prompt: PromptType, params: SamplingParams | BeamSearchParams,
        request_id: str | None = None, lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize a request (nothing is sent yet). Raises ``ValueError`` naming
        the field, ``EngineOverloadedError`` beyond ``max_waiting_requests``, and
        ``EngineNotReadyError`` / ``EngineDeadError`` when requests cannot be served."""
        processor = self._admit_processor()
        return processor.process_inputs(request_id or uuid.uuid4().hex, prompt, params,
                                        lora_request=lora_request)

    async def process_inputs_async(
        self,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """``process_inputs`` with the tokenizing in a tokenizer thread; ``priority`` (lower
        first) needs the ``priority`` scheduling policy; ``lora_request``: the adapter."""
        check_priority(self.config.scheduler.policy, priority)
        processor = self._admit_processor()
        request_id = request_id or uuid.uuid4().hex
        args = (request_id, prompt, params, None, priority, lora_request)
        if not isinstance(prompt, str) or len(prompt) <= INLINE_TEXT_CHARS:
            return processor.process_inputs(*args)
        return await self._in_tokenizer_thread(processor.process_inputs, *args)

    async def _in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def _admit_processor(self) -> InputProcessor:
        processor = self._ready_processor()
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.num_waiting_for_first_token() >= limit:
            raise EngineOverloadedError(f"{limit} requests are already waiting; retry later")
        return processor

    async def submit(
        self,
        processed: ProcessedRequest,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        timeout: float | None = None,
    ) -> RequestStream:
        """Send a processed request to the engine core; its outputs arrive on the stream.
        With ``timeout`` (seconds from arrival), the stream aborts the request and raises
        ``RequestTimeoutError`` once it runs past it. A beam search's stream sends its rounds
        itself (``BeamSearchStream``)."""
        self.check_ready()
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout: must be positive, got {timeout}")
        if processed.beam_search is None:
            return await self._submit(processed, output_kind, timeout)
        search = BeamSearchStream(self, processed, timeout)
        self._searches.add(search)
        search.on_end(self._searches.discard)
        return search

    async def submit_expansion(self, processed: ProcessedRequest) -> RequestStream:
        """One round of a running beam search: served while draining too, as the search's
        next step rather than a new request."""
        if self.state is not EngineState.DRAINING:
            self.check_ready()
        return await self._submit(processed, RequestOutputKind.FINAL_ONLY, None)

    async def _submit(
        self, processed: ProcessedRequest, output_kind: RequestOutputKind, timeout: float | None
    ) -> RequestStream:
        assert self._client is not None
        stream = RequestStream(self, processed, timeout)
        if not self._streams:
            self._last_progress = time.monotonic()  # an idle engine owed no step until now
        self.output_processor.add_request(processed, output_kind)
        self._streams[processed.request_id] = stream
        self._stream_of_child.update(dict.fromkeys(stream.child_ids, stream))
        try:
            for request in processed.requests:
                await self._client.add_request(request)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request until it finishes; closing the generator early aborts it."""
        processed = self.process_inputs(prompt, params, request_id, lora_request)
        stream = await self.submit(processed, output_kind, timeout)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def num_waiting_for_first_token(self) -> int:
        return sum(1 for s in self._streams.values() if s.last_token_time is None)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's stream (the output loop drops it too, on its last output)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for child_id in stream.child_ids:
                self._stream_of_child.pop(child_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop a request: forget its outputs and abort its children in the engine core."""
        self.forget(request_id)
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids and self._client is not None and not self._client.is_dead:
            await self._client.abort_requests(child_ids)

    def abort_nowait(self, request_id: str) -> None:
        """Abort from a ``finally`` of a cancelled caller: its own awaits may be cancelled again
        (anyio cancel scopes), so the abort runs in a task of its own."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the output loop -----------------------------------------------------------------------

    async def _output_loop(self) -> None:
        assert self._client is not None
        try:
            while True:
                step = await self._next_step()
                self._last_progress = time.monotonic()
                await self._handle_step(step)
        except EngineDeadError as e:
            if self.state is EngineState.READY:
                logger.error("engine process died: %s", e)
                self._mark_dead(str(e))
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output loop failed")
            self._mark_dead(f"output loop failed: {e!r}")

    async def _stats_loop(self) -> None:
        """The periodic stats line, from the latest step's (cumulative) stats; a step that
        came before the line is already counted, so idle time adds no line."""
        while True:
            await asyncio.sleep(STATS_POLL_S)
            if self.latest_stats is not None:
                self.stats_logger.record(self.latest_stats)

    async def _next_step(self) -> StepResult:
        """The engine's next step; ``EngineDeadError`` if it exits or, with requests in
        flight, sends no step for ``engine_timeout`` s (the process is then killed)."""
        assert self._client is not None
        receive = asyncio.ensure_future(self._client.get_output())
        # If this loop is cancelled, it may still end with the engine's death: retrieved
        # here, so that it is not logged as an exception nobody saw.
        receive.add_done_callback(lambda f: f.cancelled() or f.exception())
        period = min(WATCHDOG_MAX_PERIOD_S, self.engine_timeout or WATCHDOG_MAX_PERIOD_S)
        try:
            while True:
                done, _ = await asyncio.wait({receive}, timeout=period)
                if done:
                    return receive.result()
                stalled = time.monotonic() - self._last_progress
                if self.engine_timeout is not None and self._streams and (
                    stalled > self.engine_timeout
                ):
                    self._client.kill()
                    raise EngineDeadError(
                        f"the engine made no progress for {stalled:.1f} s with "
                        f"{len(self._streams)} request(s) in flight (--engine-timeout "
                        f"{self.engine_timeout:g}); its process was killed"
                    )
        finally:
            receive.cancel()

    async def _handle_step(self, step: StepResult) -> None:
        now = time.monotonic()
        self._record_token_times(step.outputs, now)
        result = self.output_processor.process_outputs(step.outputs)
        for output in result.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                # Forget it here too: a consumer that never iterates must not leak its entry.
                self.forget(output.request_id)
            self._record_finishes(stream, output, now)
            stream.queue.put_nowait(output)
        if result.reqs_to_finish:
            assert self._client is not None
            await self._client.finish_requests(
                result.reqs_to_finish, RequestStatus.FINISHED_STOPPED
            )
        self.latest_stats = step.stats
        if self.observer is not None and step.stats is not None:
            self.observer.on_step(step.stats, step.queue_times)

    def _record_token_times(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """First-token and inter-token times, per request and step, whatever the output kind
        (a non-streaming request sees one output at the end, but its tokens came step by step)."""
        advanced: dict[str, RequestStream] = {}  # the n children of a request count once
        for out in outputs:
            stream = self._stream_of_child.get(out.req_id)
            if out.new_token_ids and stream is not None:
                advanced[stream.request_id] = stream
        for stream in advanced.values():
            if self.observer is not None:
                if stream.last_token_time is None:
                    self.observer.on_first_token(now - stream.arrival_time)
                else:
                    self.observer.on_inter_token(now - stream.last_token_time)
            stream.last_token_time = now

    def _record_finishes(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        if self.observer is None:
            return
        # Each completion is reported finished exactly once (DELTA and FINAL_ONLY alike).
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.observer.on_completion_finished(completion.finish_reason)
        if output.finished:
            self.observer.on_request_finished(now - stream.arrival_time)

    def _mark_dead(self, reason: str) -> None:
        self.state = EngineState.DEAD
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        if self.observer is not None:
            self.observer.on_engine_dead()

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
