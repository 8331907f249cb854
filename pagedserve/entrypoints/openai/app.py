"""The FastAPI application: routes, API-key check, and the engine's start and stop.

The app starts answering before the model is loaded: the engine process starts in the
background (``/health`` says 503 until it is ready), and a failure to start it calls
``on_fatal`` so the server exits instead of serving 503s forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM, EngineState
from pagedserve.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimit
from pagedserve.entrypoints.openai.chat_output import OutputParsing
from pagedserve.entrypoints.openai.connection_cap import DEFAULT_MAX_CONNECTIONS, ConnectionCap
from pagedserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from pagedserve.entrypoints.openai.http_guards import DEFAULT_BODY_TIMEOUT_S, RequestGuard
from pagedserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedserve.entrypoints.openai.openapi_schema import install_token_id_bound
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.entrypoints.openai.request_id_header import RequestIdHeader
from pagedserve.entrypoints.openai.request_limits import RequestLimits
from pagedserve.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeResponse,
)
from pagedserve.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat, check_request_template
from pagedserve.entrypoints.openai.serving_common import engine_errors
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
)
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedserve.entrypoints.openai.web import add_web_routes
from pagedserve.lora.check import LoRAChecker
from pagedserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 503)
}
_HEALTH_CODES = {
    EngineState.STARTING: "engine_starting",
    EngineState.DRAINING: "server_shutting_down",
}
"""Error code of a 503 from /health, by engine state (otherwise engine_dead)."""


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: list[str]
    model_root: str
    """The model path or name the engine loaded (``root`` in ``/v1/models``)."""
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    engine_shutdown_timeout: float = 5.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    allowed_hosts: frozenset[str] | None = None
    """``Host`` names answered (without the port); None: any."""
    on_fatal: Callable[[str], None] = field(default=lambda reason: None)
    """Called when the engine fails to start: the server should exit."""
    output_parsing: OutputParsing = field(default_factory=OutputParsing)
    """Tool-call and reasoning parsers of chat completions."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    open_connections: Callable[[], int] = field(default=lambda: 0)
    """How many connections the HTTP server holds open now."""
    trust_request_chat_template: bool = False
    """Whether a chat request may bring its own ``chat_template`` (Jinja it runs)."""
    request_id_headers: bool = False
    """``--enable-request-id-headers``: responses carry ``X-Request-Id``."""
    lora_requests: tuple[LoRARequest, ...] = ()
    """``--lora-modules``, checked, with their ids (``serving_models.served_lora_requests``)."""
    lora_checker: LoRAChecker | None = None
    """Checks the adapters loaded at run time (the engine's checker of requests' adapters, so
    both know the same ids); None: the server runs without --enable-lora."""
    allow_runtime_lora_updating: bool = False
    """``--allow-runtime-lora-updating``: the load and unload routes exist."""


_BEARER = HTTPBearer(auto_error=False, description="The server's --api-key.")
"""Module level: the dependency's annotation is resolved in this module's namespace."""


