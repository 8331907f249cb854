"""The FP8 KV cache's quantization in torch: the reference that the Triton kernels write
(``kernels/rope_kv_write.py``) and read (``kernels/attention_common.py``) the same way.

A cache element is ``value / scale`` rounded to e4m3 (to nearest, ties to even), saturated to
+-448 first, so an outlier clips instead of becoming NaN; reading multiplies by the scale.
A cache in the model's dtype holds the values themselves.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import FP8_KV_DTYPE, KVScales
from pagedserve.layers.quantization.fp8_ops import FP8_MAX


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [...] as a cache of ``cache_dtype`` stores it (same shape)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def kv_from_cache(kv: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales) -> torch.Tensor:
    """Keys and values [2, ...] of a cache back in ``dtype`` (same shape): FP8 keys times
    ``kv_scales.k``, values times ``kv_scales.v``."""
    if kv.dtype != FP8_KV_DTYPE:
        return kv.to(dtype)
    scales = torch.tensor([kv_scales.k, kv_scales.v], device=kv.device)  # fp32 [2]
    return (kv.float() * scales.view(2, *[1] * (kv.dim() - 1))).to(dtype)
