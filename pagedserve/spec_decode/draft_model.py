"""The draft_model proposer: a small model of the same vocabulary drafts k tokens greedily.

The draft runs in a ``ModelRunner`` of its own (its own weights, request slots, KV cache in the
same paged block scheme, CUDA graphs on a GPU), driven by plans this proposer writes. A request
keeps its draft slot from its first drafting call until it finishes. Per call, the draft's KV
is valid for the history up to where the last call started drafting, and for the drafts it ran
as inputs (all but the last) that the target accepted since; the first draft step runs only
the tokens after those (the target's token, and the last draft when every draft was accepted:
one or two tokens, handed to the runner as ``new_token_ids``) and samples draft 1; k - 1
one-token steps sample the others, each reading the previous draft on the device. So a call
with k drafts computes k or k + 1 tokens in k forward passes. The host reads the drafts once,
after the last step. The drafts are greedy (a one-hot proposal), which the verifier's rule
needs (``verify.py``).

The draft's blocks are its own: a free list over its cache, a block table per request. A
request that finishes gives them back (``finish``); when blocks run short, requests that are
not drafting in this call lose theirs (they recompute their draft KV if they draft again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pagedserve.config import CacheConfig, EngineConfig, LoRAConfig, SpeculativeConfig
from pagedserve.core.sched_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.proposer import DraftRequest
from pagedserve.worker.async_output import AsyncOutput
from pagedserve.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftSeq:
    num_computed: int = 0
    """Tokens of the request's history whose draft KV is in ``block_ids``, drafts aside."""
    fed: list[int] = field(default_factory=list)
    """The last call's drafts that ran as inputs, at positions ``num_computed`` on: their KV
    holds as far as the history agrees with them."""
    block_ids: list[int] = field(default_factory=list)
    num_sent_blocks: int = -1
    """Blocks of ``block_ids`` the runner knows; -1: the request has no draft slot yet."""

    def valid_kv(self, token_ids: list[int]) -> int:
        """Leading tokens of ``token_ids`` whose draft KV holds (never the last token: the
        first draft step runs at least that one)."""
        n = self.num_computed
        matched = 0
        for draft in self.fed:
            if n + matched >= len(token_ids) or token_ids[n + matched] != draft:
                break
            matched += 1
        return min(n + matched, len(token_ids) - 1)


