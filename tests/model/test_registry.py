"""Architecture lookup and the features the registry refuses."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve.model.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedserve.model.registry import get_model_class

SMALL = dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=1024)


@pytest.mark.parametrize(
    ("config", "cls"),
    [
        (LlamaConfig(architectures=["LlamaForCausalLM"], **SMALL), LlamaForCausalLM),
        (
            MistralConfig(architectures=["MistralForCausalLM"], sliding_window=None, **SMALL),
            MistralForCausalLM,
        ),
        (Qwen2Config(architectures=["Qwen2ForCausalLM"], **SMALL), Qwen2ForCausalLM),
        (Qwen3Config(architectures=["Qwen3ForCausalLM"], **SMALL), Qwen3ForCausalLM),
    ],
)
def test_known_architectures(config, cls) -> None:
    assert get_model_class(config) is cls


def test_unknown_architecture_lists_supported() -> None:
    config = LlamaConfig(architectures=["GPT2LMHeadModel"], **SMALL)
    with pytest.raises(
        ValueError,
        match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        get_model_class(config)


def test_missing_architectures() -> None:
    with pytest.raises(ValueError, match="'architectures' is missing"):
        get_model_class(LlamaConfig(**SMALL))


def test_sliding_window_smaller_than_context_is_refused() -> None:
    config = MistralConfig(architectures=["MistralForCausalLM"], sliding_window=256, **SMALL)
    with pytest.raises(ValueError, match="sliding_window=256 .* not supported yet"):
        get_model_class(config)
    qwen = Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        use_sliding_window=True,
        sliding_window=128,
        max_window_layers=0,
        **SMALL,
    )
    with pytest.raises(ValueError, match="sliding-window attention is not supported yet"):
        get_model_class(qwen)


def test_window_covering_the_context_is_full_attention() -> None:
    config = MistralConfig(architectures=["MistralForCausalLM"], sliding_window=1024, **SMALL)
    assert get_model_class(config) is MistralForCausalLM
