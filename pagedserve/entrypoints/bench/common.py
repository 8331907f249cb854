"""Shared pieces of the offline benchmarks: random prompts and the engine under test."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from pagedserve.entrypoints.cli_args import engine_kwargs_from_args


def add_workload_args(parser: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    parser.add_argument("--input-len", type=int, default=input_len, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=output_len, help="output tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed lengths)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--output-json", default=None, help="write the results here")


def random_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_prompts(
    rng: np.random.Generator, lengths: list[int], vocab_size: int
) -> list[dict[str, list[int]]]:
    """Token-id prompts (no tokenizer needed, so any dummy shape works)."""
    high = min(vocab_size, 32000)
    return [{"prompt_token_ids": rng.integers(100, high, size=n).tolist()} for n in lengths]


def make_llm(args: argparse.Namespace) -> Any:
    from pagedserve.entrypoints.llm import LLM

    return LLM(**engine_kwargs_from_args(args), skip_tokenizer_init=True)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
