"""``pagedserve serve [MODEL]``: the OpenAI-compatible HTTP server.

The ``pagedserve`` CLI (``entrypoints/cli.py``) calls ``add_cli_args(parser)`` to build the
``serve`` options (every engine option from the config dataclasses, plus the server's own) and
``main(args)`` to run. The API process loads the tokenizer; the engine core loads the model in
its own process while the server already answers (``/health``: 503 until ready).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from pagedserve.config import ModelConfig
from pagedserve.entrypoints.cli_args import add_engine_args, engine_config_from_args
from pagedserve.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedserve.entrypoints.openai.chat_output import (
    add_output_parsing_args,
    output_parsing_from_args,
)
from pagedserve.entrypoints.openai.connection_cap import DEFAULT_MAX_CONNECTIONS
from pagedserve.entrypoints.openai.http_guards import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    LOOPBACK_HOSTS,
    MAX_HEADER_BYTES,
    guarded_h11_protocol,
)
from pagedserve.entrypoints.openai.request_limits import RequestLimits
from pagedserve.entrypoints.openai.serving_models import (
    check_lora_modules,
    parse_lora_module,
    served_lora_requests,
)

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.core_client import EngineProcess
    from pagedserve.entrypoints.openai.chat_output import OutputParsing

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
DEFAULT_ENGINE_TIMEOUT_S = 60.0
CONNECTION_CLOSE_TIMEOUT_S = 2  # whole seconds: uvicorn's timeout_graceful_shutdown is an int


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own options (the engine's come from ``add_engine_args``)."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve (same as --model)",
    )
    group = parser.add_argument_group("server options")
    group.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})"
    )
    group.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})"
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API routes "
        "(/health, /metrics, /version stay open)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for this many "
        "seconds, then end the rest with an error (a stream's last event) and exit 0 "
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT})",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are answered 413 before they are parsed "
        f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    _add_request_limit_args(group)
    _add_connection_args(group)
    add_output_parsing_args(group)
    group.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names the server answers (others: 400), '*' for any "
        "(default: localhost,127.0.0.1,[::1] when --host is a loopback address, else any)",
    )
    group.add_argument(
        "--parse-special-tokens-in-content",
        action="store_true",
        help="tokenize control tokens written in chat message content (<|im_end|>, ...) as "
        "control tokens, as the template's own are; by default they are plain text, so a "
        "message cannot forge a turn of another role",
    )
    _add_lora_args(group)


def _add_lora_args(group: argparse._ArgumentGroup) -> None:
    """Adapters served under their own names (the engine's --enable-lora, --max-loras, ...
    come with the engine options)."""
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve (needs --enable-lora): a request whose model is NAME runs "
        "with the PEFT adapter folder PATH; an item may also be JSON, "
        '\'{"name": NAME, "path": PATH, "base_model_name": BASE}\' (vLLM\'s forms)',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and "
        "unload adapters while the server runs (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )


def _add_connection_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--engine-timeout",
        type=_positive_float,
        default=DEFAULT_ENGINE_TIMEOUT_S,
        help="with requests in flight, an engine that completes no step for this many seconds "
        "is declared hung: its process is killed, the requests end with engine_dead and "
        "/health answers 503 (model loading at start-up is not counted) "
        f"(default: {DEFAULT_ENGINE_TIMEOUT_S})",
    )
    group.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="close a connection that has not sent a complete request line and headers this "
        "many seconds after connecting or after its previous response "
        f"(default: {DEFAULT_HEADER_TIMEOUT_S})",
    )
    group.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="answer 408 and close the connection when a request body stalls this many "
        f"seconds between two chunks (default: {DEFAULT_BODY_TIMEOUT_S})",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="add X-Request-Id to every response: the client's own, else a new random id",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat requests bring their own chat_template (Jinja text the server renders; "
        "without this flag such a request is answered 400)",
    )
    group.add_argument(
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="past this many open connections (or requests in progress), a new request is "
        "answered 503 server_overloaded and its connection closed "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )


def _add_request_limit_args(group: argparse._ArgumentGroup) -> None:
    """Per-request cost caps (``RequestLimits``): past one, a request is answered 400."""
    limits = RequestLimits()
    for option, dest, what in (
        ("--max-n", "max_n", "completions per prompt (n)"),
        ("--max-prompts-per-request", "max_prompts", "prompts in one completions request"),
        ("--max-completions-per-request", "max_completions",
         "engine requests one request becomes (prompts x n)"),
        ("--max-logprobs", "max_logprobs", "logprobs / top_logprobs per token"),
    ):
        default = getattr(limits, dest)
        group.add_argument(
            option, dest=dest, type=_positive_int, default=default,
            help=f"at most this many {what}; more is answered 400 (default: {default})",
        )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_serve_args(parser)
    add_engine_args(parser)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts_from_args(args: argparse.Namespace) -> frozenset[str] | None:
    """The ``Host`` names to answer; None: any."""
    if args.allowed_hosts is None:
        return LOOPBACK_HOSTS if is_loopback(args.host) else None
    names = frozenset(h.strip().lower() for h in args.allowed_hosts.split(",") if h.strip())
    return None if "*" in names else names


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen before anything else starts (the engine may take GPU memory first); OSError if
    the address is taken."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def metrics_model_label(name: str) -> str:
    """The served name for ``/metrics`` (an open route): a path is cut to its last part."""
    return os.path.basename(name.rstrip("/")) or name


def _model_from_args(args: argparse.Namespace) -> None:
    """``serve MODEL`` and ``serve --model MODEL`` mean the same; both at once must agree."""
    if args.model_tag is None:
        return
    if args.model not in (ModelConfig.model, args.model_tag):
        raise ValueError(f"model: given twice ({args.model_tag!r} and --model {args.model!r})")
    args.model = args.model_tag


def _ignore_signal(signum: int, frame: object) -> None:
    pass


class _Server(uvicorn.Server):
    """uvicorn's server, plus a graceful shutdown that drains the engine first, and a way for
    the app to stop it when the engine cannot start."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.fatal_reason: str | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's: the first signal shuts down gracefully, a second SIGINT forces the exit;
        each says so on stderr, and the forced one also cuts the engine's drain."""
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            print(f"pagedserve serve: shutting down: {self.engine.num_in_flight} request(s) "
                  f"in flight get up to {self.drain_timeout:g} s to finish; press Ctrl-C "
                  "again to exit at once", file=sys.stderr)
        elif self.force_exit:
            print("pagedserve serve: exiting at once; the requests in flight are cut",
                  file=sys.stderr)
            self.engine.cut_drain()

    def stop_fatally(self, reason: str) -> None:
        self.fatal_reason = reason
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting connections; let the in-flight requests finish within the drain
        timeout, or end them with an error (streams get it as their last event); then uvicorn
        closes the connections, whose responses have all ended, and the lifespan stops the
        engine process."""
        for server in self.servers:
            server.close()
        if not self.force_exit:
            await self.engine.drain(self.drain_timeout)
        await super().shutdown(sockets)


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT / SIGTERM; 1 if the engine failed to start."""
    from pagedserve.engine.core_client import EngineProcess

    _model_from_args(args)
    output_parsing = output_parsing_from_args(args)
    check_lora_modules(args.lora_modules, args.enable_lora,
                       [args.served_model_name or args.model])
    if args.api_key is None and not is_loopback(args.host):
        print(
            f"pagedserve serve: warning: listening on {args.host} without --api-key: anyone "
            "who can reach this port can use the model",
            file=sys.stderr,
        )
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"pagedserve serve: error: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    config = engine_config_from_args(args)
    # First the engine process: its imports and model load run while this process does its own
    # (torch, the model's config, the tokenizer, the app).
    engine_process = EngineProcess(config)
    try:
        return _serve(args, sock, config, engine_process, output_parsing)
    finally:
        engine_process.close()  # idempotent: the app's shutdown closed it unless start-up failed


