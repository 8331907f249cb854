"""``pagedserve trace``: run the engine and show one step stop by stop (docs/trace.md).

    pagedserve trace --scenario seed [--json]
    pagedserve trace --prompt "The capital of France is" "Hello" --step 3 [--json]

The engine runs real steps (scheduler + model runner); the chosen step is recorded through
an observer of the runner's step phases (``worker/tracer.py``), from its own buffers, and
printed as one block per stop (text) or as one JSON object (``--json``, with complete lists).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from pagedserve.entrypoints.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs_from_args,
    sampling_params_from_args,
)

if TYPE_CHECKING:  # the CLI imports this module at start-up: no torch until a trace runs
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.entrypoints.trace_run import Arrival
    from pagedserve.entrypoints.trace_view import TokenDecoder

SCENARIOS = ("seed",)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("trace options").add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                      help="one or more prompts; all enter the engine before step 1")
    what.add_argument("--scenario", choices=SCENARIOS,
                      help="seed: a fixed example step (R1, R2 decoding at 540 and 129 computed "
                           "tokens, R3 arriving with 298; block size 16, 1024 request slots, "
                           "capture sizes up to 512); it fixes those engine options")
    parser.add_argument("--step", type=int, default=None,
                        help="the step to trace, 1-based (default: 2 for --scenario seed, "
                             "else 1)")
    parser.add_argument("--json", action="store_true",
                        help="print the trace as one JSON object (lists complete)")
    add_engine_args(parser)
    add_sampling_args(parser)


def _engine_view(llm: LLM) -> dict[str, Any]:
    config = llm.config
    return {
        "model": config.model.model,
        "device": config.device,
        "dtype": config.model.dtype,
        "block_size": config.cache.block_size,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "num_kv_blocks": llm.engine_core.num_blocks,
        "max_model_len": llm.engine_core.max_model_len,
    }


def _requests_view(llm: LLM, arrivals: list[Arrival], step: int) -> list[dict[str, Any]]:
    """The requests that entered the engine up to ``step`` (text prompts shown as text)."""
    return [
        {"req_id": a.req_id, "arrives_at_step": a.step,
         "num_prompt_tokens": len(llm.input_processor.tokenize(a.prompt)[1]),
         **({"prompt": a.prompt} if isinstance(a.prompt, str) else {})}
        for a in arrivals if a.step <= step
    ]


def _decoder(llm: LLM) -> TokenDecoder | None:
    tokenizer = llm.get_tokenizer()
    return None if tokenizer is None else (lambda t: tokenizer.decode([t]))


def build_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, run it to the chosen step and return the trace as a JSON-able dict:
    ``scenario``, ``step``, ``engine``, ``requests`` and ``stops`` (see ``trace_view``)."""
    from pagedserve.entrypoints.llm import LLM  # torch-heavy: import on use
    from pagedserve.entrypoints.trace_run import (
        SEED_STEP,
        prompt_arrivals,
        run_to_step,
        seed_arrivals,
        seed_engine_kwargs,
        seed_sampling_params,
    )
    from pagedserve.entrypoints.trace_view import build_stops_view

    # Fail on a bad value before loading the model. --seed seeds the engine; a request's own
    # seed is --request-seed (None unless given).
    params = sampling_params_from_args(args)
    kwargs = engine_kwargs_from_args(args)
    seed = args.scenario == "seed"
    if seed:
        kwargs, params = seed_engine_kwargs(kwargs), seed_sampling_params(params)
    step = args.step if args.step is not None else (SEED_STEP if seed else 1)
    if step < 1:
        raise ValueError(f"step: must be >= 1, got {step}")
    # One engine step at a time: with async scheduling a step() call would launch the next
    # step before the traced one completes.
    llm = LLM(**{**kwargs, "async_scheduling": False})
    arrivals = (seed_arrivals(llm.engine_core.vocab_size, args.seed) if seed
                else prompt_arrivals(args.prompt))
    traced = run_to_step(llm, arrivals, params, step)
    return {
        "scenario": "seed" if seed else "prompts",
        "step": traced.step,
        "engine": _engine_view(llm),
        "requests": _requests_view(llm, arrivals, step),
        "stops": build_stops_view(traced.stops, _decoder(llm)),
    }


def main(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.trace_format import format_trace

    trace = build_trace(args)
    sys.stdout.write(json.dumps(trace) + "\n" if args.json else format_trace(trace))
    sys.stdout.flush()
    return 0
