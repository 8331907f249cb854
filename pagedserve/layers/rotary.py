"""Rotary position embedding with a cos/sin cache indexed by position.

Neox style, as Hugging Face Llama applies it: each head vector is split into halves
``x1 | x2`` that rotate as pairs ``(x1[i], x2[i])`` by angle ``position * inv_freq[i]``.
Supported ``rope_type``: ``default``, ``linear`` and ``llama3`` (Llama 3.1 frequency scaling).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs have
    ``rope_theta`` and ``rope_scaling`` (with ``type`` or ``rope_type``) at the top level.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            f"rope_parameters: per-layer-type rope settings are not supported: {params}"
        )
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def rope_inv_freq(head_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies after the config's scaling."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type: {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    base = float(rope_parameters["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # fp32 [head_dim // 2]
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_parameters)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(
                f"inv_freq: expected shape ({head_dim // 2},), got {tuple(inv_freq.shape)}"
            )
        self.head_dim = head_dim
        self.max_position = max_position
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # fp32 [max_position, head_dim // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.cos_sin_cache: torch.Tensor  # [max_position, head_dim]: cos half | sin half
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T]; query [T, Hq * D], key [T, Hkv * D] -> rotated, same shapes."""
        return self.rotate(self.cos_sin(positions), query, key)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """positions int64 [T] -> [T, D]: each token's cos half | sin half.

        A model gathers these once per forward and hands them to every layer: the same
        positions serve all layers, and a compiled graph split into per-layer pieces cannot
        share one gather between pieces by itself (measured on an H200: 2 kernels per layer)."""
        return self.cos_sin_cache.index_select(0, positions)

    def rotate(
        self, cos_sin: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin [T, D] from ``cos_sin``; query [T, Hq * D], key [T, Hkv * D] -> rotated."""
        return rotate_neox(cos_sin, query, key)


def rotate_neox(
    cos_sin: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin [T, D] (cos half | sin half); query [T, Hq * D], key [T, Hkv * D] -> rotated,
    same shapes. The torch code of the rotation, which the torch attention backends run inside
    the attention op; on CUDA ``kernels/rope_kv_write.py`` does the same with the same rounding."""
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, D / 2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D / 2]: broadcast over heads
    head_dim = cos_sin.shape[-1]
    return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    # Split the last dimension only: the token count may be an unbacked compile-time size.
    x1, x2 = x.unflatten(-1, (-1, head_dim)).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.flatten(-2)


def get_rope(
    head_dim: int,
    max_position: int,
    rope_parameters: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
) -> RotaryEmbedding:
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters: partial_rotary_factor != 1 is not supported")
    inv_freq = rope_inv_freq(head_dim, rope_parameters)
    return RotaryEmbedding(head_dim, max_position, inv_freq, dtype, device)
