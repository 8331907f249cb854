"""One step's batch: its order and host-side facts (``BatchPlan``), the persistent input buffers
(``InputBuffers``) and the views of them one step uses (``InputBatch``).

The step orders the batch (decodes first, then the others by size) and maps each batch row to
its slot, then fills the buffers on the device (docs/architecture.md#step-2-order-the-batch,
#step-3-prepare-inputs). Only the per-row arrays the host knows
(``idx_mapping``, ``query_start_loc``, ``logits_indices`` and the rows to sample) travel from the
host, in the step's one staging copy; everything else is computed by the input-prep ops from
the per-slot state on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.platform.base import InputPrepOps
from pagedserve.worker.capture_sizes import DECODE_QUERY_LEN, BatchDescriptor, CudaGraphMode
from pagedserve.worker.prefix_views import PrefixViews
from pagedserve.worker.staging import StagedArray, StagingBuffer
from pagedserve.worker.states import RequestStates


class InputBuffers:
    """Fixed-address device buffers (CUDA graphs replay them); a step uses a prefix of each.
    The host-written ones are views into a staging buffer (host and device twins)."""

    @staticmethod
    def staged_arrays(max_num_reqs: int) -> list[StagedArray]:
        """The arrays InputBuffers keeps in a staging buffer."""
        return [
            StagedArray("idx_mapping", torch.int32, max_num_reqs),
            StagedArray("query_start_loc", torch.int32, max_num_reqs + 1),
            StagedArray("logits_indices", torch.int64, max_num_reqs),
            StagedArray("sample_idx_mapping", torch.int64, max_num_reqs),
            StagedArray("sample_logits_indices", torch.int64, max_num_reqs),
        ]

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        device: torch.device,
        staging: StagingBuffer | None = None,
    ) -> None:
        """``staging`` must hold ``staged_arrays(max_num_reqs)``; None: a buffer of its own."""
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        if staging is None:
            staging = StagingBuffer(self.staged_arrays(max_num_reqs), device)
        self.staging = staging
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.is_padding = torch.zeros(max_num_tokens, dtype=torch.bool, device=device)
        self._marked_padding: tuple[int, int] = (0, 0)
        """(num_tokens, num_tokens_padded) that ``is_padding`` holds now."""
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        views, host = staging.device_views, staging.host
        # int32 [max_num_reqs + 1]; entries past num_reqs repeat num_tokens
        self.query_start_loc = views["query_start_loc"]
        self.query_start_loc_np = host["query_start_loc"]
        self.idx_mapping = views["idx_mapping"]  # int32 [max_num_reqs]
        self.idx_mapping_np = host["idx_mapping"]
        self.logits_indices = views["logits_indices"]  # int64 [max_num_reqs]
        self.logits_indices_np = host["logits_indices"]
        # The rows whose prefill completes (they sample): their slots and logits rows.
        self.sample_idx_mapping = views["sample_idx_mapping"]  # int64 [max_num_reqs]
        self.sample_idx_mapping_np = host["sample_idx_mapping"]
        self.sample_logits_indices = views["sample_logits_indices"]  # int64 [max_num_reqs]
        self.sample_logits_indices_np = host["sample_logits_indices"]
        # The prefixes a step hands out, made once per length.
        self.prefix = {
            name: PrefixViews(getattr(self, name))
            for name in ("input_ids", "positions", "is_padding", "seq_lens", "query_start_loc",
                         "idx_mapping", "logits_indices", "sample_idx_mapping",
                         "sample_logits_indices")
        }

    def mark_padding(self, num_tokens: int, num_tokens_padded: int) -> None:
        """``is_padding[:num_tokens_padded]``: False on real rows, True on padding rows (never
        written). Rewritten only when the counts change (a run of decodes keeps them)."""
        if self._marked_padding == (num_tokens, num_tokens_padded):
            return
        self.is_padding[:num_tokens] = False
        self.is_padding[num_tokens:num_tokens_padded] = True
        self._marked_padding = (num_tokens, num_tokens_padded)


@dataclass
class BatchPlan:
    """Host-side facts of a step, in batch order (known before any device work); built by
    ``plan_batch``, every derived value computed once."""

    req_ids: list[str]
    idx_mapping_np: np.ndarray  # int32 [num_reqs]: batch row -> slot
    query_lens_np: np.ndarray  # int32 [num_reqs]: tokens scheduled per row
    num_computed_tokens_np: np.ndarray  # int32 [num_reqs]: before this step
    prefill_len_np: np.ndarray  # int32 [num_reqs]
    seq_lens_np: np.ndarray  # int32 [num_reqs]: num_computed + query_len
    sample_rows_np: np.ndarray  # int64 [num_sampled]: rows whose prefill is complete after it
    num_tokens: int
    max_query_len: int
    min_query_len: int
    max_seq_len: int
    has_prefill: bool
    """Some row reads prefill tokens this step."""
    num_decodes: int
    """Rows of query length 1; ``_batch_order`` puts them first."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def uniform_decode_len(self) -> int | None:
        """The common query length of a batch that only decodes; None with a real prefill."""
        q = self.max_query_len
        if q != self.min_query_len:
            return None
        if q > DECODE_QUERY_LEN and self.has_prefill:
            return None
        return q

    def check(
        self,
        total_num_scheduled_tokens: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_blocks_np: np.ndarray,  # int32 [max_num_reqs]: blocks in each slot's table
        block_size: int,
    ) -> None:
        """Host-side checks that keep a bad plan from reading or writing out of bounds."""
        if self.num_tokens != total_num_scheduled_tokens:
            raise ValueError(f"total_num_scheduled_tokens: {total_num_scheduled_tokens}, but "
                             f"num_scheduled_tokens adds up to {self.num_tokens}")
        if self.num_tokens > max_num_batched_tokens:
            raise ValueError(f"num_scheduled_tokens: {self.num_tokens} tokens exceed "
                             f"max_num_batched_tokens ({max_num_batched_tokens})")
        if self.min_query_len <= 0 or self.max_seq_len > max_model_len:
            raise ValueError("num_scheduled_tokens: every request needs 1..max_model_len "
                             f"({max_model_len}) tokens in all")
        capacity = num_blocks_np[self.idx_mapping_np] * block_size  # token slots per row
        if (self.seq_lens_np > capacity).any():
            i = np.flatnonzero(self.seq_lens_np > capacity)[0]
            raise ValueError(f"block_ids: request {self.req_ids[i]!r} needs "
                             f"{self.seq_lens_np[i]} token slots, its blocks hold {capacity[i]}")


