"""Verification of drafts in the target model (the runner's side of speculative decoding).

A request with k drafts runs k + 1 query rows: its last token, then the drafts. The input
preparation fills the last row with the token sampled last step, as for any decode;
``write_draft_inputs`` then moves that token to the first row and writes the drafts after it.

Every one of the k + 1 rows becomes logits, and row j is sampled exactly as a plain decode would
sample output index ``num_output_tokens + j``: same processing, same truncation, same Gumbel
noise (its counter is the output index). The drafts are accepted while they equal those
samples; the first sample that differs (or the one after the last draft) is the target's own
token. For a one-hot proposal (ngram, or any greedy proposer) this is the standard
accept/resample rule: draft d is accepted with probability p(d), and on a rejection the sample,
conditioned on differing from d, is distributed as the residual (p - q)+ normalised. So the
tokens are the target's distribution exactly, and, since the noise depends only on (seed,
output index), a seeded or greedy request gets the very tokens it gets without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.sample import Sampler
from pagedserve.worker.input_batch import BatchPlan
from pagedserve.worker.staging import host_to_device


@dataclass
class DraftBatch:
    """A step's drafts in batch order (host)."""

    num_drafts_np: np.ndarray  # int64 [num_reqs]: drafts per batch row (0: none)
    draft_ids_np: np.ndarray  # int64 [num_draft_tokens]: every row's drafts, in batch order


def plan_drafts(plan: BatchPlan, spec_token_ids: dict[str, list[int]]) -> DraftBatch:
    drafts = [spec_token_ids.get(req_id, ()) for req_id in plan.req_ids]
    num_drafts_np = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
    draft_ids_np = np.fromiter((t for d in drafts for t in d), dtype=np.int64,
                               count=int(num_drafts_np.sum()))
    return DraftBatch(num_drafts_np, draft_ids_np)


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 [sum(lengths)]: start_i, start_i + 1, ..., start_i + lengths_i - 1, for each i."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def write_draft_inputs(
    input_ids: torch.Tensor,  # int32 [num_tokens_padded] (in/out)
    last_sampled_tokens: torch.Tensor,  # int64 [max_num_reqs]
    plan: BatchPlan,
    query_start_loc_np: np.ndarray,  # int32 [num_reqs + 1]
    drafts: DraftBatch,
) -> None:
    """Each drafting row: its first query row gets the token sampled last (when that position
    is past its prefill; else it keeps its prefill token), the rows after it the drafts."""
    rows = np.flatnonzero(drafts.num_drafts_np)  # batch rows with drafts
    num_drafts = drafts.num_drafts_np[rows]
    first = query_start_loc_np[rows + 1].astype(np.int64) - 1 - num_drafts
    sampled = plan.num_computed_tokens_np[rows] >= plan.prefill_len_np[rows]
    first_sampled = first[sampled]
    # One copy: draft rows, draft ids, first rows taking the sampled token, their slots.
    host = np.concatenate([_segments(first + 1, num_drafts), drafts.draft_ids_np,
                           first_sampled, plan.idx_mapping_np[rows[sampled]].astype(np.int64)])
    dev = host_to_device(host, torch.int64, input_ids.device)
    n, m = drafts.draft_ids_np.shape[0], first_sampled.shape[0]
    draft_rows, draft_ids = dev[:n], dev[n : 2 * n]
    sampled_rows, slots = dev[2 * n : 2 * n + m], dev[2 * n + m :]
    tokens = last_sampled_tokens.index_select(0, slots).to(input_ids.dtype)
    input_ids.index_copy_(0, sampled_rows, tokens)
    input_ids.index_copy_(0, draft_rows, draft_ids.to(input_ids.dtype))


@dataclass
class VerifyPlan:
    """Where a verifying step's logits rows come from, and how they group (host)."""

    slots_np: np.ndarray  # int64 [num_sampled]: slot of each sampling batch row
    num_drafts_np: np.ndarray  # int64 [num_sampled]
    offsets_np: np.ndarray  # int64 [num_sampled]: first logits row of each sampling row
    token_rows_np: np.ndarray  # int64 [num_logits_rows]: the token row of each logits row

    @property
    def num_logits_rows(self) -> int:
        return self.token_rows_np.shape[0]


