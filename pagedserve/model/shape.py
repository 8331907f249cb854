"""The shape of a dense decoder (Llama family): the sizes that set its FLOPs and bytes.

With L layers, hidden h, q heads H, kv heads K, head dim d, ffn f and vocab V, the weights
that multiply each token are
    P_layer  = h*(H*d + 2*K*d) + H*d*h + 3*h*f      (QKV, o_proj, gate/up, down)
    P_matmul = L * P_layer + V*h                     (plus the LM head)
so a token costs 2 * P_matmul matmul FLOPs. Used by the rooflines
(``entrypoints/bench/roofline.py``) and by the model runner's choice of graphs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2

    @staticmethod
    def from_hf_config(cfg, dtype_bytes: int = 2) -> ModelShape:  # noqa: ANN001
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return ModelShape(
            cfg.num_hidden_layers, cfg.hidden_size, heads,
            getattr(cfg, "num_key_value_heads", None) or heads, head_dim,
            cfg.intermediate_size, cfg.vocab_size, dtype_bytes,
        )  # fmt: skip

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that multiply a token: QKV, o_proj, gate/up, down."""
        h, d = self.hidden, self.head_dim
        return h * (self.num_heads * d + 2 * self.num_kv_heads * d) + self.num_heads * d * h \
            + 3 * h * self.ffn

    @property
    def matmul_params(self) -> int:
        """All weights that multiply a token: the layers' and the LM head's."""
        return self.num_layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass must read: the matmul weights (the embedding rows read per
        token and the norms are negligible)."""
        return self.matmul_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, context: float) -> float:
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * context
