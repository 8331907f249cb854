"""Decode step time of one batch at a given context, against the roofline.

The decode step time is measured as (T(output_len) - T(1)) / (output_len - 1): the same batch
generated twice, once with one output token (prefill + first token) and once with
``output_len`` tokens, so the difference holds only decode steps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedserve.entrypoints.bench.common import (
    add_workload_args,
    make_llm,
    random_prompts,
    write_json,
)
from pagedserve.entrypoints.bench.roofline import (
    decode_step_roofline,
    device_ceilings,
    run_precision,
)
from pagedserve.model.shape import ModelShape
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.report import spec_decode_figures, spec_decode_line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1)
    add_workload_args(parser, input_len=1024, output_len=128)
    parser.add_argument("--num-iters", type=int, default=3, help="timed repetitions")
    parser.add_argument("--num-iters-warmup", type=int, default=1)


def _timed_generate(llm, prompts, params) -> float:  # noqa: ANN001
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    run(make_llm(args), args)
    return 0


def run(llm, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Time the decode step of ``args``' workload on an engine that is already up."""
    if args.output_len < 2:
        raise ValueError("output_len: needs at least 2 tokens to time a decode step")
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [args.input_len] * args.batch_size, llm.engine_core.vocab_size)
    full = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=args.temperature)
    for _ in range(args.num_iters_warmup):
        _timed_generate(llm, prompts, full)
    t_full = [_timed_generate(llm, prompts, full) for _ in range(args.num_iters)]
    t_first = [_timed_generate(llm, prompts, first) for _ in range(args.num_iters)]
    step = (float(np.median(t_full)) - float(np.median(t_first))) / (args.output_len - 1)

    runner = llm.engine_core.executor  # hf_config, dtype, device for every TP backend
    dtype_bytes = torch.finfo(runner.dtype).bits // 8
    shape = ModelShape.from_hf_config(runner.hf_config, dtype_bytes)
    precision = run_precision(llm.engine_core.config, runner.hf_config, dtype_bytes)
    ceil = device_ceilings(runner.device)
    context = args.input_len + args.output_len // 2
    floor = decode_step_roofline(shape, args.batch_size, context, ceil, precision)
    result = {
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "decode_step_ms": step * 1e3, "roofline_step_ms": floor * 1e3,
        "ratio_to_roofline": step / floor, "request_latency_s": float(np.median(t_full)),
        "output_tok_per_s": args.batch_size / step, "ceilings": ceil.source,
        "device": str(runner.device),
        "cudagraph_modes": _graph_sizes(getattr(runner, "model_runner", None)),
        **spec_decode_figures(llm.engine_core.get_stats()),
    }  # fmt: skip
    print(
        f"batch {args.batch_size}, context ~{context}: decode step {step * 1e3:.3f} ms, "
        f"roofline {floor * 1e3:.3f} ms ({ceil.source}), ratio {step / floor:.2f}x; "
        f"request latency {result['request_latency_s']:.3f} s"
    )
    if "spec_decode_num_drafts" in result:
        print(spec_decode_line(result))
    write_json(args.output_json, result)
    return result


def _graph_sizes(runner) -> dict:  # noqa: ANN001
    """Captured sizes of the in-process runner (None for other TP backends)."""
    compiled = getattr(runner, "compiled_forward", None)
    return compiled.captured_sizes() if compiled is not None else {}