def _batch_order(
    num_scheduled_tokens: dict[str, int], min_query_len: int, max_query_len: int
) -> tuple[list[str], np.ndarray]:
    """Decodes first (query length 1), then the others by size; ties keep the scheduler's
    order. Returns the request ids and their query lengths (int32) in that order."""
    req_ids = list(num_scheduled_tokens)
    query_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids))
    if min_query_len == max_query_len:
        return req_ids, query_lens  # e.g. a run of decodes: already in order
    # Query lengths are >= 1, so -1 puts every decode first (int32 like the lengths: numpy 2
    # refuses a Python int that does not fit the array's dtype).
    keys = np.where(query_lens == DECODE_QUERY_LEN, np.int32(-1), query_lens)
    order = np.argsort(keys, kind="stable")
    return [req_ids[i] for i in order.tolist()], query_lens[order]


def plan_batch(num_scheduled_tokens: dict[str, int], states: RequestStates) -> BatchPlan:
    # Python's min/max/sum on the dict's values: cheaper than numpy's for the usual batch.
    lens = num_scheduled_tokens.values()
    empty = not lens
    min_query_len, max_query_len = (0, 0) if empty else (min(lens), max(lens))
    req_ids, query_lens_np = _batch_order(num_scheduled_tokens, min_query_len, max_query_len)
    index = states.req_id_to_index
    try:
        idx_mapping_np = np.fromiter(map(index.__getitem__, req_ids), dtype=np.int32,
                                     count=len(req_ids))
    except KeyError:
        missing = [r for r in req_ids if r not in index]
        raise ValueError(f"num_scheduled_tokens: requests {missing[:5]} have no slot") from None
    num_computed_np = states.num_computed_tokens_np[idx_mapping_np]
    prefill_len_np = states.prefill_len_np[idx_mapping_np]
    seq_lens_np = num_computed_np + query_lens_np
    has_prefill = bool((num_computed_np < prefill_len_np).any())
    # Without a prefill every row is past its prompt, so every row samples.
    sample_rows_np = (np.flatnonzero(seq_lens_np >= prefill_len_np) if has_prefill
                      else np.arange(len(req_ids)))
    return BatchPlan(
        req_ids=req_ids,
        idx_mapping_np=idx_mapping_np,
        query_lens_np=query_lens_np,
        num_computed_tokens_np=num_computed_np,
        prefill_len_np=prefill_len_np,
        seq_lens_np=seq_lens_np,
        sample_rows_np=sample_rows_np,
        num_tokens=sum(lens),
        max_query_len=max_query_len,
        min_query_len=min_query_len,
        max_seq_len=0 if empty else int(seq_lens_np.max()),
        has_prefill=has_prefill,
        num_decodes=int(np.count_nonzero(query_lens_np == DECODE_QUERY_LEN)),
    )


