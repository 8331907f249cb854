"""The CPU backend: the torch reference, with decode rows run by the native kernel.

Prefill (several query rows of one request) stays on torch's SDPA, whose fused CPU kernel is
efficient for long query blocks; decode rows of the whole batch go to ``paged_decode.c``,
which reads keys and values in place through the block table (see ``cpu_native``).
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import KVScales
from pagedserve.attention.backends.cpu_native import (
    PagedDecodeKernel,
    has_copy_for,
    heads_packed,
)
from pagedserve.attention.backends.torch_ref import TorchRefBackend, _DecodePlan


class CpuBackend(TorchRefBackend):
    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel) -> None:
        super().__init__()
        self.kernel = kernel

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
