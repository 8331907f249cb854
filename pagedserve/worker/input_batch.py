"""One step's batch: its order and host-side facts (``BatchPlan``), the persistent input buffers
(``InputBuffers``) and the views of them one step uses (``InputBatch``).

Stop 2 orders the batch (decodes first, then the others by size) and maps each batch row to its
slot; stop 3 fills the buffers on the device. Only ``idx_mapping`` and ``query_start_loc`` (and
``logits_indices``, derived from it) are copied from the host; everything else is computed by
the input-prep ops from the per-slot state on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.worker.cudagraph import DECODE_QUERY_LEN, BatchDescriptor, CudaGraphMode
from pagedserve.worker.ops import InputPrepOps
from pagedserve.worker.states import RequestStates


class InputBuffers:
    """Fixed-address device buffers (CUDA graphs replay them); a step uses a prefix of each."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.is_padding = torch.zeros(max_num_tokens, dtype=torch.bool, device=device)
        self.query_start_loc = torch.zeros(
            max_num_reqs + 1, dtype=torch.int32, device=device
        )  # int32 [max_num_reqs + 1]; entries past num_reqs repeat num_tokens
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)


@dataclass
class BatchPlan:
    """Host-side facts of a step, in batch order (known before any device work)."""

    req_ids: list[str]
    idx_mapping_np: np.ndarray  # int32 [num_reqs]: batch row -> slot
    query_lens_np: np.ndarray  # int32 [num_reqs]: tokens scheduled per row
    num_computed_tokens_np: np.ndarray  # int32 [num_reqs]: before this step
    prefill_len_np: np.ndarray  # int32 [num_reqs]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens_np.sum())

    @property
    def seq_lens_np(self) -> np.ndarray:  # int32 [num_reqs]
        return self.num_computed_tokens_np + self.query_lens_np

    @property
    def is_prefilling_np(self) -> np.ndarray:  # bool [num_reqs]: reads prefill tokens this step
        return self.num_computed_tokens_np < self.prefill_len_np

    @property
    def samples_np(self) -> np.ndarray:  # bool [num_reqs]: prefill complete after this step
        return self.seq_lens_np >= self.prefill_len_np

    @property
    def uniform_decode_len(self) -> int | None:
        """The common query length of a batch that only decodes; None with a real prefill."""
        q = int(self.query_lens_np.max())
        if q != int(self.query_lens_np.min()):
            return None
        if q > DECODE_QUERY_LEN and bool(self.is_prefilling_np.any()):
            return None
        return q

    def check(
        self,
        total_num_scheduled_tokens: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        token_capacity_np: np.ndarray,  # int32 [max_num_reqs]: token slots of each slot's blocks
    ) -> None:
        """Host-side checks that keep a bad plan from reading or writing out of bounds."""
        if self.num_tokens != total_num_scheduled_tokens:
            raise ValueError(f"total_num_scheduled_tokens: {total_num_scheduled_tokens}, but "
                             f"num_scheduled_tokens adds up to {self.num_tokens}")
        if self.num_tokens > max_num_batched_tokens:
            raise ValueError(f"num_scheduled_tokens: {self.num_tokens} tokens exceed "
                             f"max_num_batched_tokens ({max_num_batched_tokens})")
        if (self.query_lens_np <= 0).any() or self.seq_lens_np.max() > max_model_len:
            raise ValueError("num_scheduled_tokens: every request needs 1..max_model_len "
                             f"({max_model_len}) tokens in all")
        capacity = token_capacity_np[self.idx_mapping_np]
        short = np.flatnonzero(self.seq_lens_np > capacity)
        if short.size:
            i = short[0]
            raise ValueError(f"block_ids: request {self.req_ids[i]!r} needs "
                             f"{self.seq_lens_np[i]} token slots, its blocks hold {capacity[i]}")


