"""The CPU backend: the torch reference, with decode rows run by the native kernel and the
rotary embedding with the cache write in one C pass (``layers/cpu_rows.c``).

Prefill (several query rows of one request) stays on torch's SDPA, whose fused CPU kernel is
efficient for long query blocks; decode rows of the whole batch go to ``paged_decode.c``,
which reads keys and values in place through the block table (see ``cpu_native``).
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import UNIT_KV_SCALES, KVScales
from pagedserve.attention.backends.cpu_native import (
    PagedDecodeKernel,
    has_copy_for,
    heads_packed,
)
from pagedserve.attention.backends.torch_ref import TorchRefBackend, _DecodePlan
from pagedserve.layers.cpu_rows import rope_and_write_kv_rows


class CpuBackend(TorchRefBackend):
    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel) -> None:
        super().__init__()
        self.kernel = kernel

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
