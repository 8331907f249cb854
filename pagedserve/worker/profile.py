"""The profile step: the largest step the scheduler may send, run through the real runner path
before the KV cache is sized, so its peak activation memory can be measured.

It is a plan like any other: ``min(max_num_seqs, max_num_batched_tokens)`` new requests whose
prompts (token 0) add up to the token budget, each finishing its prefill in this step so every
row samples (top-k, top-p and 20 logprobs: the sampler's most memory-hungry path), then a
second plan that finishes them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.block_table import cdiv

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner

PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20)


@dataclass
class ProfileStep:
    run: SchedulerOutput
    finish: SchedulerOutput
    num_blocks: int
    """Blocks a temporary KV cache needs for ``run`` (block 0 stays the unused null block)."""


def profile_step(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> ProfileStep:
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_reqs * max_model_len)
    base, extra = divmod(num_tokens, num_reqs)
    new_reqs, num_scheduled = [], {}
    next_block = 1
    for i in range(num_reqs):
        req_id = f"profile-{i}"
        query_len = base + (i < extra)
        n = cdiv(query_len, block_size)
        new_reqs.append(NewRequestData(
            req_id=req_id,
            prefill_token_ids=[0] * query_len,
            num_prompt_tokens=query_len,
            sampling_params=PROFILE_SAMPLING,
            block_ids=(list(range(next_block, next_block + n)),),
            num_computed_tokens=0,
        ))
        num_scheduled[req_id] = query_len
        next_block += n
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, num_tokens, set())
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return ProfileStep(run=run, finish=finish, num_blocks=next_block)


def measure_peak_memory(runner: ModelRunner) -> int:
    """Peak CUDA memory (bytes) of the profile step beyond what was allocated before it (the
    weights), measured on a temporary KV cache that is freed again."""
    device = runner.device
    step = profile_step(runner.max_num_batched_tokens, runner.max_num_reqs, runner.max_model_len,
                        runner.block_size)
    runner.initialize_kv_cache(step.num_blocks)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)  # weights and the temporary cache
    runner.execute_model(step.run)
    runner.sample_tokens()
    runner.execute_model(step.finish)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    runner.release_kv_cache()
    torch.cuda.empty_cache()
    return peak