def plan_verify(plan: BatchPlan, query_start_loc_np: np.ndarray,
                drafts: DraftBatch) -> VerifyPlan:
    """Rows that sample get ``num_drafts + 1`` logits rows: the last ``num_drafts + 1`` of
    their query."""
    rows = plan.sample_rows_np
    num_drafts = drafts.num_drafts_np[rows]
    lengths = num_drafts + 1
    last = query_start_loc_np[rows + 1].astype(np.int64) - 1
    offsets = np.cumsum(lengths) - lengths
    return VerifyPlan(
        slots_np=plan.idx_mapping_np[rows].astype(np.int64),
        num_drafts_np=num_drafts,
        offsets_np=offsets,
        token_rows_np=_segments(last - num_drafts, lengths),
    )


@dataclass
class Verified:
    sampled: torch.Tensor  # int64 [num_logits_rows]: the target's sample at every row
    num_accepted: torch.Tensor  # int64 [num_sampled]: drafts accepted per sampling row
    next_tokens: torch.Tensor  # int64 [num_sampled]: the last token of each accepted run


def _index_arrays(vp: VerifyPlan, drafts: DraftBatch, rows: np.ndarray,
                  max_drafts: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Per position p: the logits rows and slots of the sampling rows with >= p drafts (the
    slots' list is the second half of each pair); then the [num_sampled, max_drafts]
    draft table (-1 past a row's drafts) and its logits rows."""
    per_position = []
    for p in range(max_drafts + 1):
        sel = np.flatnonzero(vp.num_drafts_np >= p)
        per_position += [vp.offsets_np[sel] + p, vp.slots_np[sel]]
    cols = np.arange(max_drafts, dtype=np.int64)
    has_draft = cols < vp.num_drafts_np[:, None]  # [num_sampled, max_drafts]
    table = np.full(has_draft.shape, -1, dtype=np.int64)
    row_of_draft = np.repeat(np.arange(len(drafts.num_drafts_np)), drafts.num_drafts_np)
    # Drafts of the rows that sample (every drafting row does: its prompt is complete).
    table[has_draft] = drafts.draft_ids_np[np.isin(row_of_draft, rows)]
    candidate_rows = vp.offsets_np[:, None] + np.minimum(cols, vp.num_drafts_np[:, None])
    return per_position, table, candidate_rows


def verify_drafts(
    logits: torch.Tensor,  # [num_logits_rows, V], rows in VerifyPlan order
    sampler: Sampler,
    vp: VerifyPlan,
    drafts: DraftBatch,
    sample_rows_np: np.ndarray,  # int64 [num_sampled]: the batch rows that sample
) -> Verified:
    """Sample every row as its output index says, then accept each row's leading drafts that
    equal the samples. The slots' output counters end where they began: the caller advances
    them by the accepted runs."""
    device = logits.device
    max_drafts = int(vp.num_drafts_np.max(initial=0))
    per_position, table, candidate_rows = _index_arrays(vp, drafts, sample_rows_np, max_drafts)
    tail = [table.ravel(), candidate_rows.ravel(), vp.num_drafts_np, vp.offsets_np]
    arrays = [*per_position, *tail]
    parts = torch.split(host_to_device(np.concatenate(arrays), torch.int64, device),
                        [a.shape[0] for a in arrays])
    counters = sampler.states.num_output_tokens  # int64 [max_num_reqs]: the noise counter
    sampled = torch.empty(vp.num_logits_rows, dtype=torch.int64, device=device)
    for p in range(max_drafts + 1):
        rows, slots = parts[2 * p], parts[2 * p + 1]
        if p:  # these rows sample output index num_output_tokens + p
            counters.index_add_(0, slots, torch.ones_like(slots))
        slots_np = per_position[2 * p + 1]
        sampled.index_copy_(0, rows, sampler.sample(logits.index_select(0, rows), slots,
                                                     slots_np))
    draft_table, candidate_rows_dev, num_drafts, offsets = parts[-4:]
    counters.index_add_(0, parts[1], -num_drafts)  # parts[1]: every sampling row's slot
    draft_table = draft_table.view(table.shape)  # int64 [num_sampled, max_drafts]
    candidates = sampled[candidate_rows_dev].view(table.shape)
    num_accepted = (candidates == draft_table).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return Verified(sampled, num_accepted, sampled.index_select(0, offsets + num_accepted))
