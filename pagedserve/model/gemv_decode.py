"""The forward of a one-token step (a decode at batch 1) on the fused GEMV kernels.

A decode step of one token reads every weight once and does almost nothing else, so its time
is the weight read plus the launches around it. The compiled forward spends ~19 kernels per
Llama layer (measured on an H200: 4.90-5.05 ms a step against a 3.56 ms floor); this one
spends six: ``kernels/gemv.py``'s RMSNorm + QKV + rotary + KV write, the attention backend's
decode (split-KV and its reduce: two), o_proj + residual, RMSNorm + gate/up + SiLU-and-mul,
and down_proj + residual. The same weights, cache and attention metadata as the compiled
forward; the runner's FULL graph of size 1 captures this forward instead of the compiled one
(``CompiledForward``).

Residual stream: the compiled forward carries (sublayer output, residual) and adds them in the
next norm; here the residual add happens in the epilogue of o_proj and down_proj, so ``h``
below is always the full residual stream.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.forward_context import ForwardContext, get_forward_context
from pagedserve.kernels import gemv
from pagedserve.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on these kernels (None: it can)."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    if model.tp.size != 1:
        return "tensor parallelism (o_proj and down_proj need an all-reduce before the residual)"
    attn = model.model.layers[0].self_attn
    if type(attn).normalize_qk is not LlamaAttention.normalize_qk:
        return f"{type(attn).__name__} normalizes q/k per head before rotary embedding"
    if attn.head_dim // 2 % gemv.DEFAULT_CONFIGS[int(gemv.EPILOGUE_ROPE_KV)].block_n:
        return f"head_dim {attn.head_dim}: half of it must be a multiple of the tile"
    return None


class GemvDecodeForward:
    """``(input_ids [1], positions [1]) -> hidden_states [1, hidden]`` of a one-token step.

    Reads the step's slot mapping and attention metadata from the forward context, as the
    attention layers of the compiled forward do."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"GemvDecodeForward: {reason}")
        self.model = model.model
        self.cos_sin_cache = self.model.rotary_emb.cos_sin_cache  # [max_position, head_dim]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: one token per step, got {input_ids.shape[0]}")
        ctx = get_forward_context()
        h = self.model.embed_tokens(input_ids)  # [1, hidden]: the residual stream
        for layer in self.model.layers:
            h = self._layer(layer, ctx, positions, h)
        return self.model.norm(h)

    def _layer(self, layer: LlamaDecoderLayer, ctx: ForwardContext, positions: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor:
        attn_block, mlp = layer.self_attn, layer.mlp
        attn = attn_block.attn
        if attn.kv_cache is None:
            raise RuntimeError(f"{attn.layer_name}: no KV cache bound")
        norm = layer.input_layernorm
        q = gemv.rmsnorm_qkv_rope_kv_write(
            h, norm.weight, norm.eps, attn_block.qkv_proj.weight,
            attn_block.qkv_proj.bias, self.cos_sin_cache, positions,
            ctx.slot_mapping[attn.layer_name], attn.kv_cache, attn.num_heads)  # [1, Hq * D]
        out = torch.empty_like(q)  # [1, Hq * D]
        heads = (1, attn.num_heads, attn.head_dim)
        attn.backend.forward(q.view(heads), attn.kv_cache, ctx.attn_metadata[attn.layer_name],
                             attn.scale, out.view(heads))
        o_proj = attn_block.o_proj
        h = gemv.linear_row(out, o_proj.weight, o_proj.bias, residual=h)
        norm = layer.post_attention_layernorm
        act = gemv.rmsnorm_gate_up_silu(h, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                        mlp.gate_up_proj.bias)  # [1, I]
        down = mlp.down_proj
        return gemv.linear_row(act, down.weight, down.bias, residual=h)
