"""The forward of a one-token step (a decode at batch 1) on the fused GEMV kernels.

A decode step of one token reads every weight once and does almost nothing else, so its time
is the weight read plus the launches around it. The compiled forward spends about 19 kernels
per Llama layer; this one spends six: ``kernels/gemv.py``'s RMSNorm + QKV + rotary + KV write,
the attention backend's decode (split-KV and its reduce: two), o_proj + residual, RMSNorm +
gate/up + SiLU-and-mul, and down_proj + residual. The same weights, cache and attention
metadata as the compiled forward; the runner's FULL graph of size 1 captures this forward
instead of the compiled one (``CompiledForward``).

It re-implements one decoder layer, so it serves only the layer types it was written for: a
model declares them (``one_token_layers`` in ``model/llama.py``), and a layer of another class
(an MLP or attention subclass) leaves the model on the compiled forward.

FP8 weights (both FP8 linear methods) are read as they are stored, half the bytes, each output
row times its scale; the activations stay in the compute dtype (the compiled forward's FP8
GEMMs quantize them per token, so the two agree to FP8 rounding of the activations). An FP8
KV cache is written by the QKV kernel with the layer's k/v scales and read by the attention
backend, as in the compiled forward.

Residual stream: the compiled forward carries (sublayer output, residual) and adds them in the
next norm; here the residual add happens in the epilogue of o_proj and down_proj, so ``h``
below is always the full residual stream.
"""

from __future__ import annotations

import logging
from typing import cast

import torch

from pagedserve.attention.forward_context import ForwardContext, get_forward_context
from pagedserve.kernels import gemv
from pagedserve.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8OnlineLinearMethod
from pagedserve.model.llama import (
    LayerTypes,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    foreign_linear,
    head_dim_of,
)

logger = logging.getLogger(__name__)


GEMV_LINEAR_METHODS = (UnquantizedLinearMethod, Fp8LinearMethod, Fp8OnlineLinearMethod)
"""Linear methods whose weights the kernels read: the compute dtype, or FP8 with a scale per
output row (the ``weight_scale`` buffer of both FP8 methods)."""


def _weight_scale(linear: LinearBase) -> torch.Tensor | None:
    """fp32 [N] of a layer with FP8 weights; None for weights in the compute dtype."""
    if isinstance(linear.linear_method, UnquantizedLinearMethod):
        return None
    return linear.get_buffer("weight_scale")


def unsupported_reason(model: LlamaForCausalLM, types: LayerTypes) -> str | None:
    """Why ``model`` cannot run on these kernels with the layer types it declares (None: it
    can)."""
    foreign = foreign_linear(model, GEMV_LINEAR_METHODS)
    if foreign is not None:
        return foreign
    if model.tp.size != 1:
        return "tensor parallelism (o_proj and down_proj need an all-reduce before the residual)"
    for layer in model.model.layers:
        part = types.foreign_part(layer)
        if part is not None:
            return f"{part}, the type the fused kernels were written for"
    head_dim = head_dim_of(model.config)
    first = cast(LlamaDecoderLayer, model.model.layers[0])  # checked above
    qkv_dtype = first.self_attn.qkv_proj.weight.dtype
    if head_dim // 2 % gemv.tile_config(int(gemv.EPILOGUE_ROPE_KV), qkv_dtype).block_n:
        return f"head_dim {head_dim}: half of it must be a multiple of the tile"
    return None


def gemv_decode_forward(model: LlamaForCausalLM, types: LayerTypes) -> GemvDecodeForward | None:
    """The one-token forward of ``model`` on these kernels; None (logged with the reason) where
    the model does not fit them, so the compiled forward serves its one-token steps."""
    reason = unsupported_reason(model, types)
    if reason is not None:
        logger.info("one-token steps run the compiled forward: %s", reason)
        return None
    return GemvDecodeForward(model, types)


class GemvDecodeForward:
    """``(input_ids [1], positions [1]) -> hidden_states [1, hidden]`` of a one-token step.

    Reads the step's slot mapping and attention metadata from the forward context, as the
    attention layers of the compiled forward do."""

    def __init__(self, model: LlamaForCausalLM, types: LayerTypes) -> None:
        reason = unsupported_reason(model, types)
        if reason is not None:
            raise ValueError(f"GemvDecodeForward: {reason}")
        self.model = model.model
        # unsupported_reason checked every layer's classes against ``types``
        self.layers = cast(list[LlamaDecoderLayer], list(self.model.layers))
        self.cos_sin_cache = self.model.rotary_emb.cos_sin_cache  # [max_position, head_dim]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: one token per step, got {input_ids.shape[0]}")
        ctx = get_forward_context()
        h = self.model.embed_tokens(input_ids)  # [1, hidden]: the residual stream
        for layer in self.layers:
            h = self._layer(layer, ctx, positions, h)
        return self.model.norm(h)

    def _layer(self, layer: LlamaDecoderLayer, ctx: ForwardContext, positions: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor:
        attn_block, mlp = layer.self_attn, layer.mlp
        attn = attn_block.attn
        if attn.kv_cache is None:
            raise RuntimeError(f"{attn.layer_name}: no KV cache bound")
        norm, qkv = layer.input_layernorm, attn_block.qkv_proj
        q = gemv.rmsnorm_qkv_rope_kv_write(
            h, norm.weight, norm.eps, qkv.weight, qkv.bias, self.cos_sin_cache, positions,
            ctx.slot_mapping[attn.layer_name], attn.kv_cache, attn.num_heads,
            weight_scale=_weight_scale(qkv), k_scale=attn.kv_scales.k,
            v_scale=attn.kv_scales.v)  # [1, Hq * D]
        out = torch.empty_like(q)  # [1, Hq * D]
        heads = (1, attn.num_heads, attn.head_dim)
        attn.backend.forward(q.view(heads), attn.kv_cache, ctx.attn_metadata[attn.layer_name],
                             attn.scale, out.view(heads), attn.kv_scales)
        o_proj = attn_block.o_proj
        h = gemv.linear_row(out, o_proj.weight, o_proj.bias, residual=h,
                            weight_scale=_weight_scale(o_proj))
        norm, gate_up = layer.post_attention_layernorm, mlp.gate_up_proj
        act = gemv.rmsnorm_gate_up_silu(h, norm.weight, norm.eps, gate_up.weight, gate_up.bias,
                                        weight_scale=_weight_scale(gate_up))  # [1, I]
        down = mlp.down_proj
        return gemv.linear_row(act, down.weight, down.bias, residual=h,
                               weight_scale=_weight_scale(down))
