"""Admission control: admit a waiting request only if the running ones keep room to grow.

Greedy admission (vLLM's rule) takes a waiting request whenever its prompt's blocks are free.
When ``max_num_seqs`` requests at full length do not fit in the KV cache, the running requests
then outgrow the cache and are preempted, and each preemption recomputes the victim's prompt
and output: work done twice. Admission with a reserve (SGLang's ``new_token_ratio``) holds back a
reserve for the future tokens of every running request:

    reserve(r) = ceil(ratio * tokens r may still generate)        (tokens)
    footprint(r) = min(max_model_len, tokens r has + reserve(r))  (tokens, in whole blocks)
    reserved = sum over running r of footprint(r) - blocks r holds

and admits a request only if its own footprint, less its prefix-cache hits, fits in the free
blocks left after ``reserved``. The ratio is a guess at how much of ``max_tokens`` requests
really generate (most stop early, at EOS): it starts at ``admission_ratio_init``, falls
linearly to ``admission_ratio_min`` over ``admission_ratio_decay_steps`` steps in which no
request is preempted, and returns to the start on a preemption (the guess was too low) and
when a request arrives at a scheduler that has none (the burst starts cautious).

Tokens a request is certain to generate are not guessed: they are reserved in full. Those
are its tokens up to ``min_tokens`` and, under ``reserve`` (the default), all of
``max_tokens`` for a request that nothing but its length can stop (``ignore_eos`` or no EOS
token, no stop tokens, no stop strings, no grammar): the case of every benchmark that fixes
output lengths. The ``ratio`` policy (SGLang's rule as it is) guesses for those too, so it
admits requests that the cache cannot hold at full length, and each admission past that
point costs a preemption later; it still preempts far less than ``greedy``
(docs/performance.md#admission-control).

Invariants:

* No deadlock: with no request running, the head of the queue is admitted whenever its
  allocation fits, reserve or not (``Scheduler._schedule_waiting``).
* The reserve is an estimate, never an allocation: running requests still grow by allocating
  blocks, and preemption stays the fallback when the estimate is too low.
* Deterministic: the ratio depends only on the count of steps since the last reset.
"""

from __future__ import annotations

import math

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.math_utils import cdiv


class RatioAdmission:
    """The ``ratio`` admission policy (SGLang's rule as it is): every token a request may
    still generate beyond ``min_tokens`` is reserved at the ratio. Holds the ratio's state and
    checks one request."""

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.ratio_init = config.admission_ratio_init
        self.ratio_min = config.admission_ratio_min
        self.decay_steps = config.admission_ratio_decay_steps
        self.max_model_len = max_model_len
        self._steps_since_reset = 0

    @property
    def ratio(self) -> float:
        """Linear from ``ratio_init`` (at a reset) to ``ratio_min`` (``decay_steps`` later)."""
        done = min(self._steps_since_reset, self.decay_steps) / self.decay_steps
        return self.ratio_init - (self.ratio_init - self.ratio_min) * done

    def reset(self) -> None:
        """Back to ``ratio_init``: after a preemption, or at a request arriving to none."""
        self._steps_since_reset = 0

    def decay(self) -> None:
        """One step that ran requests and preempted none."""
        self._steps_since_reset += 1

    def future_blocks(self, request: Request, kv: KVCacheManager) -> int:
        """Blocks ``request`` may still need beyond those it holds: its footprint less them."""
        # Tokens in flight (async scheduling) already have their slots; count them as had.
        inflight = request.num_output_placeholders
        num_tokens = len(request.all_token_ids) + inflight
        num_output = len(request.output_token_ids) + inflight
        may_generate = max(0, request.max_tokens - num_output)
        certain = self.certain_tokens(request, num_output, may_generate)
        reserve = certain + math.ceil(self.ratio * (may_generate - certain))
        footprint = min(self.max_model_len, num_tokens + reserve)
        return max(0, cdiv(footprint, kv.block_size) - kv.num_held_blocks(request.request_id))

    def certain_tokens(self, request: Request, num_output: int, may_generate: int) -> int:
        """Of the ``may_generate`` tokens ``request`` may still generate, those it will: up
        to ``min_tokens`` (no stop counts before them)."""
        return min(may_generate, max(0, request.sampling_params.min_tokens - num_output))

    def reserved_blocks(self, running: list[Request], kv: KVCacheManager) -> int:
        """Blocks held back for the running requests' future tokens."""
        return sum(self.future_blocks(r, kv) for r in running)

    def admits(
        self,
        request: Request,
        computed_blocks: list[KVCacheBlock],
        reserved: int,
        kv: KVCacheManager,
    ) -> bool:
        """Whether ``request`` (not holding blocks; ``computed_blocks`` its prefix-cache hits)
        fits with its own reserve in the free blocks left after ``reserved``."""
        # Hits in the free queue (unreferenced) stop being free once the request takes them.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        needed = self.future_blocks(request, kv) - len(computed_blocks) + num_revived
        return needed <= kv.block_pool.num_free_blocks - reserved


class ReserveAdmission(RatioAdmission):
    """The ``reserve`` admission policy (the default): ``ratio``, but a request that only its
    length can finish is certain to generate all of ``max_tokens``, reserved in full."""

    def certain_tokens(self, request: Request, num_output: int, may_generate: int) -> int:
        if runs_to_max_tokens(request):
            return may_generate
        return super().certain_tokens(request, num_output, may_generate)


def make_admission(config: SchedulerConfig, max_model_len: int) -> RatioAdmission | None:
    """The admission control of ``config.admission_policy``; None for ``greedy``."""
    if config.admission_policy == "reserve":
        return ReserveAdmission(config, max_model_len)
    if config.admission_policy == "ratio":
        return RatioAdmission(config, max_model_len)
    return None


def runs_to_max_tokens(request: Request) -> bool:
    """Whether only its length can finish ``request``: no EOS it stops at, no stop token or
    stop string, no grammar (aborts aside)."""
    params = request.sampling_params
    stops_at_eos = not params.ignore_eos and request.eos_token_id is not None
    return not (
        stops_at_eos
        or params.stop_token_ids
        or params.stop
        or request.structured_output is not None
    )
