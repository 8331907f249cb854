"""``pagedserve bench latency | throughput | serve``.

latency and throughput run the offline engine in this process (any model shape with
``--load-format dummy``), print output tokens/s, step time and the ratio to the roofline of the
card (``roofline.py`` says how it is computed). ``serve`` sends requests to a running server.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from pagedserve.entrypoints.cli_args import add_engine_args

SUBCOMMANDS = {
    "latency": "pagedserve.entrypoints.bench.latency",
    "throughput": "pagedserve.entrypoints.bench.throughput",
    "serve": "pagedserve.entrypoints.bench.serve",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, module_name in SUBCOMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue  # a benchmark this build does not have
        module = _module(module_name)
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        if getattr(module, "USES_ENGINE", True):
            add_engine_args(p)
        module.add_cli_args(p)


def main(args: argparse.Namespace) -> int:
    return int(_module(SUBCOMMANDS[args.bench_command]).main(args) or 0)


def _module(name: str) -> Any:
    return importlib.import_module(name)
