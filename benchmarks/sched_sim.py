"""Scheduler simulation on the CPU: how the real ``Scheduler`` batches a workload, no model.

``python benchmarks/sched_sim.py --num-blocks 55928 --max-num-seqs 256 384 512 1024`` drives
``pagedserve.core.scheduler.Scheduler`` over the offline throughput workload (``pagedserve
bench throughput``: N random prompts of fixed length, ``ignore_eos``, all submitted at once)
with a fake model step: every request whose scheduled tokens reach the end of its known
tokens samples one token (a decode, or the last chunk of a prefill); a prefill chunk short of
the end samples none. Under async scheduling (the GPU default) one step stays in flight, as
in ``EngineCore.step``: step N+1 is planned before step N's tokens are appended.

It prints one row per ``--max-num-seqs`` value: engine steps, preemptions, recomputed tokens
(tokens scheduled beyond each request's prompt + output - 1, i.e. work done twice), the mean
number of requests per step, the mean decode batch (decoding requests per step, over steps
that decode), and output tokens per step. These are counts, not timings: a step's time grows
with its batch, so they show where a configuration wastes work, not how fast it runs.

Defaults are those of ``pagedserve bench throughput`` on Llama-3-8B (max_model_len 8192,
the model's position limit; block size 16; max_num_batched_tokens 8192; prefix caching on;
1000 prompts of 1000 tokens, 1000 output tokens). ``--num-blocks`` is the engine's KV-cache
size in blocks (the ``engine ready`` log line; 55,928 on an H200 at utilization 0.9 in bf16).
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.request import Request
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

FAKE_TOKEN = 7
"""Every sampled token (the requests ignore EOS, so its value only feeds the block hashes)."""


@dataclass
class SimResult:
    max_num_seqs: int
    admission_policy: str
    steps: int
    preemptions: int
    recomputed_tokens: int
    mean_requests_per_step: float
    mean_decode_batch: float
    output_tokens_per_step: float
    peak_running: int


def make_requests(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(0)
    requests = []
    for i in range(args.num_prompts):
        prompt = [rng.randrange(100, 32000) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        requests.append(Request(str(i), prompt, params, None, args.output_len, arrival_time=i))
    return requests


def fake_step(sched: Scheduler, plan: SchedulerOutput) -> tuple[ModelRunnerOutput, int]:
    """The runner's output for ``plan`` (called right after ``schedule()``, when each request's
    ``num_computed_tokens`` already counts this step) and how many of its requests decode."""
    req_ids, sampled, num_decodes = [], [], 0
    for rid, num_tokens in plan.num_scheduled_tokens.items():
        request = sched.requests[rid]
        samples = request.num_computed_tokens >= len(request.all_token_ids)
        num_decodes += samples and num_tokens == 1
        req_ids.append(rid)
        sampled.append([FAKE_TOKEN] if samples else [])
    return ModelRunnerOutput(req_ids, sampled), num_decodes


def simulate(args: argparse.Namespace, max_num_seqs: int) -> SimResult:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=not args.sync,
        admission_policy=args.admission_policy,
        admission_ratio_init=args.admission_ratio_init,
        admission_ratio_min=args.admission_ratio_min,
        admission_ratio_decay_steps=args.admission_ratio_decay_steps,
    )
    cache = CacheConfig(block_size=args.block_size)
    sched = Scheduler(config, cache, args.max_model_len, args.num_blocks)
    requests = make_requests(args)
    for request in requests:
        sched.add_request(request)
    depth = 0 if args.sync else 1
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    steps = scheduled_tokens = requests_in_steps = decodes = decode_steps = peak = 0
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            plan = sched.schedule()
            output, num_decodes = fake_step(sched, plan)
            in_flight.append((plan, output))
            if plan.total_num_scheduled_tokens:
                steps += 1
                scheduled_tokens += plan.total_num_scheduled_tokens
                requests_in_steps += len(plan.num_scheduled_tokens)
                decodes += num_decodes
                decode_steps += num_decodes > 0
                peak = max(peak, len(sched.running))
        while len(in_flight) > depth or (in_flight and not sched.has_unfinished_requests()):
            sched.update_from_output(*in_flight.popleft())
    assert sched.kv_cache_manager.block_pool.num_free_blocks == args.num_blocks - 1
    ideal = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in requests)
    return SimResult(
        max_num_seqs=max_num_seqs,
        admission_policy=args.admission_policy,
        steps=steps,
        preemptions=sched.num_preemptions,
        recomputed_tokens=scheduled_tokens - ideal,
        mean_requests_per_step=requests_in_steps / max(steps, 1),
        mean_decode_batch=decodes / max(decode_steps, 1),
        output_tokens_per_step=sum(r.num_output_tokens for r in requests) / max(steps, 1),
        peak_running=peak,
    )


def print_table(results: list[SimResult]) -> None:
    print(
        "| max_num_seqs | admission | steps | preemptions | recomputed tokens "
        "| requests/step | decode batch | output tok/step | peak running |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.max_num_seqs} | {r.admission_policy} | {r.steps:,} | {r.preemptions:,} "
            f"| {r.recomputed_tokens:,} | {r.mean_requests_per_step:.1f} "
            f"| {r.mean_decode_batch:.1f} | {r.output_tokens_per_step:.1f} "
            f"| {r.peak_running} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=55928, help="KV-cache blocks")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256, 384, 512, 1024])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    parser.add_argument(
        "--admission-policy",
        default=SchedulerConfig.admission_policy,
        choices=["reserve", "ratio", "greedy"],
    )
    for name in ("admission_ratio_init", "admission_ratio_min", "admission_ratio_decay_steps"):
        default = getattr(SchedulerConfig, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument(
        "--sync",
        action="store_true",
        help="synchronous scheduling (the CPU default) instead of async",
    )
    args = parser.parse_args()
    print_table([simulate(args, n) for n in args.max_num_seqs])


if __name__ == "__main__":
    main()
