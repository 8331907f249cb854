"""The ``pagedserve`` command: ``generate``, ``chat``, and the ``serve`` / ``bench`` / ``trace``
commands whose modules other parts of the package provide.

Start-up is kept fast: this module imports argparse and the config dataclasses only; torch,
transformers and the engine are imported when a command needs them, with the cyclic garbage
collector paused (``startup_gc_paused``). Bad options and bad values end with one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from pagedserve.engine.gc_heap import startup_gc_paused
from pagedserve.entrypoints.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    engine_kwargs_from_args,
    sampling_params_from_args,
)

PROG = "pagedserve"
USAGE_ERROR = 2

PLUGIN_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.entrypoints.openai.api_server", "run the OpenAI-compatible HTTP server"),
    "bench": ("pagedserve.entrypoints.bench", "run a benchmark"),
    "trace": ("pagedserve.entrypoints.trace", "show one engine step, stop by stop"),
}
"""Command -> (module, help). The module provides ``main(args) -> int | None`` and optionally
``add_cli_args(parser)`` (default: the engine options)."""


class CliParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        if "required: prompt" in message:
            # An option taking several values (--stop, --stop-token-ids) before the prompt
            # takes the prompt as one of its values.
            message += ("; an option that takes several values (--stop S ...) takes everything "
                        "up to the next option: put the prompt first")
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


LOG_LEVELS = ("debug", "info", "warning", "error")
SERVER_COMMANDS = frozenset({"serve"})
"""Commands that log at INFO by default, as a server does (start-up phases, the periodic
stats line); the others keep the terminal for the model's text and log warnings only."""


def _common_args(parser: argparse.ArgumentParser, command: str) -> None:
    default = "info" if command in SERVER_COMMANDS else "warning"
    parser.add_argument(
        "--log-level",
        default=default,
        choices=LOG_LEVELS,
        help=f"logging level on stderr (default: {default})",
    )


def _add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate a continuation of PROMPT, streamed")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template",
    )
    _common_args(p, "generate")
    add_engine_args(p)
    add_sampling_args(p)


def _add_chat(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="chat with the model in the terminal (/exit to quit)")
    _common_args(p, "chat")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(max_tokens=None)  # a reply runs to EOS (or the end of the context)


def _load_plugin(command: str) -> Any:
    module_name = PLUGIN_COMMANDS[command][0]
    if importlib.util.find_spec(module_name) is None:
        sys.stderr.write(
            f"{PROG} {command}: not available in this build (module {module_name} is missing)\n"
        )
        sys.exit(USAGE_ERROR)
    return importlib.import_module(module_name)


def build_parser(command: str | None = None) -> tuple[CliParser, Any]:
    """The parser; a plugin command's options are added only when it is the ``command`` run
    (its module is imported then, not on every start-up). Returns (parser, plugin module)."""
    parser = CliParser(prog=PROG, description="pagedserve: LLM inference and serving")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(subparsers)
    _add_chat(subparsers)
    plugin = None
    for name, (_, help_text) in PLUGIN_COMMANDS.items():
        p = subparsers.add_parser(name, help=help_text)
        if name == command:
            plugin = _load_plugin(name)
            _common_args(p, name)
            if hasattr(plugin, "add_cli_args"):
                plugin.add_cli_args(p)
            else:
                add_engine_args(p)
    return parser, plugin


def _write_stream(llm: Any, prompt: Any, params: Any, out: TextIO, pieces: list[str]) -> None:
    """Write the completion to ``out`` as it is generated, and append each piece to ``pieces``
    (which keeps the text so far if the stream is interrupted)."""
    stream = llm.stream(prompt, params)
    try:
        for request_output in stream:
            for completion in request_output.outputs:
                if completion.text:
                    pieces.append(completion.text)
                    out.write(completion.text)
                    out.flush()
    finally:
        stream.close()  # aborts the request when the reply was interrupted
        out.write("\n")
        out.flush()


def _stream_reply(llm: Any, prompt: Any, params: Any, out: TextIO) -> str:
    """Write the completion to ``out`` as it is generated; returns its full text."""
    pieces: list[str] = []
    _write_stream(llm, prompt, params, out, pieces)
    return "".join(pieces)


def _chat_reply(llm: Any, history: list[dict[str, str]], params: Any) -> str | None:
    """The model's reply to ``history``, streamed to stdout; None when it was refused (the
    reason on stderr). Ctrl-C stops the reply and returns the text written so far."""
    pieces: list[str] = []
    try:
        prompt = llm.input_processor.render_chat(history)
        _write_stream(llm, prompt, params, sys.stdout, pieces)
    except ValueError as e:
        print(f"{PROG} chat: {e}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        print(f"{PROG} chat: reply stopped (Ctrl-D or /exit quits)", file=sys.stderr)
    return "".join(pieces)


def run_generate(args: argparse.Namespace, llm: Any, params: Any) -> None:
    prompt: Any = args.prompt
    if args.chat:
        prompt = llm.input_processor.render_chat([{"role": "user", "content": args.prompt}])
    _stream_reply(llm, prompt, params, sys.stdout)


def run_chat(llm: Any, params: Any, stdin: TextIO = sys.stdin) -> None:
    """A REPL: each line is a user turn; the history is sent through the chat template.
    Ctrl-C during a reply stops that reply (kept in the history as far as it went); Ctrl-C
    at the prompt, like Ctrl-D, ends the session."""
    history: list[dict[str, str]] = []
    print("Chat with the model. /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        print("> ", end="", flush=True, file=sys.stderr)
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        reply = _chat_reply(llm, history, params)
        if reply is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


def _run(args: argparse.Namespace, plugin: Any) -> int:
    if plugin is not None:
        return int(plugin.main(args) or 0)
    params = sampling_params_from_args(args)  # fail on a bad value before loading the model
    engine_config_from_args(args)
    with startup_gc_paused():
        from pagedserve.entrypoints.llm import LLM  # torch, transformers: import on use

        llm = LLM(**engine_kwargs_from_args(args))
    if args.command == "generate":
        run_generate(args, llm, params)
    else:
        run_chat(llm, params)
    return 0


def _command_of(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, plugin = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return _run(args, plugin)
    except ValueError as e:
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return USAGE_ERROR
    except MemoryError as e:  # the engine's NotEnoughMemoryError: one line, not a traceback
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
