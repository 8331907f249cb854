"""ModelShape's weight counts against a real transformers model's parameters."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pagedserve.model.shape import ModelShape

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _linear_params(module) -> int:  # noqa: ANN001
    return sum(p.numel() for name, p in module.named_parameters()
               if name.endswith("proj.weight") or name == "lm_head.weight")


@pytest.mark.parametrize("model_cls,config,head_dim", [
    (LlamaForCausalLM, LlamaConfig(**SMALL), 8),  # hidden / heads
    (Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=16), 16),  # its own head_dim
])
def test_matmul_params_count_the_linear_layers_and_lm_head(model_cls, config,  # noqa: ANN001
                                                           head_dim: int) -> None:
    model = model_cls(config)
    shape = ModelShape.from_hf_config(config)
    assert shape.head_dim == head_dim
    assert shape.layer_matmul_params == _linear_params(model.model.layers[0])
    assert shape.matmul_params == _linear_params(model)