def _auth_dependency(api_key: str) -> Callable:
    async def check_api_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        if credentials is None or not secrets.compare_digest(
            credentials.credentials.encode(), api_key.encode()
        ):
            raise OpenAIError(
                HTTPStatus.UNAUTHORIZED,
                "missing or invalid API key (send it as 'Authorization: Bearer KEY')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check_api_key


def _lifespan(engine: AsyncLLM, settings: ServerSettings) -> Callable:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def start() -> None:
            try:
                await engine.start()
            except Exception as e:  # the engine process failed to load the model
                logger.debug("engine failed to start: %s", e)  # main() prints it
                settings.on_fatal(str(e))
                return
            logger.info(
                "engine ready: serving %s (max_model_len %d)",
                settings.served_model_names[0],
                engine.max_model_len,
            )

        starter = asyncio.create_task(start(), name="pagedserve-engine-start")
        try:
            yield
        finally:
            starter.cancel()
            await engine.shutdown(settings.engine_shutdown_timeout)

    return lifespan


def build_app(engine: AsyncLLM, metrics: ServerMetrics, settings: ServerSettings) -> FastAPI:
    app = FastAPI(
        title="pagedserve",
        version=pagedserve.__version__,
        lifespan=_lifespan(engine, settings),
        description="OpenAI-compatible API of the pagedserve engine.",
        # FastAPI's /docs and /redoc pages load their scripts from a CDN (blank offline), and
        # no package ships a Swagger UI that renders OpenAPI 3.1: /openapi.json only.
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(
        RequestGuard, body_timeout=settings.body_timeout, allowed_hosts=settings.allowed_hosts
    )
    if settings.request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_middleware(  # the outermost: the cheapest refusal first
        ConnectionCap, max_connections=settings.max_connections,
        open_connections=settings.open_connections,
    )
    add_web_routes(app)
    app.include_router(_open_routes(engine, metrics))
    auth = [Depends(_auth_dependency(settings.api_key))] if settings.api_key else []
    app.include_router(_api_routes(engine, settings), dependencies=auth, responses=_ERRORS)
    install_token_id_bound(app, lambda: _vocab_size(engine))
    return app


def _vocab_size(engine: AsyncLLM) -> int | None:
    """The model's vocabulary size once it is loaded (it stays known after a shutdown)."""
    processor = engine.input_processor
    return None if processor is None else processor.vocab_size


def _open_routes(engine: AsyncLLM, metrics: ServerMetrics) -> APIRouter:
    """Routes that never need the API key."""
    router = APIRouter()

    @router.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict[str, str]:
        if engine.state is EngineState.READY:
            return {"status": "ok"}
        code = _HEALTH_CODES.get(engine.state, "engine_dead")
        reason = engine.dead_reason or f"the engine is {engine.state.value}"
        raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, reason, code=code)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedserve.__version__}

    @router.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router


def _api_routes(engine: AsyncLLM, settings: ServerSettings) -> APIRouter:
    router = APIRouter()
    models = OpenAIServingModels(
        settings.served_model_names, settings.model_root, settings.lora_requests,
        settings.lora_checker,
    )
    completions = OpenAIServingCompletion(engine, models, settings.limits)
    chat = OpenAIServingChat(engine, models, settings.limits, settings.output_parsing,
                             trust_request_chat_template=settings.trust_request_chat_template)
    responses = OpenAIServingResponses(chat)

    @router.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        max_len = engine.max_model_len if engine.state is EngineState.READY else None
        return ModelList(data=models.model_cards(max_len))

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await completions.create_completion(request, raw)

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(request, raw)

    @router.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}}}})
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await responses.create_response(request, raw)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        models.resolve(request.model)  # an adapter's name: the base model's tokenizer
        with engine_errors():
            tokens = await _tokenize(engine, request, settings.trust_request_chat_template)
        strs = engine.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strs
        )

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        models.resolve(request.model)
        with engine_errors():
            vocab_size = engine.vocab_size
        bad = [t for t in request.tokens if t >= vocab_size]
        if bad:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab_size})",
                param="tokens",
                code="invalid_value",
            )
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    if settings.allow_runtime_lora_updating:
        router.include_router(_lora_update_routes(models))
    return router


def _lora_update_routes(models: OpenAIServingModels) -> APIRouter:
    """vLLM's runtime adapter updates (there: VLLM_ALLOW_RUNTIME_LORA_UPDATING; here:
    ``--allow-runtime-lora-updating``); behind the API key as every API route."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load_lora_adapter(request))

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload_lora_adapter(request))

    return router


async def _tokenize(engine: AsyncLLM, request: TokenizeRequest,
                    trust_request_chat_template: bool) -> list[int]:
    engine.check_ready()
    if (request.prompt is None) == (request.messages is None):
        raise ValueError("prompt: give exactly one of prompt and messages")
    if request.prompt is not None:
        return await engine.encode_async("prompt", request.prompt, request.add_special_tokens)
    check_request_template(request.chat_template, trust_request_chat_template)
    messages = [m.chat_dict() for m in request.messages or []]
    rendered = await engine.render_chat_async(messages, request.chat_options())
    return rendered["prompt_token_ids"]