def plan_batch(num_scheduled_tokens: dict[str, int], states: RequestStates) -> BatchPlan:
    """Decodes first (query length 1), then the others by size; ties keep the scheduler's order."""
    req_ids = sorted(
        num_scheduled_tokens,
        key=lambda r: (num_scheduled_tokens[r] != DECODE_QUERY_LEN, num_scheduled_tokens[r]),
    )
    missing = [r for r in req_ids if r not in states.req_id_to_index]
    if missing:
        raise ValueError(f"num_scheduled_tokens: requests {missing[:5]} have no slot")
    idx_mapping_np = np.fromiter(
        (states.req_id_to_index[r] for r in req_ids), dtype=np.int32, count=len(req_ids)
    )
    query_lens_np = np.fromiter(
        (num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=len(req_ids)
    )
    return BatchPlan(
        req_ids=req_ids,
        idx_mapping_np=idx_mapping_np,
        query_lens_np=query_lens_np,
        num_computed_tokens_np=states.num_computed_tokens_np[idx_mapping_np],
        prefill_len_np=states.prefill_len_np[idx_mapping_np],
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
    input_ids: torch.Tensor  # int32 [num_tokens_after_padding], device
    positions: torch.Tensor  # int64 [num_tokens_after_padding], device
    is_padding: torch.Tensor  # bool [num_tokens_after_padding], device
    logits_indices: torch.Tensor  # int64 [num_reqs], device: the last row of each request
    logits_indices_np: np.ndarray  # int64 [num_reqs]

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
        return int(self.query_start_loc_np[self.num_reqs])

    @property
    def num_tokens_after_padding(self) -> int:
        return self.descriptor.num_tokens

    @property
    def max_query_len(self) -> int:
        return int(self.plan.query_lens_np.max())

    @property
    def max_seq_len(self) -> int:
        return int(self.plan.seq_lens_np.max())

    @property
    def seq_lens_np(self) -> np.ndarray:  # int32 [num_reqs_after_padding], 0 on padded requests
        out = np.zeros(self.num_reqs_after_padding, dtype=np.int32)
        out[: self.num_reqs] = self.plan.seq_lens_np
        return out


def _copy_to_device(src: np.ndarray, dst: torch.Tensor) -> torch.Tensor:
    """Copy a host array into the start of a device buffer; returns that view."""
    view = dst[: src.shape[0]]
    view.copy_(torch.from_numpy(src), non_blocking=True)
    return view


def prepare_inputs(
    plan: BatchPlan,
    descriptor: BatchDescriptor,
    mode: CudaGraphMode,
    buffers: InputBuffers,
    states: RequestStates,
    ops: InputPrepOps,
) -> InputBatch:
    """Fill input_ids, positions, seq_lens, query_start_loc, logits_indices and is_padding."""
    num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
    num_tokens_padded = descriptor.num_tokens
    # Tokens pad as the descriptor says in every mode (so padding rows run on the CPU too);
    # requests pad only when a FULL graph really replays.
    num_reqs_after_padding = num_reqs
    if mode is CudaGraphMode.FULL and descriptor.num_reqs is not None:
        num_reqs_after_padding = descriptor.num_reqs
    buffers.is_padding[:num_tokens] = False
    buffers.is_padding[num_tokens:num_tokens_padded] = True  # padding rows are never written

    idx_mapping = _copy_to_device(plan.idx_mapping_np, buffers.idx_mapping)
    query_start_loc_np = np.full(buffers.max_num_reqs + 1, num_tokens, dtype=np.int32)
    query_start_loc_np[0] = 0
    np.cumsum(plan.query_lens_np, out=query_start_loc_np[1 : num_reqs + 1])
    _copy_to_device(query_start_loc_np, buffers.query_start_loc)
    query_start_loc = buffers.query_start_loc[: num_reqs_after_padding + 1]

    if plan.is_prefilling_np.any():
        ops.prepare_prefill_inputs(buffers.input_ids, idx_mapping, query_start_loc,
                                   states.all_token_ids, states.prefill_len,
                                   states.num_computed_tokens)
    ops.prepare_pos_seq_lens(idx_mapping, query_start_loc, states.num_computed_tokens,
                             buffers.positions, buffers.seq_lens)
    ops.combine_sampled_tokens(buffers.input_ids, idx_mapping, states.last_sampled_tokens,
                               query_start_loc, buffers.seq_lens, states.prefill_len)
    logits_indices_np = query_start_loc_np[1 : num_reqs + 1].astype(np.int64) - 1
    return InputBatch(
        plan=plan,
        descriptor=descriptor,
        mode=mode,
        num_reqs_after_padding=num_reqs_after_padding,
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        query_start_loc_np=query_start_loc_np[: num_reqs_after_padding + 1],
        seq_lens=buffers.seq_lens[:num_reqs_after_padding],
        input_ids=buffers.input_ids[:num_tokens_padded],
        positions=buffers.positions[:num_tokens_padded],
        is_padding=buffers.is_padding[:num_tokens_padded],
        logits_indices=_copy_to_device(logits_indices_np, buffers.logits_indices),
        logits_indices_np=logits_indices_np,
    )
