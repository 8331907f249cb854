"""``POST /v1/chat/completions``: messages rendered with the model's chat template, one engine
request with ``n`` completions.

Streaming sends, per choice, a first chunk with the assistant role, then one chunk per new
piece of text (and its logprobs), the finish reason on the last one, an optional usage chunk,
and ``data: [DONE]``. The text is read by ``chat_output``: reasoning, content and tool calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM, RequestStream
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.entrypoints.openai.chat_output import (
    ChoiceParser,
    ChoiceStream,
    OutputParsing,
    tool_calls,
)
from pagedserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.request_limits import RequestLimits
from pagedserve.entrypoints.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
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
    sse,
    stream_error,
    submit_all,
    with_cache_salt,
)
from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels
from pagedserve.model.generation_config import default_sampling_values
from pagedserve.outputs import CompletionOutput, RequestOutputKind


def check_request_template(chat_template: str | None, trusted: bool) -> None:
    """A request's own ``chat_template`` needs ``--trust-request-chat-template`` (chat
    completions and /tokenize alike)."""
    if chat_template is not None and not trusted:
        raise ValueError("chat_template: this server renders only its own chat template "
                         "(start it with --trust-request-chat-template)")


class OpenAIServingChat:
    def __init__(
        self, engine: AsyncLLM, models: OpenAIServingModels, limits: RequestLimits,
        output_parsing: OutputParsing, *, trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.models = models
        self.limits = limits
        self.output_parsing = output_parsing
        self.trust_request_chat_template = trust_request_chat_template
        """``--trust-request-chat-template``: a request's own template renders its messages
        (Jinja runs in transformers' sandbox, but a template can still loop for long)."""
        # The model's generation_config.json values, for the fields a request leaves unset.
        self.default_sampling = default_sampling_values(engine.config.model.generation_config,
                                                        engine.model_path)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> Response:
        model, lora_request = self.models.resolve(request.model)
        ids = RequestIds.of("chatcmpl", raw, request.request_id)
        self.limits.check_chat(request)
        # The engine says max_tokens; the client may have sent max_completion_tokens.
        names = {"max_tokens": "max_completion_tokens"} if request.max_completion_tokens else {}
        with engine_errors(names):
            check_request_template(request.chat_template, self.trust_request_chat_template)
            request.check_tool_choice()
            parser = self.output_parsing.choice_parser(request)
            params = request.to_sampling_params(self.default_sampling)
            prompt = with_cache_salt(request, await self.engine.render_chat_async(
                request.chat_dicts(), request.chat_options()
            ))
            processed = await self.engine.process_inputs_async(
                prompt, params, ids.engine, request.priority, lora_request
            )
        if not request.stream:
            return await cancel_on_disconnect(
                raw, self._full(request, model, ids.response, processed, parser))
        with engine_errors():
            streams = await submit_all(
                self.engine, [processed], RequestOutputKind.DELTA, request.timeout
            )
        return StreamingResponse(
            self._stream(request, model, ids.response, processed, streams[0], parser),
            media_type="text/event-stream",
        )

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when the assistant wrote it."""
        last = request.messages[-1]
        return last.text() if request.echo and last.role == "assistant" else ""

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        content = chat_logprobs(
            completion.token_ids,
            completion.logprobs or [],
            request.top_logprobs or 0,
            logprob_token_text(request, self.engine.tokenizer),
        )
        return ChatLogprobs(content=content)

    # -- non-streaming -------------------------------------------------------------------------

    async def _full(
        self, request: ChatCompletionRequest, model: str, response_id: str,
        processed: ProcessedRequest, parser: ChoiceParser,
    ) -> Response:
        with engine_errors():
            streams = await submit_all(
                self.engine, [processed], RequestOutputKind.FINAL_ONLY, request.timeout
            )
            try:
                final = await last_output(streams[0])
            finally:
                close_all(streams)
        echo = self._echo_text(request)
        choices = []
        for c in final.outputs:
            parsed = parser.parse(c.text)
            calls = tool_calls(parsed.calls, self.output_parsing.new_call_id)
            content = echo + parsed.content if parsed.content is not None else echo or None
            choices.append(ChatChoice(
                index=c.index,
                message=ChatResponseMessage(
                    content=content, tool_calls=calls,
                    reasoning_content=parsed.reasoning if request.include_reasoning else None),
                logprobs=self._logprobs(request, c),
                finish_reason=_finish_reason(c.finish_reason, len(calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if request.return_token_ids else None,
            ))
        usage = UsageInfo.of(
            len(final.prompt_token_ids),
            sum(len(c.token_ids) for c in final.outputs),
            final.num_cached_tokens or 0,
        )
        response = ChatCompletionResponse(
            id=response_id, model=model, choices=choices, usage=usage,
            prompt_token_ids=_prompt_ids(request, processed),
        )
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs(
                final.prompt_token_ids, final.prompt_logprobs, request.prompt_logprobs,
                self.engine.tokenizer,
            )
        return JSONResponse(response.model_dump())

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(
        self, request: ChatCompletionRequest, model: str, response_id: str,
        processed: ProcessedRequest, stream: RequestStream, parser: ChoiceParser,
    ) -> AsyncIterator[str]:
        created = now()
        prompt_tokens = len(processed.prompt_token_ids)
        choice_tokens = [0] * request.n  # completion tokens so far, per choice
        cached_tokens = 0

        def chunk(choice: ChatChunkChoice, prompt_ids: list[int] | None = None) -> str:
            usage = None
            if request.continuous_usage:
                usage = UsageInfo.of(prompt_tokens, choice_tokens[choice.index], cached_tokens)
            return sse(ChatCompletionChunk(id=response_id, created=created, model=model,
                                           choices=[choice], usage=usage,
                                           prompt_token_ids=prompt_ids))

        echo = self._echo_text(request)
        texts = [ChoiceStream(parser, self.output_parsing.new_call_id) for _ in range(request.n)]
        try:
            for index in range(request.n):
                yield chunk(
                    ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")),
                    _prompt_ids(request, processed) if index == 0 else None,
                )
                if echo:
                    yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(content=echo)))
            async for output in stream:
                cached_tokens = output.num_cached_tokens or cached_tokens
                for c in output.outputs:
                    choice_tokens[c.index] += len(c.token_ids)
                    logprobs = self._logprobs(request, c)
                    text = texts[c.index]
                    delta = text.update(c.text) if c.finish_reason is None else text.finish(
                        c.text)
                    if delta is not None and not request.include_reasoning:
                        delta = _without_reasoning(delta)
                    shown_ids = c.token_ids if request.return_token_ids else None
                    if delta is None and c.finish_reason is None and not (
                        logprobs and logprobs.content
                    ) and not shown_ids:
                        continue  # text held back (a character, a stop check or markup)
                    yield chunk(
                        ChatChunkChoice(
                            index=c.index,
                            delta=delta or DeltaMessage(),
                            logprobs=logprobs,
                            finish_reason=_finish_reason(c.finish_reason, text.num_calls),
                            stop_reason=c.stop_reason,
                            token_ids=shown_ids,
                        )
                    )
            if request.include_usage:
                yield sse(
                    ChatCompletionChunk(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=UsageInfo.of(prompt_tokens, sum(choice_tokens), cached_tokens),
                    )
                )
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            stream.close()
        yield SSE_DONE


def _without_reasoning(delta: DeltaMessage) -> DeltaMessage | None:
    """``include_reasoning: false``: the delta less its reasoning; None if nothing is left."""
    if delta.content is None and delta.tool_calls is None:
        return None
    return delta.model_copy(update={"reasoning_content": None})


def _prompt_ids(request: ChatCompletionRequest, processed: ProcessedRequest) -> list[int] | None:
    """The rendered conversation's ids, with ``return_token_ids``."""
    return list(processed.prompt_token_ids) if request.return_token_ids else None


def _finish_reason(engine_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's ``"tool_calls"`` for a completion that stopped after calling tools."""
    return "tool_calls" if engine_reason == "stop" and num_calls else engine_reason