@dataclass
class InputBatch:
    """Views of the buffers for one step, plus the plan and the descriptor it runs under."""

    plan: BatchPlan
    descriptor: BatchDescriptor
    """What the graph dispatcher chose (the step pads its tokens to ``num_tokens``)."""
    mode: CudaGraphMode
    """How the forward really runs (NONE = eager, until graphs are captured)."""
    num_reqs_after_padding: int
    """Requests seen by attention: padded only when the step really replays a FULL graph."""
    idx_mapping: torch.Tensor  # int32 [num_reqs], device
    query_start_loc: torch.Tensor  # int32 [num_reqs_after_padding + 1], device
    query_start_loc_np: np.ndarray  # int32 [num_reqs_after_padding + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs_after_padding], device (0 on padded requests)
    seq_lens_np: np.ndarray  # int32 [num_reqs_after_padding], 0 on padded requests
    input_ids: torch.Tensor  # int32 [num_tokens_after_padding], device
    positions: torch.Tensor  # int64 [num_tokens_after_padding], device
    is_padding: torch.Tensor  # bool [num_tokens_after_padding], device
    logits_indices: torch.Tensor  # int64 [num_reqs], device: the last row of each request
    sample_idx_mapping: torch.Tensor  # int64 [num_sampled], device: slots of sampled rows
    sample_logits_indices: torch.Tensor  # int64 [num_sampled], device: their logits rows

    @property
    def req_ids(self) -> list[str]:
        return self.plan.req_ids

    @property
    def idx_mapping_np(self) -> np.ndarray:
        return self.plan.idx_mapping_np

    @property
    def num_reqs(self) -> int:
        return self.plan.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def num_tokens_after_padding(self) -> int:
        return self.descriptor.num_tokens

    @property
    def max_query_len(self) -> int:
        return self.plan.max_query_len

    @property
    def max_seq_len(self) -> int:
        return self.plan.max_seq_len


