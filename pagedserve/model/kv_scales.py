"""The FP8 KV-cache scales an FP8 checkpoint carries, onto the attention layers.

A cache element is ``value / scale`` (``attention/kv_quant.py``), one scale for the keys and
one for the values of each layer. Checkpoints name them in several ways, all per layer
``model.layers.N.self_attn``:

- ``.k_scale`` / ``.v_scale`` (vLLM's fp8 and compressed-tensors' ``kv_cache_scheme``), also
  below ``.attn``;
- ``.k_proj.k_scale`` / ``.v_proj.v_scale`` (ModelOpt);
- ``.k_proj.output_scale`` / ``.v_proj.output_scale`` (older compressed-tensors);
- ``.kv_scale`` (older: one scale for both).

Only a scale per tensor is supported (one value; a per-head scale is refused by name). A layer
without scales in the checkpoint keeps 1.0 (``UNIT_KV_SCALES``), which holds the values as they
are, saturating beyond +-448, unless ``calculate_kv_scales`` has the first step with tokens
compute them (``worker/kv_cache.arm_kv_calibration``). Scales load whatever ``kv_cache_dtype``
is; a cache in the model's dtype ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from pagedserve.attention.backends.base import KVScales
from pagedserve.attention.layer import Attention

_KV_SCALE_NAME = re.compile(
    r"^(?P<block>.+\.self_attn)\."
    r"(?:(?:attn\.)?(?P<which>k|v|kv)_scale|k_proj\.(?:k|output)_scale(?P<k>)"
    r"|v_proj\.(?:v|output)_scale(?P<v>))$"
)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(attention layer name, ``k`` / ``v`` / ``kv``) of a checkpoint's KV-cache scale; None
    for any other tensor."""
    match = _KV_SCALE_NAME.match(name)
    if match is None:
        return None
    which = match["which"] or ("k" if match["k"] is not None else "v")
    return f"{match['block']}.attn", which


class CheckpointKVScales:
    """Takes the KV-cache scales out of a checkpoint stream (``divert``), then sets them on the
    model's attention layers (``apply``)."""

    def __init__(self) -> None:
        self.scales: dict[str, dict[str, float]] = {}  # layer name -> {"k": ..., "v": ...}

    def divert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without the KV-cache scales, which are kept here."""
        for name, tensor in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, tensor
                continue
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r}: {tensor.numel()} KV-cache scales, "
                                 "only one per tensor is supported")
            value = float(tensor.float().item())
            if not value > 0.0:
                raise ValueError(f"checkpoint tensor {name!r}: KV-cache scale {value} must be > 0")
            layer, which = target
            for part in which:  # "kv": both
                self.scales.setdefault(layer, {})[part] = value

    def apply(self, layers: dict[str, Attention]) -> None:
        """Each layer with scales in the checkpoint gets them (a missing half stays 1.0)."""
        unknown = sorted(set(self.scales) - set(layers))
        if unknown:
            raise ValueError(f"checkpoint KV-cache scales for unknown layers: {unknown[:3]}")
        for name, found in self.scales.items():
            layers[name].kv_scales = KVScales(found.get("k", 1.0), found.get("v", 1.0))
