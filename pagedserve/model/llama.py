"""Llama-family decoder (Llama 2 / 3 / 3.1, Mistral; Qwen2 / Qwen3 in ``qwen.py``).

``forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]`` over a flat batch of
tokens; per-step batch layout (which rows belong to which request, where their keys live)
comes from the forward context, read by each ``Attention`` layer. ``compute_logits`` is
separate so the runner computes logits only for the rows that need them.

Variations hook in through ``attention_cls`` (a subclass of ``LlamaAttention``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedserve.attention.layer import Attention, attention_layers
from pagedserve.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.linear import (
    UNQUANTIZED,
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.layers.logits import LogitsProcessor
from pagedserve.layers.quantization.fp8_activations import (
    PLAIN_INPUT_LAYERS,
    Fp8RMSNorm,
    InputLayers,
)
from pagedserve.layers.rotary import get_rope, rope_parameters_from_hf_config
from pagedserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.model.kv_scales import CheckpointKVScales
from pagedserve.model.weight_mapping import load_checkpoint_weights

# Non-parameter tensors that some checkpoints carry (KV-cache scales go to the attention
# layers: model/kv_scales.py).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def head_dim_of(hf_config: Any) -> int:
    """Explicit ``head_dim`` when the config has one, else hidden_size / num_attention_heads."""
    return (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def num_kv_heads_of(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def input_layers(linear_method: LinearMethod) -> InputLayers:
    """The norm and activation classes whose outputs ``linear_method``'s layers read: FP8
    linear methods name theirs (FP8-writing ones before per-token FP8 GEMMs); the plain ones
    otherwise."""
    return getattr(linear_method, "input_layers", PLAIN_INPUT_LAYERS)


class LlamaMLP(nn.Module):
    """gate/up split by columns (each rank holds ``intermediate_size / tp`` of both), down by
    rows: one all-reduce per MLP."""

    def __init__(
        self, hf_config: Any, dtype: torch.dtype, device: torch.device, tp: TensorParallelGroup,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act: {hf_config.hidden_act!r} is not supported (only silu)")
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        bias = getattr(hf_config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias, dtype, device, tp.rank, tp.size, linear_method
        )
        self.act_fn = input_layers(linear_method).activation(device)
        self.down_proj = RowParallelLinear(
            inter, hidden, bias, dtype, device, tp.rank, tp.size, tp.all_reduce, linear_method
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Query heads split over the ranks (KV heads too, or replicated when there are fewer KV
    heads than ranks); o_proj is row-parallel: one all-reduce per attention block."""

    def __init__(
        self,
        hf_config: Any,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        num_heads, num_kv_heads = hf_config.num_attention_heads, num_kv_heads_of(hf_config)
        head_dim = head_dim_of(hf_config)
        qkv_bias, o_bias = self.projection_biases(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, qkv_bias, dtype, device, tp.rank, tp.size,
            linear_method,
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden, o_bias, dtype, device, tp.rank, tp.size, tp.all_reduce,
            linear_method,
        )
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.attn = Attention(
            self.qkv_proj.num_heads_per_rank,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads_per_rank,
            f"{prefix}.attn",
        )

    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before rope (Qwen3 normalizes each head here); Llama leaves q and k as they are."""
        return query, key

    def forward(self, cos_sin: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """cos_sin [T, head_dim] (the rotary cos | sin of each token's position)."""
        qkv = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.normalize_qk(q, k)
        return self.o_proj(self.attn(q, k, v, cos_sin))  # rotary embedding in the attention op


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attention_cls: type[LlamaAttention],
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = attention_cls(
            hf_config, f"{prefix}.self_attn", dtype, device, tp, linear_method
        )
        self.mlp = LlamaMLP(hf_config, dtype, device, tp, linear_method)
        norm = input_layers(linear_method).norm  # its output goes to qkv_proj / gate_up_proj
        self.input_layernorm = norm(hidden, eps, dtype, device)
        self.post_attention_layernorm = norm(hidden, eps, dtype, device)

    def forward(
        self, cos_sin: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sublayer output, residual stream); the caller adds them in the next norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attention_cls: type[LlamaAttention],
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hidden, dtype, device, tp.rank, tp.size, tp.all_reduce
        )
        rope_parameters = rope_parameters_from_hf_config(hf_config)
        # One rotary module (one cos/sin cache); its cos | sin rows go to every attention op.
        self.rotary_emb = get_rope(
            head_dim_of(hf_config),
            hf_config.max_position_embeddings,
            rope_parameters,
            dtype,
            device,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config, attention_cls, f"{prefix}.layers.{i}", dtype, device, tp, linear_method
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rotary_emb.cos_sin(positions)  # [T, head_dim]: once for all layers
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(cos_sin, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LayerTypes(NamedTuple):
    """The exact classes of a decoder layer and its parts (the fused one-token forward
    re-implements the layer, so it serves only the classes it was written for)."""

    decoder_layer: type[nn.Module]
    attention: type[nn.Module]
    mlp: type[nn.Module]
    norm: tuple[type[nn.Module], ...]
    """Either norm: the one-token forward reads its weight and eps, not its output."""

    def foreign_part(self, layer: nn.Module) -> str | None:
        """The first part of ``layer`` whose class is not exactly one of these, as "MLP
        GatedGeluMLP is not LlamaMLP"; None where every part is."""
        parts = (("decoder layer", layer, (self.decoder_layer,)),
                 ("attention", getattr(layer, "self_attn", None), (self.attention,)),
                 ("MLP", getattr(layer, "mlp", None), (self.mlp,)),
                 ("input_layernorm", getattr(layer, "input_layernorm", None), self.norm),
                 ("post_attention_layernorm", getattr(layer, "post_attention_layernorm", None),
                  self.norm))
        for what, module, expected in parts:
            if type(module) not in expected:
                names = " or ".join(t.__name__ for t in expected)
                return f"{what} {type(module).__name__} is not {names}"
        return None


def foreign_linear(model: nn.Module, methods: tuple[type[LinearMethod], ...]) -> str | None:
    """The first linear layer whose weights are not of one of ``methods``, as "NAME has
    METHOD weights"; None where every one's are."""
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(module.linear_method, methods):
            return f"{name} has {type(module.linear_method).__name__} weights"
    return None


LLAMA_LAYERS = LayerTypes(LlamaDecoderLayer, LlamaAttention, LlamaMLP, (RMSNorm, Fp8RMSNorm))


class LlamaForCausalLM(nn.Module):
    """The causal LM; with ``tp`` of several ranks, this rank's shard of it (each rank builds
    its own, loads its slices of every weight and joins the others in the collectives)."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    one_token_layers: LayerTypes = LLAMA_LAYERS
    """The layer classes whose one-token forward this model runs on the fused GEMV kernels;
    a model whose layers are of other classes (a subclass's attention or MLP: Qwen3's q/k
    norms) gets no GEMV forward unless it declares them here."""
    cpu_decode_layers: LayerTypes = LLAMA_LAYERS
    """The same for the CPU's decode step in C (``model/cpu_decode.py``), which also knows
    Qwen2's biases and Qwen3's q/k norms."""

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup = SINGLE_RANK,
        linear_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        """``linear_method``: how the decoder's linear layers hold their weights (unquantized,
        FP8: ``model/quantization.py``); the embedding and LM head stay in ``dtype``."""
        super().__init__()
        self.config = hf_config
        self.tp = tp
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(
            hf_config, self.attention_cls, "model", dtype, device, tp, linear_method
        )
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, dtype, device,
                tp.rank, tp.size, tp.all_reduce,
            )  # fmt: skip
        # Each rank's logits cover its vocabulary slice; all_gather joins them, and the
        # processor cuts the padding off before anything samples.
        self.logits_processor = LogitsProcessor(hf_config.vocab_size, tp.size, tp.all_gather)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids int [T], positions int64 [T] -> hidden_states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] (the rows that need logits) -> [N, vocab_size]."""
        return self.logits_processor(self.lm_head, hidden_states)

    def one_token_forward(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """``(input_ids [1], positions [1]) -> hidden_states [1, hidden]`` on the fused GEMV
        kernels (``model/gemv_decode.py``; Triton, for CUDA), or None where they do not fit
        this model (its layers are not exactly ``one_token_layers``, tensor parallelism, a
        head_dim off the kernels' tile; the reason is logged): the compiled forward then
        serves one-token steps. FP8 weights are read as they are stored, with their scales."""
        from pagedserve.model.gemv_decode import gemv_decode_forward  # Triton: on use only

        return gemv_decode_forward(self, self.one_token_layers)

    def cpu_decode_forward(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """This model's forward with the steps whose requests each decode one token in C
        (``model/cpu_decode.py``; the CPU), or None where the C step does not fit it (its
        layers are not exactly ``cpu_decode_layers``, quantized weights, tensor parallelism,
        no C compiler; the reason is logged)."""
        from pagedserve.model.cpu_decode import cpu_decode_forward

        return cpu_decode_forward(self, self.cpu_decode_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face checkpoint tensors by name; returns the loaded parameter names.
        FP8 KV-cache scales go to the attention layers (``model/kv_scales.py``)."""
        kv_scales = CheckpointKVScales()
        loaded = load_checkpoint_weights(self, kv_scales.divert(weights),
                                         self._ignored_checkpoint_name)
        kv_scales.apply(attention_layers(self))
        return loaded

    def _ignored_checkpoint_name(self, name: str) -> bool:
        if name.endswith(_IGNORED_SUFFIXES):
            return True
        # A tied model reads its LM head from embed_tokens; a saved copy adds nothing.
        return self.tie_word_embeddings and name == "lm_head.weight"


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers with full attention (the registry refuses sliding windows)."""