def _serve(
    args: argparse.Namespace,
    sock: socket.socket,
    config: EngineConfig,
    engine_process: EngineProcess,
    output_parsing: OutputParsing,
) -> int:
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.core import resolve_engine_config
    from pagedserve.entrypoints.openai.app import ServerSettings, build_app
    from pagedserve.entrypoints.openai.metrics import ServerMetrics
    from pagedserve.lora.check import lora_checker
    from pagedserve.model.tokenizer import get_tokenizer

    # The same resolution the engine process does (model files, max_model_len), checked here
    # so a bad model path fails before the server starts.
    _, resolved = resolve_engine_config(config)
    checker = lora_checker(config)
    lora_requests = served_lora_requests(args.lora_modules, checker)
    tokenizer = get_tokenizer(config.model)
    name = config.model.served_model_name or config.model.model
    metrics = ServerMetrics(metrics_model_label(name))
    engine = AsyncLLM(
        config,
        tokenizer,
        resolved.path,
        engine_process,
        observer=metrics,
        parse_special_tokens_in_content=args.parse_special_tokens_in_content,
        engine_timeout=args.engine_timeout,
        lora=checker,
    )

    server: _Server | None = None

    def on_fatal(reason: str) -> None:
        if server is not None:
            server.stop_fatally(reason)

    def open_connections() -> int:
        return 0 if server is None else len(server.server_state.connections)

    settings = ServerSettings(
        served_model_names=[name],
        model_root=config.model.model,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        limits=RequestLimits(args.max_n, args.max_prompts, args.max_completions,
                             args.max_logprobs),
        body_timeout=args.body_timeout,
        allowed_hosts=allowed_hosts_from_args(args),
        on_fatal=on_fatal,
        output_parsing=output_parsing,
        max_connections=args.max_connections,
        open_connections=open_connections,
        trust_request_chat_template=args.trust_request_chat_template,
        request_id_headers=args.enable_request_id_headers,
        lora_requests=tuple(lora_requests),
        lora_checker=checker,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    app = build_app(engine, metrics, settings)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=getattr(args, "log_level", "warning"),
        # After the drain every response has ended: this only lets the last bytes out.
        timeout_graceful_shutdown=CONNECTION_CLOSE_TIMEOUT_S,
        http=guarded_h11_protocol(args.header_timeout),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = _Server(uv_config, engine, args.shutdown_timeout)
    # uvicorn handles SIGTERM (graceful shutdown), then re-raises it to the handler found at
    # start: make that one a no-op so a SIGTERM-ed server exits 0 instead of dying of it.
    signal.signal(signal.SIGTERM, _ignore_signal)
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    host = f"[{args.host}]" if ":" in args.host else args.host
    for lora in lora_requests:
        logger.info("LoRA adapter %r (id %d): %s", lora.lora_name, lora.lora_int_id,
                    lora.lora_path)
    print(
        f"pagedserve: serving {name!r} on http://{host}:{port} "
        "(the model is loading; GET /health answers 200 once it is ready)",
        file=sys.stderr,
    )
    server.run(sockets=[sock])
    if server.fatal_reason is not None:
        print(
            f"pagedserve serve: error: the engine failed to start: {server.fatal_reason}",
            file=sys.stderr,
        )
        return 1
    return 0
