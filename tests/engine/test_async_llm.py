"""AsyncLLM over a real engine process with a model-free core: streaming, n fan-in, stop
strings finished in the core, aborts on close, metrics callbacks, and engine death."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineState,
)
from pagedserve.engine.core_client import EngineProcess
from pagedserve.engine.core_proc import EngineDeadError
from pagedserve.outputs import RequestOutputKind
from pagedserve.sampling_params import SamplingParams
from tests.engine.fake_core import FakeCore, expected_tokens
from tests.engine.tiny_models import make_tokenizer

LONG_CONTEXT = 100_000


class RecordingObserver:
    def __init__(self) -> None:
        self.stats = None
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.finish_reasons: list[str] = []
        self.e2es: list[float] = []
        self.queue_times: list[float] = []

    def on_step(self, stats, queue_times: list[float]) -> None:
        self.stats = stats
        self.queue_times += queue_times

    def on_first_token(self, ttft: float) -> None:
        self.ttfts.append(ttft)

    def on_inter_token(self, itl: float) -> None:
        self.itls.append(itl)

    def on_completion_finished(self, finish_reason: str) -> None:
        self.finish_reasons.append(finish_reason)

    def on_request_finished(self, e2e: float) -> None:
        self.e2es.append(e2e)

    def on_engine_dead(self) -> None:
        self.stats = None


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _engine(tokenizer, tmp_path: Path, observer: RecordingObserver | None = None) -> AsyncLLM:
    config = EngineConfig.from_kwargs(max_model_len=LONG_CONTEXT)
    return AsyncLLM(config, tokenizer, tmp_path, EngineProcess(config, FakeCore),
                    observer=observer)


async def _wait_idle(observer: RecordingObserver, timeout: float) -> float:
    start = time.monotonic()
    while observer.stats is None or observer.stats.num_running != 0:
        assert time.monotonic() - start < timeout, "the engine still runs the request"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_generate_stream_n_and_metrics(tokenizer, tmp_path: Path) -> None:
    observer = RecordingObserver()

    async def run() -> None:
        engine = _engine(tokenizer, tmp_path, observer)
        with pytest.raises(EngineNotReadyError):
            engine.check_ready()
        await engine.start()
        try:
            params = SamplingParams(max_tokens=5, n=2, temperature=0.0)
            tokens: dict[int, list[int]] = {0: [], 1: []}
            texts: dict[int, str] = {0: "", 1: ""}
            async for out in engine.generate([7, 8], params):
                for c in out.outputs:
                    tokens[c.index] += c.token_ids
                    texts[c.index] += c.text
            assert tokens == {0: expected_tokens([8], 5), 1: expected_tokens([8], 5)}
            assert texts[0] == tokenizer.decode(tokens[0], skip_special_tokens=True)
            final = [
                o
                async for o in engine.generate(
                    "Hello", SamplingParams(max_tokens=3), output_kind=RequestOutputKind.FINAL_ONLY
                )
            ]
            assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 3
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert observer.finish_reasons == ["length"] * 3
    # ITLs: >= 4 of the streamed request, 2 of the FINAL_ONLY one (its tokens came step by step).
    assert len(observer.ttfts) == 2 and len(observer.e2es) == 2 and len(observer.itls) >= 6
    assert len(observer.queue_times) == 3  # one per child request in the core


def test_stop_string_finishes_the_request_in_the_core(tokenizer, tmp_path: Path) -> None:
    observer = RecordingObserver()
    prompt = [40]
    full_text = tokenizer.decode(expected_tokens(prompt, 30))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    assert stop.strip(), "pick a prompt whose continuation decodes to visible text"

    async def run() -> None:
        engine = _engine(tokenizer, tmp_path, observer)
        await engine.start()
        try:
            outs = [
                o
                async for o in engine.generate(
                    prompt, SamplingParams(max_tokens=10_000, stop=[stop])
                )
            ]
            text = "".join(c.text for o in outs for c in o.outputs)
            assert outs[-1].outputs[0].finish_reason == "stop"
            assert text == full_text[: full_text.index(stop)]
            assert await _wait_idle(observer, 2.0) < 2.0
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.serial  # idle within 2 s
def test_closing_the_stream_aborts_at_once(tokenizer, tmp_path: Path) -> None:
    observer = RecordingObserver()

    async def run() -> None:
        engine = _engine(tokenizer, tmp_path, observer)
        await engine.start()
        try:
            gen = engine.generate([3], SamplingParams(max_tokens=50_000))
            for _ in range(3):
                await anext(gen)
            assert observer.stats.num_running == 1
            await gen.aclose()
            assert await _wait_idle(observer, 2.0) < 2.0
            assert observer.stats.kv_cache_usage == 0.0
            assert (
                engine.num_in_flight == 0 and not engine.output_processor.has_unfinished_requests()
            )
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.serial  # failed within 2 s
def test_engine_death_fails_in_flight_requests(tokenizer, tmp_path: Path) -> None:
    async def run() -> None:
        engine = _engine(tokenizer, tmp_path)
        await engine.start()
        try:
            gen = engine.generate([3], SamplingParams(max_tokens=50_000))
            await anext(gen)
            os.kill(engine.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert time.monotonic() - start < 2.0
            assert engine.state is EngineState.DEAD
            with pytest.raises(EngineDeadError):
                engine.process_inputs([1], SamplingParams())
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_back_pressure_refuses_beyond_max_waiting_requests(tokenizer, tmp_path: Path) -> None:
    async def run() -> None:
        config = EngineConfig.from_kwargs(max_model_len=LONG_CONTEXT, max_waiting_requests=1)
        engine = AsyncLLM(config, tokenizer, tmp_path, EngineProcess(config, FakeCore))
        await engine.start()
        try:
            first = await engine.submit(engine.process_inputs([1], SamplingParams(max_tokens=50)))
            # No token yet (the output loop has not run since): the one waiting slot is taken.
            with pytest.raises(EngineOverloadedError):
                engine.process_inputs([2], SamplingParams(max_tokens=5))
            await anext(first)  # its first token: it no longer waits
            second = [o async for o in engine.generate([2], SamplingParams(max_tokens=2))]
            assert second[-1].finished
            first.close()
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_validation_errors_name_the_field(tokenizer, tmp_path: Path) -> None:
    async def run() -> None:
        engine = _engine(tokenizer, tmp_path)
        await engine.start()
        try:
            with pytest.raises(ValueError, match="prompt_token_ids"):
                engine.process_inputs([10_000], SamplingParams())
            with pytest.raises(ValueError, match="max_tokens"):
                engine.process_inputs([1], SamplingParams(max_tokens=LONG_CONTEXT))
        finally:
            await engine.shutdown()
        assert os.path.exists(tmp_path)

    asyncio.run(run())


@pytest.mark.serial  # timed against a 0.5 s engine timeout
def test_hung_engine_is_declared_dead(tokenizer, tmp_path: Path) -> None:
    """SIGSTOP the engine mid-request: after ``engine_timeout`` without a step the request
    ends with EngineDeadError, the engine process is killed and the gauges read 0."""
    timeout = 0.5

    async def run() -> None:
        observer = RecordingObserver()
        config = EngineConfig.from_kwargs(max_model_len=LONG_CONTEXT)
        engine = AsyncLLM(config, tokenizer, tmp_path, EngineProcess(config, FakeCore),
                          observer=observer, engine_timeout=timeout)
        await engine.start()
        try:
            idle = time.monotonic()
            await asyncio.sleep(timeout * 2)  # idle for longer than the timeout: not a hang
            assert engine.state is EngineState.READY
            gen = engine.generate([3], SamplingParams(max_tokens=50_000))
            await anext(gen)
            assert time.monotonic() - idle > timeout * 2
            os.kill(engine.engine_pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="no progress for .*--engine-timeout"):
                async for _ in gen:
                    pass
            assert timeout < time.monotonic() - start < timeout + 3.0
            assert engine.state is EngineState.DEAD and observer.stats is None
            with pytest.raises(EngineDeadError):
                engine.process_inputs([1], SamplingParams())
        finally:
            await engine.shutdown()

    asyncio.run(run())
