"""Qwen2 and Qwen3: Llama with a different attention block.

Qwen2 has a bias on the q/k/v projections (none on o_proj). Qwen3 drops it (unless
``attention_bias``) and normalizes each query and key head with its own RMSNorm before rope.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.linear import LinearMethod
from pagedserve.model.llama import LLAMA_LAYERS, LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen3Attention(LlamaAttention):
    """q_norm / k_norm act on one head at a time, so every rank holds them whole."""

    def __init__(
        self,
        hf_config: Any,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__(hf_config, prefix, dtype, device, tp, linear_method)
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype, device)

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq * D], key [T, Hkv * D]: RMSNorm over each head's D values.

        Shapes split the last dimension only (never divide by T): under torch.compile the
        token count is an unbacked size, and a reshape that infers -1 from it cannot be
        traced."""
        q = self.q_norm(query.unflatten(-1, (-1, self.head_dim)))
        k = self.k_norm(key.unflatten(-1, (-1, self.head_dim)))
        return q.flatten(-2), k.flatten(-2)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
    # Llama's attention with other biases: the fused kernels take any bias.
    one_token_layers = LLAMA_LAYERS._replace(attention=Qwen2Attention)
    cpu_decode_layers = one_token_layers


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    # The CPU's C decode step applies the q/k norms; the GPU's fused kernels do not.
    cpu_decode_layers = LLAMA_LAYERS._replace(attention=Qwen3Attention)