def stage_batch(plan: BatchPlan, buffers: InputBuffers) -> np.ndarray:
    """Write the step's per-row arrays into the host side of the staging buffer (the runner's
    staging copy then brings them to the device buffers). Returns the step's own copy of
    query_start_loc, int32 [num_reqs + 1]: the staging buffer is rewritten by the next step."""
    num_reqs = plan.num_reqs
    query_start_loc_np = buffers.query_start_loc_np  # int32 [max_num_reqs + 1], staging
    query_start_loc_np[0] = 0
    np.cumsum(plan.query_lens_np, out=query_start_loc_np[1 : num_reqs + 1])
    query_start_loc_np[num_reqs + 1 :] = plan.num_tokens
    logits_indices_np = buffers.logits_indices_np[:num_reqs]  # int64, staging
    np.subtract(query_start_loc_np[1 : num_reqs + 1], 1, out=logits_indices_np)
    buffers.idx_mapping_np[:num_reqs] = plan.idx_mapping_np
    rows = plan.sample_rows_np
    num_sampled = rows.shape[0]
    if num_sampled == num_reqs:  # every row samples (rows are 0..num_reqs-1)
        buffers.sample_idx_mapping_np[:num_reqs] = plan.idx_mapping_np
        buffers.sample_logits_indices_np[:num_reqs] = logits_indices_np
    else:
        buffers.sample_idx_mapping_np[:num_sampled] = plan.idx_mapping_np[rows]
        buffers.sample_logits_indices_np[:num_sampled] = logits_indices_np[rows]
    return query_start_loc_np[: num_reqs + 1].copy()


def prepare_inputs(
    plan: BatchPlan,
    query_start_loc_np: np.ndarray,  # int32 [num_reqs + 1], from stage_batch
    descriptor: BatchDescriptor,
    mode: CudaGraphMode,
    buffers: InputBuffers,
    states: RequestStates,
    ops: InputPrepOps,
) -> InputBatch:
    """Fill input_ids, positions, seq_lens and is_padding on the device. Call after the staging
    copy that carried ``stage_batch``'s arrays."""
    num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
    num_tokens_padded = descriptor.num_tokens
    # Tokens pad as the descriptor says in every mode (so padding rows run on the CPU too);
    # requests pad only when a FULL graph really replays.
    num_reqs_after_padding = num_reqs
    if mode is CudaGraphMode.FULL and descriptor.num_reqs is not None:
        num_reqs_after_padding = descriptor.num_reqs
    buffers.mark_padding(num_tokens, num_tokens_padded)
    prefix = buffers.prefix
    idx_mapping = prefix["idx_mapping"][num_reqs]
    query_start_loc = prefix["query_start_loc"][num_reqs_after_padding + 1]
    # The ops see the step's token rows only: rows past num_tokens_padded are not this step's.
    input_ids = prefix["input_ids"][num_tokens_padded]
    positions = prefix["positions"][num_tokens_padded]
    if plan.has_prefill:
        ops.prepare_prefill_inputs(input_ids, idx_mapping, query_start_loc,
                                   states.all_token_ids, states.prefill_len,
                                   states.num_computed_tokens)
    ops.prepare_pos_seq_lens(idx_mapping, query_start_loc, states.num_computed_tokens,
                             positions, buffers.seq_lens)
    ops.combine_sampled_tokens(input_ids, idx_mapping, states.last_sampled_tokens,
                               query_start_loc, buffers.seq_lens, states.prefill_len)
    seq_lens_np = plan.seq_lens_np
    if num_reqs_after_padding != num_reqs:  # padded requests: no tokens, no context
        seq_lens_np = np.zeros(num_reqs_after_padding, dtype=np.int32)
        seq_lens_np[:num_reqs] = plan.seq_lens_np
        query_start_loc_np = np.concatenate(
            [query_start_loc_np, np.full(num_reqs_after_padding - num_reqs, num_tokens,
                                         dtype=np.int32)])
    num_sampled = plan.sample_rows_np.shape[0]
    return InputBatch(
        plan=plan,
        descriptor=descriptor,
        mode=mode,
        num_reqs_after_padding=num_reqs_after_padding,
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        query_start_loc_np=query_start_loc_np,
        seq_lens=prefix["seq_lens"][num_reqs_after_padding],
        seq_lens_np=seq_lens_np,
        input_ids=input_ids,
        positions=positions,
        is_padding=prefix["is_padding"][num_tokens_padded],
        logits_indices=prefix["logits_indices"][num_reqs],
        sample_idx_mapping=prefix["sample_idx_mapping"][num_sampled],
        sample_logits_indices=prefix["sample_logits_indices"][num_sampled],
    )
