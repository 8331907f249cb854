"""Block tables: for each slot, the ids of the KV blocks that hold its tokens, in order.

The scheduler's block pool owns the blocks; the runner only mirrors its decisions. Writes go to
a host mirror and are staged: each written entry as a (flat index, block id) pair in the step's
staging buffer, which reaches the device with the step's one copy; ``apply_staged_writes`` then
scatters them into the device table with one op. Only when a step writes more entries than the
staging buffer holds (many long prefix-cache hits at once) do the rows of the slots that did
not fit travel whole, in a second copy. A step then gathers the rows of its requests into a
second table in batch order, and turns positions into cache slots
(``block_id * block_size + offset``) for the KV write.

One KV-cache group (every attention layer has the same block size and layout).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.sched_output import BlockIds
from pagedserve.math_utils import cdiv
from pagedserve.platform.base import InputPrepOps
from pagedserve.worker.prefix_views import PrefixViews
from pagedserve.worker.staging import StagedArray, StagingBuffer, host_to_device


def single_group(block_ids: BlockIds, req_id: str) -> list[int]:
    """The block ids of the one KV-cache group this runner supports."""
    if len(block_ids) != 1:
        raise ValueError(f"block_ids: request {req_id!r} has {len(block_ids)} KV-cache groups, "
                         "the runner supports exactly one")
    return block_ids[0]


class BlockTables:
    @staticmethod
    def staged_arrays(max_num_reqs: int, max_num_tokens: int, block_size: int) -> list[
        StagedArray
    ]:
        """The entry arrays BlockTables keeps in a staging buffer. They hold every block a
        step allocates (at most one partly filled block per request beyond its tokens' blocks);
        rows that do not fit travel whole (``_copy_rows``)."""
        capacity = max_num_reqs + cdiv(max_num_tokens, block_size)
        return [
            StagedArray("block_entry_index", torch.int64, capacity),
            StagedArray("block_entry_id", torch.int32, capacity),
        ]

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_tokens: int,
        block_size: int,
        device: torch.device,
        ops: InputPrepOps,
        staging: StagingBuffer | None = None,
    ) -> None:
        """``staging`` must hold ``staged_arrays(...)`` of the same sizes; None: a buffer of
        its own."""
        self.block_size = block_size
        self.max_num_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.ops = ops
        if staging is None:
            staging = StagingBuffer(
                self.staged_arrays(max_num_reqs, max_num_tokens, block_size), device)
        self.staging = staging

        # Host mirror and the number of valid entries in each row.
        self.block_table_np = np.zeros((max_num_reqs, self.max_num_blocks), dtype=np.int32)
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [max_num_reqs]
        # Staged entries: flat index (slot * max_num_blocks + column) and block id.
        self._entry_index_np = staging.host["block_entry_index"]  # int64 [capacity]
        self._entry_id_np = staging.host["block_entry_id"]  # int32 [capacity]
        self._entry_index = staging.device_views["block_entry_index"]  # int64 [capacity]
        self._entry_id = staging.device_views["block_entry_id"]  # int32 [capacity]
        self.num_staged_entries = 0
        self._staged_rows: set[int] = set()
        """Slots whose entries did not fit: their whole rows are copied."""
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
        self._input_block_table_rows = PrefixViews(self.input_block_table)
        self._slot_mapping_rows = PrefixViews(self.slot_mapping)

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
        n, count = self.num_staged_entries, end - start
        if slot in self._staged_rows or n + count > self._entry_index_np.shape[0]:
            self._staged_rows.add(slot)  # the whole row travels; it holds these entries too
            return
        first = slot * self.max_num_blocks + start
        if count == 1:  # a decode's new block: scalar writes are the cheapest
            self._entry_index_np[n] = first
            self._entry_id_np[n] = block_ids[0]
        else:
            self._entry_index_np[n : n + count] = np.arange(first, first + count)
            self._entry_id_np[n : n + count] = block_ids
        self.num_staged_entries = n + count

    @property
    def has_staged_entries(self) -> bool:
        """Entries wait in the staging buffer: its next copy must come before
        ``apply_staged_writes``."""
        return self.num_staged_entries > 0

    def apply_staged_writes(self) -> None:
        """Write the staged entries into the device table. Call after the staging buffer's
        copy of this step (the runner's, or ``staging.copy_to_device()``)."""
        n = self.num_staged_entries
        if n:
            # Entries never repeat a flat index within a step: a slot's row is written once
            # (overwrite_row) or extended past its end (append_block_ids).
            self.block_table.view(-1).index_copy_(
                0, self._entry_index[:n], self._entry_id[:n])
            self.num_staged_entries = 0
        if self._staged_rows:
            self._copy_rows()

    def _copy_rows(self) -> None:
        """The overflow path: whole rows, in a pinned copy of their own."""
        slots = np.fromiter(sorted(self._staged_rows), dtype=np.int64)  # [num_rows]
        rows = self.block_table_np[slots]  # int32 [num_rows, max_num_blocks]
        self.block_table.index_copy_(0, host_to_device(slots, torch.int64, self.device),
                                     host_to_device(rows, torch.int32, self.device))
        self._staged_rows.clear()

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,  # int32 [num_reqs]
        num_reqs_padded: int,
    ) -> torch.Tensor:
        """Rows of the step's requests in batch order: int32 [num_reqs_padded, max_num_blocks].
        Rows num_reqs.. (FULL-graph request padding) keep stale ids; their seq_lens are 0."""
        self.ops.gather_block_tables(idx_mapping, self.block_table, self.input_block_table)
        return self._input_block_table_rows[num_reqs_padded]

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
        return self._slot_mapping_rows[num_tokens_padded]
