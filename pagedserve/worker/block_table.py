"""Block tables: for each slot, the ids of the KV blocks that hold its tokens, in order.

The scheduler's block pool owns the blocks; the runner only mirrors its decisions. Writes go to
a host mirror and are staged per slot; ``apply_staged_writes`` copies the staged rows to the
device table in one go, once per step. A step then gathers the rows of its requests into a
second table in batch order, and turns positions into cache slots
(``block_id * block_size + offset``) for the KV write.

One KV-cache group (every attention layer has the same block size and layout).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.sched_output import BlockIds
from pagedserve.worker.ops import InputPrepOps


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def single_group(block_ids: BlockIds, req_id: str) -> list[int]:
    """The block ids of the one KV-cache group this runner supports."""
    if len(block_ids) != 1:
        raise ValueError(f"block_ids: request {req_id!r} has {len(block_ids)} KV-cache groups, "
                         "the runner supports exactly one")
    return block_ids[0]


class BlockTables:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_tokens: int,
        block_size: int,
        device: torch.device,
        ops: InputPrepOps,
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.ops = ops

        # Host mirror and the number of valid entries in each row.
        self.block_table_np = np.zeros((max_num_reqs, self.max_num_blocks), dtype=np.int32)
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [max_num_reqs]
        self._staged_slots: set[int] = set()
        self.block_table = torch.zeros(
            max_num_reqs, self.max_num_blocks, dtype=torch.int32, device=device
        )  # int32 [max_num_reqs, max_num_blocks], indexed by slot
        # Fixed-address step buffers (graphs replay them).
        self.input_block_table = torch.zeros_like(
            self.block_table
        )  # int32 [max_num_reqs, max_num_blocks], indexed by batch row
        self.slot_mapping = torch.zeros(
            max_num_tokens, dtype=torch.int64, device=device
        )  # int64 [max_num_tokens]: token -> cache slot, PAD_SLOT_ID on padding rows

    def overwrite_row(self, slot: int, block_ids: list[int]) -> None:
        """A new request's whole row (stale entries beyond it are never read)."""
        self._stage(slot, 0, block_ids)

    def append_block_ids(self, slot: int, block_ids: list[int]) -> None:
        self._stage(slot, int(self.num_blocks_np[slot]), block_ids)

    def _stage(self, slot: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.max_num_blocks:
            raise ValueError(f"block_ids: slot {slot} would hold {end} blocks, more than "
                             f"max_model_len allows ({self.max_num_blocks})")
        self.block_table_np[slot, start:end] = block_ids
        self.num_blocks_np[slot] = end
        self._staged_slots.add(slot)

    def apply_staged_writes(self) -> None:
        """Copy every staged row to the device table: one gather on the host, one scatter."""
        if not self._staged_slots:
            return
        slots = np.fromiter(sorted(self._staged_slots), dtype=np.int64)  # [num_staged]
        rows = torch.from_numpy(self.block_table_np[slots])  # int32 [num_staged, max_num_blocks]
        index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        self.block_table.index_copy_(0, index, rows.to(self.device, non_blocking=True))
        self._staged_slots.clear()

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,  # int32 [num_reqs]
        num_reqs_padded: int,
    ) -> torch.Tensor:
        """Rows of the step's requests in batch order: int32 [num_reqs_padded, max_num_blocks].
        Rows num_reqs.. (FULL-graph request padding) keep stale ids; their seq_lens are 0."""
        self.ops.gather_block_tables(idx_mapping, self.block_table, self.input_block_table)
        return self.input_block_table[:num_reqs_padded]

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,  # int32 [num_reqs]
        query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
        positions: torch.Tensor,  # int64 [max_num_tokens]
        num_tokens_padded: int,
    ) -> torch.Tensor:
        """int64 [num_tokens_padded]: the cache slot of every token, PAD_SLOT_ID on padding."""
        self.ops.compute_slot_mappings(
            idx_mapping,
            query_start_loc,
            positions,
            self.block_table,
            self.block_size,
            self.slot_mapping,
            num_tokens_padded,
        )
        return self.slot_mapping[:num_tokens_padded]
