"""The attention layer of a model: projections in, paged attention over the KV cache out.

The layer does not hold per-step data. At call time it finds its ``AttentionMetadata`` and
slot mapping in the forward context by ``layer_name`` (``model.layers.{i}.self_attn.attn``),
applies the rotary embedding to the step's queries and keys, writes the keys and values into
its ``kv_cache`` and attends over it. Rotation and cache write are one backend call so that a
GPU backend can do both in one kernel (one pass over q, k, v instead of three kernels). The
runner binds the cache tensors and the backend once with ``bind_kv_caches``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.attention.backends.base import UNIT_KV_SCALES, AttentionBackend, KVScales
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.forward_context import get_forward_context
from pagedserve.attention.kv_quant import calibrated_kv_scales

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_name: str
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{layer_name}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by bind_kv_caches.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchRefBackend()
        # Scales of an FP8 cache (the checkpoint's k_scale / v_scale, set at load; else 1.0).
        self.kv_scales: KVScales = UNIT_KV_SCALES
        # Set by the runner once start-up is over (``calculate_kv_scales``, a layer without
        # checkpoint scales): the next forward with tokens sets ``kv_scales`` from its own keys
        # and values before writing them, then clears this.
        self.calibrate_kv_scales = False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        """query [T, Hq * D], key and value [T, Hkv * D] (before rotary embedding), cos_sin
        [T, D] (each token's cos half | sin half) -> [T, Hq * D].

        Rows past the metadata's ``num_actual_tokens`` (padding) are left unwritten.
        """
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, Hq * D]
        if torch.compiler.is_compiling():  # traced: the opaque op where the graph is split
            torch.ops.pagedserve.unified_attention(
                query, key, value, cos_sin, output, self.layer_name
            )
        else:  # eager: the same body, without the custom-op dispatch (which imports dynamo)
            attention_by_name(query, key, value, cos_sin, output, self.layer_name)
        return output


@torch.library.custom_op("pagedserve::unified_attention", mutates_args=("output",))
def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """The attention call as one opaque op: torch.compile splits the model graph here, and the
    op finds its layer (cache, backend) in the forward context by name."""
    attention_by_name(query, key, value, cos_sin, output, layer_name)


@unified_attention.register_fake
def _unified_attention_fake(query, key, value, cos_sin, output, layer_name) -> None:  # noqa: ANN001
    return None


def attention_by_name(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """The op's body: the layer named in the forward context attends and writes ``output``."""
    layer = get_forward_context().attn_layers.get(layer_name)
    if not isinstance(layer, Attention):
        raise RuntimeError(f"{layer_name}: not in the forward context's attn_layers")
    paged_attention(layer, query, key, value, cos_sin, output)


def paged_attention(
    layer: Attention,
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    value: torch.Tensor,  # [T, Hkv * D]
    cos_sin: torch.Tensor,  # [T, D]
    output: torch.Tensor,  # [T, Hq * D]
) -> None:
    """The whole attention call: rotary embedding, cache write, attention."""
    if layer.kv_cache is None:
        raise RuntimeError(f"{layer.layer_name}: no KV cache bound (call bind_kv_caches first)")
    ctx = get_forward_context()
    metadata = ctx.attn_metadata[layer.layer_name]
    slot_mapping = ctx.slot_mapping[layer.layer_name]
    num_tokens = query.shape[0]
    if layer.calibrate_kv_scales and metadata.num_actual_tokens > 0:
        real = metadata.num_actual_tokens  # rows past it are padding
        layer.kv_scales = calibrated_kv_scales(key[:real], value[:real], layer.head_dim)
        layer.calibrate_kv_scales = False
        logger.debug("%s: KV scales calibrated on %d tokens: k %.4g, v %.4g", layer.layer_name,
                     real, layer.kv_scales.k, layer.kv_scales.v)
    query = layer.backend.rope_and_write_kv(
        query, key, value, cos_sin, layer.kv_cache, slot_mapping, layer.kv_scales
    )  # rotated [T, Hq * D]
    layer.backend.forward(
        query.view(num_tokens, layer.num_heads, layer.head_dim),
        layer.kv_cache,
        metadata,
        layer.scale,
        output.view(num_tokens, layer.num_heads, layer.head_dim),
        layer.kv_scales,
    )


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """layer_name -> Attention for every attention layer of the model."""
    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


def bind_kv_caches(
    model: nn.Module, kv_caches: dict[str, torch.Tensor], backend: AttentionBackend
) -> None:
    """Give each attention layer its cache tensor (by layer name) and the backend."""
    layers = attention_layers(model)
    missing = sorted(set(layers) - set(kv_caches))
    unknown = sorted(set(kv_caches) - set(layers))
    if missing or unknown:
        raise ValueError(f"kv_caches: missing layers {missing}, unknown layers {unknown}")
    for name, layer in layers.items():
        cache = kv_caches[name]
        if (
            cache.dim() != 5
            or cache.shape[0] != 2
            or cache.shape[3:] != layer.kv_cache_shape(0, 0)[3:]
        ):
            raise ValueError(
                f"kv_caches[{name!r}]: expected shape [2, num_blocks, block_size, "
                f"{layer.num_kv_heads}, {layer.head_dim}], got {list(cache.shape)}"
            )
        layer.kv_cache = cache
        layer.backend = backend
