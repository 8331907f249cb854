"""The step's token bitmask: what the engine core fills for the constrained requests and the
model runner applies to their logits rows before sampling
(docs/architecture.md#structured-outputs).

The mask is packed: int32 words, bit ``i`` of word ``j`` allows token ``32 j + i``. A row
whose bit is 0 gets ``-inf``; the other rows of the logits are not touched. On the CPU the
mask is applied with torch ops; on CUDA with a Triton kernel of the same semantics
(``kernels/token_bitmask.py``), as the platform says (``TokenBitmaskApplier``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedserve.platform.base import Platform

_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ``cdiv(vocab_size, 32)``."""
    return -(-vocab_size // _BITS)


@dataclass
class GrammarBitmask:
    """The masks of one step's constrained requests (a plain numpy array: it crosses process
    boundaries with the plan under tensor parallelism)."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), cdiv(vocab_size, 32)], host

    def rows_for(self, sampled_req_ids: list[str]) -> tuple[list[int], list[int]]:
        """(logits rows, bitmask rows) of the constrained requests among ``sampled_req_ids``
        (the requests whose rows became logits, in logits order)."""
        row_of = {rid: i for i, rid in enumerate(sampled_req_ids)}
        pairs = [(row_of[rid], i) for i, rid in enumerate(self.req_ids) if rid in row_of]
        return [p[0] for p in pairs], [p[1] for p in pairs]


class TokenBitmaskApplier:
    """Applies a step's ``GrammarBitmask`` to the logits with the platform's op: the Triton
    kernel where the platform runs Triton kernels, else the torch op. The only host-to-device
    traffic is the mask and its row indices (asynchronous, from pinned memory where the
    platform pins)."""

    def __init__(self, platform: Platform) -> None:
        self.pin_memory = platform.pin_memory
        self.op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] = apply_token_bitmask
        if platform.has_triton_kernels():
            from pagedserve.kernels.token_bitmask import apply_token_bitmask_triton

            self.op = apply_token_bitmask_triton

    def __call__(
        self, logits: torch.Tensor, grammar: GrammarBitmask, sampled_req_ids: list[str]
    ) -> None:
        """Mask ``logits`` [num_rows, V] in place for the constrained rows among
        ``sampled_req_ids`` (the requests of the logits rows, in order)."""
        rows, mask_rows = grammar.rows_for(sampled_req_ids)
        if not rows:
            return
        bitmask = torch.from_numpy(grammar.bitmask[mask_rows])  # [len(rows), W]
        rows_t = torch.tensor(rows, dtype=torch.int64)  # [len(rows)]
        if self.pin_memory:
            bitmask, rows_t = bitmask.pin_memory(), rows_t.pin_memory()
        device = logits.device
        self.op(logits, bitmask.to(device, non_blocking=True), rows_t.to(device, non_blocking=True))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: which tokens ``bitmask`` (int32 [R, W]) allows."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The torch op: ``logits[rows[k], t] = -inf`` wherever bit ``t`` of ``bitmask[k]`` is 0.

    logits [num_rows, V] (any float dtype), bitmask int32 [R, cdiv(V, 32)], rows int64 [R]."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [R, V]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, masked)