def draft_engine_config(target: EngineConfig, spec: SpeculativeConfig, max_model_len: int,
                        target_num_blocks: int) -> EngineConfig:
    """The draft runner's config: the target's, with the draft's model, no speculation, and
    blocks of the target's size for as many requests of ``max_model_len`` tokens as may draft
    at once, at most as many blocks as the target has (a draft is the smaller model, so its
    cache is the smaller one)."""
    assert spec.model is not None
    block_size = target.cache.block_size
    drafting = min(target.scheduler.max_num_seqs, spec.disable_by_batch_size)
    num_blocks = min(drafting * cdiv(max_model_len, block_size) + 1, target_num_blocks)
    model = dataclasses.replace(target.model, model=spec.model, tokenizer=None,
                                max_model_len=max_model_len, quantization=None)
    cache = CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks,
                        enable_prefix_caching=False)
    scheduler = dataclasses.replace(target.scheduler, speculative_config=None)
    # The adapters are the target's: the draft runs its own weights only.
    return dataclasses.replace(target, model=model, cache=cache, scheduler=scheduler,
                               lora=LoRAConfig())


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, max_model_len: int,
                 vocab_size: int, target_num_blocks: int) -> None:
        """``config``: the target engine's (device resolved)."""
        draft_config = draft_engine_config(config, spec, max_model_len, target_num_blocks)
        self.runner = ModelRunner(draft_config, torch.device(config.device))
        self.runner.load_model()
        if self.runner.vocab_size != vocab_size:
            raise ValueError(f"model: the draft {spec.model!r} has a vocabulary of "
                             f"{self.runner.vocab_size} tokens, the target {vocab_size}; "
                             "draft and target must share one")
        num_blocks = draft_config.cache.num_gpu_blocks_override
        assert num_blocks is not None
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.block_size = draft_config.cache.block_size
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0: the null block
        self.seqs: dict[str, _DraftSeq] = {}
        self.finished: set[str] = set()
        """Requests whose runner slot the next plan frees."""

    def finish(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            seq = self.seqs.pop(req_id, None)
            if seq is not None:
                self.free_blocks += seq.block_ids
                self.finished.add(req_id)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafting = [r for r in requests if self._reserve(r, {q.req_id for q in requests})]
        if not drafting:
            return [[] for _ in requests]
        outputs = self._catch_up(drafting)
        max_drafts = max(r.max_drafts for r in drafting)
        for j in range(1, max_drafts):
            outputs.append(self._decode_step([r for r in drafting if r.max_drafts > j], j))
        drafts: dict[str, list[int]] = {r.req_id: [] for r in drafting}
        for output in outputs:
            result = output.get_output()
            for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
                drafts[req_id] += tokens
        for r in drafting:
            seq = self.seqs[r.req_id]
            seq.num_computed = len(r.token_ids)
            seq.fed = drafts[r.req_id][:-1]
        return [drafts.get(r.req_id, []) for r in requests]

    def _reserve(self, request: DraftRequest, drafting: set[str]) -> bool:
        """Blocks for the request's history and its drafts' KV; False if there are none."""
        seq = self.seqs.setdefault(request.req_id, _DraftSeq())
        needed = cdiv(len(request.token_ids) + request.max_drafts - 1, self.block_size)
        missing = needed - len(seq.block_ids)
        if missing > len(self.free_blocks):
            self.finish([rid for rid in self.seqs if rid not in drafting])
        if missing > len(self.free_blocks):
            return False
        for _ in range(max(missing, 0)):
            seq.block_ids.append(self.free_blocks.pop())
        return True

    def _catch_up(self, drafting: list[DraftRequest]) -> list[AsyncOutput]:
        """Run what has no valid draft KV yet (a request's first call: its whole history), in
        steps within the draft's token budget; the step that completes a request samples its
        first draft."""
        budget = self.runner.max_num_batched_tokens
        done = {r.req_id: self.seqs[r.req_id].valid_kv(r.token_ids) for r in drafting}
        outputs = []
        started: set[str] = set()
        while any(done[r.req_id] < len(r.token_ids) for r in drafting):
            new_reqs, cached, num_scheduled = [], CachedRequestData(), {}
            left = budget
            for r in drafting:
                take = min(len(r.token_ids) - done[r.req_id], left)
                if take <= 0:
                    continue
                if self.seqs[r.req_id].num_sent_blocks < 0:
                    new_reqs.append(self._admission(r))
                else:
                    self._add_cached(cached, r, done[r.req_id], r.req_id not in started)
                started.add(r.req_id)
                num_scheduled[r.req_id] = take
                done[r.req_id] += take
                left -= take
            # A slot of a finished request is freed first (the plan frees, then admits).
            finished, self.finished = self.finished, set()
            plan = SchedulerOutput(new_reqs, cached, num_scheduled, budget - left, finished)
            self.runner.execute_model(plan)
            outputs.append(self.runner.sample_tokens_async())
        return outputs

    def _admission(self, r: DraftRequest) -> NewRequestData:
        seq = self.seqs[r.req_id]
        seq.num_sent_blocks = len(seq.block_ids)
        return NewRequestData(
            req_id=r.req_id, prefill_token_ids=list(r.token_ids),
            num_prompt_tokens=len(r.token_ids), sampling_params=_GREEDY,
            block_ids=(list(seq.block_ids),), num_computed_tokens=0)

    def _add_cached(self, cached: CachedRequestData, r: DraftRequest, num_computed: int,
                    first: bool) -> None:
        """A request with a draft slot: its new blocks, and in its first step of the call
        (``first``) the tokens from ``num_computed`` on, which the runner has not seen."""
        seq = self.seqs[r.req_id]
        new_blocks = seq.block_ids[seq.num_sent_blocks :]
        seq.num_sent_blocks = len(seq.block_ids)
        cached.req_ids.append(r.req_id)
        cached.new_block_ids.append((new_blocks,) if new_blocks else None)
        cached.num_computed_tokens.append(num_computed)
        if first:
            cached.new_token_ids[r.req_id] = list(r.token_ids[num_computed:])

    def _decode_step(self, drafting: list[DraftRequest], j: int) -> AsyncOutput:
        """Draft j + 1 from draft j (on the device: the runner's last sampled token)."""
        cached = CachedRequestData()
        for r in drafting:
            cached.req_ids.append(r.req_id)
            cached.new_block_ids.append(None)
            cached.num_computed_tokens.append(len(r.token_ids) + j - 1)
        plan = SchedulerOutput([], cached, dict.fromkeys(cached.req_ids, 1), len(drafting),
                               set())
        self.runner.execute_model(plan)
        return self.runner.sample_tokens_async()
