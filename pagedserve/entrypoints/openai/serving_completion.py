"""``POST /v1/completions``: one engine request per prompt, ``n`` completions each.

Choice ``i * n + j`` is completion ``j`` of prompt ``i``. Non-streaming requests wait for the
final outputs (and are cancelled, their requests aborted, if the client goes away); streaming
requests send one SSE chunk per new piece of text, then an optional usage chunk, then
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM, RequestStream
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.entrypoints.openai.logprobs import append_completion_logprobs, prompt_logprobs
from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.request_limits import RequestLimits
from pagedserve.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    now,
)
from pagedserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    RequestIds,
    cancel_on_disconnect,
    close_all,
    engine_errors,
    last_output,
    logprob_token_text,
    merge_streams,
    sse,
    stream_error,
    submit_all,
    with_cache_salt,
)
from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels
from pagedserve.model.generation_config import default_sampling_values
from pagedserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind


class OpenAIServingCompletion:
    def __init__(
        self, engine: AsyncLLM, models: OpenAIServingModels, limits: RequestLimits
    ) -> None:
        self.engine = engine
        self.models = models
        self.limits = limits
        # The model's generation_config.json values, for the fields a request leaves unset.
        self.default_sampling = default_sampling_values(engine.config.model.generation_config,
                                                        engine.model_path)

    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        model, lora_request = self.models.resolve(request.model)
        ids = RequestIds.of("cmpl", raw, request.request_id)
        self.limits.check_completion(request)
        with engine_errors():
            params = request.to_sampling_params(self.default_sampling)
            processed = [
                await self.engine.process_inputs_async(
                    with_cache_salt(request, await self._engine_prompt(request, prompt)), params,
                    f"{ids.engine}-{i}", request.priority, lora_request,
                )
                for i, prompt in enumerate(request.prompts())
            ]
        if not request.stream:
            return await cancel_on_disconnect(
                raw, self._full(request, model, ids.response, processed)
            )
        with engine_errors():
            streams = await submit_all(
                self.engine, processed, RequestOutputKind.DELTA, request.timeout
            )
        return StreamingResponse(
            self._stream(request, model, ids.response, streams), media_type="text/event-stream"
        )

    # -- helpers -------------------------------------------------------------------------------

    async def _engine_prompt(
        self, request: CompletionRequest, prompt: str | list[int]
    ) -> str | list[int] | dict:
        """A text prompt without the tokenizer's special tokens, when the request says so."""
        if request.add_special_tokens or not isinstance(prompt, str):
            return prompt
        ids = await self.engine.encode_async("prompt", prompt, add_special_tokens=False)
        return {"prompt": prompt, "prompt_token_ids": ids}

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids)

    def _echo_logprobs(
        self, request: CompletionRequest, output: RequestOutput, prompt_text: str,
        logprobs: CompletionLogprobs,
    ) -> int:
        """Prompt tokens' entries (echo with logprobs); returns the offset after the prompt."""
        assert request.logprobs is not None
        positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        append_completion_logprobs(
            logprobs, output.prompt_token_ids, positions,
            logprob_token_text(request, self.engine.tokenizer), 0, request.logprobs,
        )
        return len(prompt_text)

    def _choice(
        self,
        request: CompletionRequest,
        index: int,
        completion: CompletionOutput,
        text: str,
        logprobs: CompletionLogprobs | None,
    ) -> CompletionChoice:
        """The choice's text and logprobs as given; its token ids (``return_token_ids``)."""
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=_shown_ids(request, completion) if request.return_token_ids else None,
        )

    # -- non-streaming -------------------------------------------------------------------------

    async def _full(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        processed: list[ProcessedRequest],
    ) -> Response:
        with engine_errors():
            streams = await submit_all(
                self.engine, processed, RequestOutputKind.FINAL_ONLY, request.timeout
            )
            try:
                finals = await asyncio.gather(*(last_output(s) for s in streams))
            finally:
                close_all(streams)
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for i, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            cached_tokens += final.num_cached_tokens or 0
            for completion in final.outputs:
                completion_tokens += len(_shown_ids(request, completion))
                choices.append(
                    self._full_choice(request, i * request.n + completion.index, final, completion)
                )
        response = CompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        )
        return JSONResponse(response.model_dump())

    def _full_choice(
        self,
        request: CompletionRequest,
        index: int,
        final: RequestOutput,
        completion: CompletionOutput,
    ) -> CompletionChoice:
        prompt_text = self._prompt_text(final) if request.echo else ""
        text = prompt_text if request.echo_only else prompt_text + completion.text
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            offset = 0
            if request.echo:
                offset = self._echo_logprobs(request, final, prompt_text, logprobs)
            self._append_logprobs(request, logprobs, completion, offset)
        choice = self._choice(request, index, completion, text, logprobs)
        self._add_prompt_fields(request, choice, final)
        return choice

    def _append_logprobs(
        self, request: CompletionRequest, logprobs: CompletionLogprobs,
        completion: CompletionOutput, offset: int,
    ) -> None:
        if request.echo_only:
            return
        assert request.logprobs is not None
        append_completion_logprobs(
            logprobs,
            completion.token_ids,
            completion.logprobs or [],
            logprob_token_text(request, self.engine.tokenizer),
            offset,
            request.logprobs,
        )

    def _add_prompt_fields(
        self, request: CompletionRequest, choice: CompletionChoice, output: RequestOutput
    ) -> None:
        """``prompt_logprobs`` and (``return_token_ids``) the prompt's ids, on a choice's full
        response or first chunk."""
        if request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(
                output.prompt_token_ids, output.prompt_logprobs, request.prompt_logprobs,
                self.engine.tokenizer,
            )
        if request.return_token_ids:
            choice.prompt_token_ids = list(output.prompt_token_ids)

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(
        self, request: CompletionRequest, model: str, request_id: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        created = now()
        state = _StreamState()
        try:
            async for i, output in merge_streams(streams):
                state.prompt_tokens.setdefault(i, len(output.prompt_token_ids))
                if output.num_cached_tokens:
                    state.cached_tokens[i] = output.num_cached_tokens
                for completion in output.outputs:
                    choice = self._chunk_choice(
                        request, i * request.n + completion.index, output, completion, state
                    )
                    if choice is not None:
                        usage = state.usage(i, choice.index) if request.continuous_usage else None
                        yield sse(
                            CompletionResponse(id=request_id, created=created, model=model,
                                               choices=[choice], usage=usage)
                        )
            if request.include_usage:
                usage = UsageInfo.of(
                    sum(state.prompt_tokens.values()),
                    sum(state.completion_tokens.values()),
                    sum(state.cached_tokens.values()),
                )
                yield sse(
                    CompletionResponse(
                        id=request_id, created=created, model=model, choices=[], usage=usage
                    )
                )
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            close_all(streams)
        yield SSE_DONE

    def _chunk_choice(
        self,
        request: CompletionRequest,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        state: _StreamState,
    ) -> CompletionChoice | None:
        shown_ids = _shown_ids(request, completion)
        state.completion_tokens[index] = state.completion_tokens.get(index, 0) + len(shown_ids)
        shown_text = "" if request.echo_only else completion.text
        text = shown_text
        logprobs = CompletionLogprobs() if request.logprobs is not None else None
        offset = state.text_offsets.get(index, 0)
        if request.echo and index not in state.text_offsets:
            prompt_text = self._prompt_text(output)
            if logprobs is not None:
                self._echo_logprobs(request, output, prompt_text, logprobs)
            text = prompt_text + text
            offset = len(prompt_text)
        if logprobs is not None:
            self._append_logprobs(request, logprobs, completion, offset)
        state.text_offsets[index] = offset + len(shown_text)
        news = bool(text) or completion.finish_reason is not None or bool(
            logprobs and logprobs.tokens) or (request.return_token_ids and bool(shown_ids))
        if not news:
            return None  # nothing to show yet (text held back until a character completes)
        choice = self._choice(request, index, completion, text, logprobs)
        if index not in state.prompt_sent:
            self._add_prompt_fields(request, choice, output)
            state.prompt_sent.add(index)
        return choice


def _shown_ids(request: CompletionRequest, completion: CompletionOutput) -> list[int]:
    """The completion's token ids the response shows: none for echo with ``max_tokens: 0``."""
    return [] if request.echo_only else completion.token_ids


class _StreamState:
    """Per streaming request: counts for usage (by prompt and by choice index), and each
    choice's text length so far."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.text_offsets: dict[int, int] = {}
        self.prompt_sent: set[int] = set()
        """Choices whose first chunk went out (it carries the prompt's fields)."""

    def usage(self, prompt: int, choice: int) -> UsageInfo:
        """Prompt ``prompt``'s counts with choice ``choice``'s completion tokens so far."""
        return UsageInfo.of(self.prompt_tokens[prompt], self.completion_tokens.get(choice, 0),
                            self.cached_tokens.get(prompt, 0))
