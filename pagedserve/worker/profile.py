"""The profile step: the largest step the scheduler may send, run through the real runner path
before the KV cache is sized, so the memory besides the cache can be measured.

It is a plan like any other: ``min(max_num_seqs, max_num_batched_tokens)`` new requests whose
prompts (token 0) add up to the token budget, each finishing its prefill in this step so every
row samples (top-k, top-p and 20 logprobs: the sampler's most memory-hungry path), then a
second plan that finishes them all.

``profile_memory`` runs it on a temporary KV cache and fills a ``kv_cache.MemoryProfile``:
1. with torch.compile, one unmeasured run first: it compiles (and Inductor tunes its kernels
   and allocates benchmark buffers, which are no activation memory);
2. the measured run: the allocator's reserved peak above what was reserved before it;
3. the temporary cache is dropped and the card's memory in use is read (less what was in use
   before the engine loaded, ``runner.memory_baseline``, it is what the engine holds);
4. with CUDA graphs, on a fresh temporary cache: every PIECEWISE graph is captured (and
   kept: they do not involve the KV cache) and the FULL graphs are estimated by a probe
   (``graph_capture.capture_before_kv_cache``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.compilation.phase_log import log_phase
from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.graph_capture import capture_before_kv_cache
from pagedserve.worker.kv_cache import MemoryProfile, used_device_bytes

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
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


def run_profile_step(runner: ModelRunner, step: ProfileStep) -> None:
    runner.execute_model(step.run)
    runner.sample_tokens()
    runner.execute_model(step.finish)


def _activation_peak(runner: ModelRunner, step: ProfileStep) -> int:
    """Reserved-memory peak of one run of ``step`` above what was reserved before it."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)  # weights, buffers and the temporary cache
    start = time.perf_counter()
    run_profile_step(runner, step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base
    log_phase(logger, "profile step", time.perf_counter() - start,
              f"{step.run.total_num_scheduled_tokens} tokens, peak {peak / 2**30:.2f} GiB",
              tokens=step.run.total_num_scheduled_tokens, activation_bytes=peak)
    return peak


def profile_memory(runner: ModelRunner) -> MemoryProfile:
    """Everything the KV budget subtracts, measured on temporary caches that are freed again
    (the PIECEWISE graphs stay). CUDA only."""
    device = runner.device
    step = profile_step(runner.max_num_batched_tokens, runner.max_num_reqs,
                        runner.max_model_len, runner.block_size)
    compiled = runner.compiled_forward
    runner.initialize_kv_cache(step.num_blocks)
    if compiled is not None and compiled.compile_stats is None:
        run_profile_step(runner, step)  # compiles; logs its own phase
    activations = _activation_peak(runner, step)
    runner.release_kv_cache()
    in_use = used_device_bytes(device)
    graphs = 0
    if compiled is not None and compiled.graph_pool is not None:
        runner.initialize_kv_cache(step.num_blocks)
        graphs = capture_before_kv_cache(runner)
        runner.release_kv_cache()
        torch.cuda.empty_cache()
    return MemoryProfile(total=torch.cuda.mem_get_info(device)[1],
                         baseline=runner.memory_baseline, in_use=in_use,
                         weights=runner.weights_bytes, activations=activations, graphs=graphs)
