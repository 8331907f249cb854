"""Offline throughput of many requests, against the roofline of the workload."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedserve.entrypoints.bench.common import (
    add_workload_args,
    make_llm,
    random_lengths,
    random_prompts,
    write_json,
)
from pagedserve.entrypoints.bench.gpu_busy import GpuBusySampler
from pagedserve.entrypoints.bench.roofline import (
    device_ceilings,
    run_precision,
    throughput_roofline,
)
from pagedserve.model.shape import ModelShape
from pagedserve.platform import platform_for
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.report import spec_decode_figures, spec_decode_line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=1000)
    add_workload_args(parser, input_len=1024, output_len=128)


def main(args: argparse.Namespace) -> int:
    run(make_llm(args), args)
    return 0


def energy_figures(busy: GpuBusySampler | None, num_out: int) -> dict:
    """The card's energy over the run (NVML's counter), where it could be read."""
    if busy is None or busy.energy_j is None:
        return {}
    return {"energy_j": busy.energy_j, "mean_power_w": busy.mean_power_w,
            "output_tok_per_j": num_out / busy.energy_j if busy.energy_j > 0 else None}


def run(llm, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Run ``args``' workload on an engine that is already up; returns the figures."""
    rng = np.random.default_rng(0)
    in_lens = random_lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    out_lens = random_lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    prompts = random_prompts(rng, in_lens, llm.engine_core.vocab_size)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature)
        for n in out_lens
    ]
    runner = llm.engine_core.executor  # hf_config, dtype, device for every TP backend
    busy = GpuBusySampler(runner.device) if platform_for(runner.device).accelerator else None
    def generate() -> list:
        return llm.generate(prompts, params, use_tqdm=True)

    start = time.perf_counter()
    outputs = busy.measure(generate) if busy is not None else generate()
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(in_lens)

    core = llm.engine_core
    dtype_bytes = torch.finfo(runner.dtype).bits // 8
    shape = ModelShape.from_hf_config(runner.hf_config, dtype_bytes)
    precision = run_precision(llm.engine_core.config, runner.hf_config, dtype_bytes)
    stats = core.get_stats()
    ceil = device_ceilings(runner.device)
    kv_tokens = core.num_blocks * core.config.cache.block_size
    mean_in, mean_out = int(np.mean(in_lens)), int(np.mean(out_lens))
    max_batch = min(core.config.scheduler.max_num_seqs, kv_tokens // (mean_in + mean_out))
    floor = throughput_roofline(
        shape, args.num_prompts, mean_in, mean_out, max_batch,
        core.config.scheduler.max_num_batched_tokens, ceil, precision,
    )  # fmt: skip
    roofline_tps = num_out / floor
    result = {
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "elapsed_s": elapsed,
        "output_tok_per_s": num_out / elapsed, "total_tok_per_s": (num_in + num_out) / elapsed,
        "requests_per_s": args.num_prompts / elapsed, "roofline_output_tok_per_s": roofline_tps,
        "ratio_to_roofline": (num_out / elapsed) / roofline_tps, "max_batch_kv_allows": max_batch,
        "num_kv_blocks": core.num_blocks, "num_preemptions": stats.num_preemptions,
        "ceilings": ceil.source, "device": str(runner.device),
        "gpu_busy_fraction": None if busy is None else busy.busy_fraction,
        **energy_figures(busy, num_out),
        **spec_decode_figures(stats),
    }  # fmt: skip
    print(
        f"{args.num_prompts} prompts, {mean_in} in / {mean_out} out: {elapsed:.1f} s, "
        f"{result['output_tok_per_s']:.0f} output tok/s, {result['total_tok_per_s']:.0f} total "
        f"tok/s, {result['requests_per_s']:.2f} req/s; roofline {roofline_tps:.0f} output tok/s "
        f"({ceil.source}, max batch {max_batch}): {result['ratio_to_roofline']:.2f} of roofline"
        f"; {stats.num_preemptions} preemptions ({core.num_blocks} KV blocks)"
        + ("" if busy is None else f"; GPU busy {busy.busy_fraction:.1%} (NVML, every 0.1 s)")
        + ("" if result.get("energy_j") is None else
           f"; {result['energy_j'] / 1e3:.1f} kJ on the card, {result['mean_power_w']:.0f} W "
           f"mean, {result['output_tok_per_j']:.2f} output tok/J")
    )
    if "spec_decode_num_drafts" in result:
        print(spec_decode_line(result))
    write_json(args.output_json, result)
    return result
