"""The CPU backend: the torch reference, with decode rows run by the native kernel, prompts by
the native prefill kernel, and the rotary embedding with the cache write in one C pass
(``layers/cpu_rows.c``).

Decode rows of the whole batch go to ``paged_decode.c`` and the query rows of every prompt of
the step to ``paged_prefill.c`` (one call each per layer); both read keys and values in place
through the block table (see ``cpu_native``). Without the prefill kernel (no compiler, an FP8
cache, fp16) prompts run on torch's SDPA, one call per request.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import UNIT_KV_SCALES, AttentionMetadata, KVScales
from pagedserve.attention.backends.cpu_native import (
    PagedDecodeKernel,
    has_copy_for,
    heads_packed,
)
from pagedserve.attention.backends.cpu_native.prefill import PagedPrefillKernel
from pagedserve.attention.backends.torch_ref import TorchRefBackend, _DecodePlan, _host_list
from pagedserve.layers.cpu_rows import rope_and_write_kv_rows


class CpuBackend(TorchRefBackend):
    name = "cpu"

    def __init__(
        self, kernel: PagedDecodeKernel, prefill_kernel: PagedPrefillKernel | None = None
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.prefill_kernel = prefill_kernel
        # The last metadata whose prompts went to the prefill kernel, and their table.
        self._prefill_reqs: tuple[AttentionMetadata, torch.Tensor] | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Decode rows as the reference does; every prompt of the step in one call of the
        prefill kernel where it applies (causal, a cache in the query's dtype), else SDPA."""
        plan = self._plan(metadata, kv_cache.shape[2], query.device)
        kernel = self.prefill_kernel
        if not (plan.prefills and metadata.causal and kernel is not None
                and kernel.applies(query, kv_cache, output)):
            super().forward(query, kv_cache, metadata, scale, output, kv_scales)
            return
        if plan.decode is not None:
            self._decode(query, kv_cache, plan.decode, scale, output, kv_scales)
        kernel(query, kv_cache, metadata.block_table, self._prefill_table(metadata), scale,
               output)

    def _prefill_table(self, metadata: AttentionMetadata) -> torch.Tensor:
        """int64 [n, 4]: first query row, query_len, seq_len and block-table row of each
        request with more than one query row (built once per step)."""
        if self._prefill_reqs is None or self._prefill_reqs[0] is not metadata:
            n = metadata.num_reqs
            starts = _host_list(metadata.query_start_loc_cpu, metadata.query_start_loc, n + 1)
            seq_lens = _host_list(metadata.seq_lens_cpu, metadata.seq_lens, n)
            rows = [[starts[i], starts[i + 1] - starts[i], seq_lens[i], i] for i in range(n)
                    if starts[i + 1] - starts[i] > 1]
            self._prefill_reqs = (metadata, torch.tensor(rows, dtype=torch.int64))
        return self._prefill_reqs[1]

    def rope_and_write_kv(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        cos_sin: torch.Tensor,  # [num_tokens, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """In one C pass over the rows (``layers/cpu_rows.c``) where it applies (a cache in
        the query's dtype), else the torch code."""
        rotated = rope_and_write_kv_rows(query, key, value, cos_sin, kv_cache, slot_mapping)
        if rotated is not None:
            return rotated
        return super().rope_and_write_kv(query, key, value, cos_sin, kv_cache, slot_mapping,
                                         kv_scales)

    def _decode(
        self,
        query: torch.Tensor,  # [num_tokens, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        plan: _DecodePlan,
        scale: float,
        output: torch.Tensor,  # [num_tokens, Hq, D]
        kv_scales: KVScales,
    ) -> None:
        if not (has_copy_for(query.dtype, kv_cache.dtype) and heads_packed(query)):
            # fp16, an FP8 cache, odd strides
            super()._decode(query, kv_cache, plan, scale, output, kv_scales)
            return
        self.kernel(query, kv_cache, plan.rows, plan.block_table, plan.seq_lens, scale, output)
