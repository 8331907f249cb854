"""Command-line options generated from the config dataclasses: the one source of CLI defaults.

Every field of ``EngineConfig``'s sections (model, cache, scheduler, parallel, compilation)
becomes an option: ``max_num_seqs`` -> ``--max-num-seqs``, with the field's default, its type,
``Literal`` values as choices, and the field's docstring as help. Booleans get ``--flag`` /
``--no-flag``. Sampling options come from ``SamplingParams`` the same way.

Seeds: ``--seed`` is the engine's seed (``ModelConfig.seed``); it seeds the sampler, which
draws each unseeded request its own seed, so a run is reproducible while requests still get
independent noise. ``--request-seed`` sets ``SamplingParams.seed`` for the command's requests.

This module imports no torch: the CLI builds its parser before the engine is loaded.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import typing
from typing import Any, Literal

from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.field_types import ByteSize, byte_size, without_none
from pagedserve.sampling_params import SamplingParams

SAMPLING_OPTIONS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
"""SamplingParams fields offered under their own names (``seed`` is ``--request-seed``: the
name ``--seed`` is the engine's)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under the field in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _byte_size_option(text: str) -> int:
    try:
        return byte_size("value", text)
    except ValueError as e:  # argparse prints the option's name beside this
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from e


def _speculative_option(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:  # argparse prints the option's name beside this
        raise argparse.ArgumentTypeError(str(e)) from e


def _option_kwargs(tp: Any, default: Any, doc: str) -> dict[str, Any]:
    """argparse keyword arguments for a field of type ``tp``."""
    base = without_none(tp)
    shown = "None" if default is None else repr(default)
    kwargs: dict[str, Any] = {"default": default, "help": f"{doc} (default: {shown})".strip()}
    origin = typing.get_origin(base)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        kwargs["help"] = doc  # BooleanOptionalAction appends the default itself
    elif origin is Literal:
        kwargs["choices"] = list(typing.get_args(base))
    elif origin in (list, tuple):
        kwargs["nargs"] = "+"
        kwargs["type"] = typing.get_args(base)[0]
    elif base is ByteSize:
        kwargs["type"] = _byte_size_option
    elif base is SpeculativeConfig:
        kwargs["type"] = _speculative_option
    elif base in (int, float, str):
        kwargs["type"] = base
    else:
        raise TypeError(f"cli_args: no command-line form for a field of type {tp}")
    return kwargs


def add_dataclass_args(
    group: argparse._ArgumentGroup | argparse.ArgumentParser,
    cls: type,
    only: tuple[str, ...] | None = None,
) -> None:
    """Add one option per field of ``cls`` (or per field named in ``only``)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        kwargs = _option_kwargs(hints[f.name], _field_default(f), docs.get(f.name, ""))
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kwargs)


def _engine_sections() -> dict[str, type]:
    hints = typing.get_type_hints(EngineConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(EngineConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """All engine options, one argument group per config section, plus ``--device``."""
    for name, cls in _engine_sections().items():
        add_dataclass_args(parser.add_argument_group(f"{name} options"), cls)
    device = next(f for f in dataclasses.fields(EngineConfig) if f.name == "device")
    parser.add_argument(
        "--device", default=device.default, help=field_docs(EngineConfig).get("device")
    )


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of a parsed namespace as ``EngineConfig.from_kwargs`` keywords."""
    names = [f.name for cls in _engine_sections().values() for f in dataclasses.fields(cls)]
    kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
    for name, value in kwargs.items():
        if isinstance(value, list):
            kwargs[name] = tuple(value)
    kwargs["device"] = args.device
    return kwargs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ``ValueError`` naming the field when a value is out of range."""
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options")
    add_dataclass_args(group, SamplingParams, SAMPLING_OPTIONS)
    group.add_argument(
        "--request-seed",
        dest="request_seed",
        type=int,
        default=None,
        help="the request's own sampling seed (SamplingParams.seed): its tokens are then the "
        "same alone or batched with other requests (default: None, a seed drawn from the "
        "engine's --seed)",
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling parameters. Its seed is ``--request-seed`` (None unless given),
    never the engine's ``--seed``: as every request's seed that would give all requests one
    shared noise stream. Raises ``ValueError`` naming the field when a value is out of range."""
    kwargs = {name: getattr(args, name) for name in SAMPLING_OPTIONS if hasattr(args, name)}
    return SamplingParams(seed=getattr(args, "request_seed", None), **kwargs)
