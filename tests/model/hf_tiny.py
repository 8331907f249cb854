"""Tiny random Hugging Face models of each supported architecture (tests only)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagedserve.distributed.parallel_state import SINGLE_RANK
from pagedserve.layers.linear import UNQUANTIZED, LinearMethod, finish_loading
from pagedserve.model.llama import LlamaForCausalLM as OurLlama
from pagedserve.model.registry import get_model_class

BASE = dict(
    vocab_size=200,  # not a multiple of 64: exercises the padded vocabulary
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # wide logits: no near-ties for greedy decoding to trip on
    bos_token_id=None,
    eos_token_id=None,  # generate never stops early
    pad_token_id=None,
)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,  # short, so the tiny head_dim has scaled frequencies
)

CASES: dict[str, tuple[type[PreTrainedModel], PretrainedConfig]] = {
    "llama": (LlamaForCausalLM, LlamaConfig(**BASE)),
    "llama_head_dim_bias": (
        LlamaForCausalLM,
        LlamaConfig(**BASE, head_dim=24, attention_bias=True, mlp_bias=True),
    ),
    "llama3_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_parameters=LLAMA3_ROPE)),
    "llama_tied": (LlamaForCausalLM, LlamaConfig(**BASE, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**BASE, sliding_window=None)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**BASE, head_dim=16, tie_word_embeddings=True)),
}


def make_hf_model(case: str, seed: int = 0) -> PreTrainedModel:
    model_cls, shared_config = CASES[case]
    config = copy.deepcopy(shared_config)  # tests may edit it
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    return model_cls(config).eval()


def our_tiny_model(case: str, folder: Path, dtype: torch.dtype = torch.float32,
                   linear_method: LinearMethod = UNQUANTIZED,
                   **overrides: object) -> OurLlama:
    """Our model of a tiny case, with ``overrides`` set on its config before it is built,
    loaded from the checkpoint of transformers' model of it (saved in ``folder``)."""
    model_cls, config = CASES[case]
    config = copy.deepcopy(config)
    for name, value in overrides.items():
        setattr(config, name, value)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    hf_model = model_cls(config).eval()
    ours = get_model_class(config)(config, dtype, torch.device("cpu"), SINGLE_RANK,
                                   linear_method)
    ours.load_weights(saved_checkpoint(hf_model, folder).items())
    finish_loading(ours)
    return ours


def saved_checkpoint(model: PreTrainedModel, folder: Path) -> dict[str, torch.Tensor]:
    """Save with ``save_pretrained`` and read the tensors back by their on-disk names."""
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")
