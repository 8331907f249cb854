"""The FP8 KV cache's quantization in torch: the reference that the Triton kernels write
(``kernels/rope_kv_write.py``) and read (``kernels/attention_common.py``) the same way.

A cache element is ``value / scale`` rounded to e4m3 (to nearest, ties to even), saturated to
+-448 first, so an outlier clips instead of becoming NaN; reading multiplies by the scale.
A cache in the model's dtype holds the values themselves.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import FP8_KV_DTYPE, KVScales
from pagedserve.layers.quantization.fp8_ops import FP8_MAX, MIN_SCALE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [...] as a cache of ``cache_dtype`` stores it (same shape)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def calibrated_kv_scales(
    key: torch.Tensor,  # [T, Hkv * D], before the rotary embedding
    value: torch.Tensor,  # [T, Hkv * D]
    head_dim: int,
) -> KVScales:
    """Scales that map the largest key and value of one step to e4m3's largest, 448.

    The keys are cached after the (neox) rotary embedding, which rotates each pair of dimensions
    ``(j, j + D/2)``; no rotated element exceeds its pair's norm, so the keys' scale is taken from
    the largest pair norm: no key of this step saturates at any position. An all-zero tensor
    gets the smallest scale instead of 0."""
    pairs = key.float().reshape(key.shape[0], -1, 2, head_dim // 2)  # [T, Hkv, 2, D/2]
    k_amax = pairs.square().sum(dim=2).sqrt().amax() if key.numel() else key.new_zeros(())
    v_amax = value.float().abs().amax() if value.numel() else value.new_zeros(())
    k = max(float(k_amax) / FP8_MAX, MIN_SCALE)
    v = max(float(v_amax) / FP8_MAX, MIN_SCALE)
    return KVScales(k, v)


def kv_from_cache(kv: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales) -> torch.Tensor:
    """Keys and values [2, ...] of a cache back in ``dtype`` (same shape): FP8 keys times
    ``kv_scales.k``, values times ``kv_scales.v``."""
    if kv.dtype != FP8_KV_DTYPE:
        return kv.to(dtype)
    scales = torch.tensor([kv_scales.k, kv_scales.v], device=kv.device)  # fp32 [2]
    return (kv.float() * scales.view(2, *[1] * (kv.dim() - 1))).to(dtype)
