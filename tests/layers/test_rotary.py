"""Rotary embedding against transformers: inverse frequencies per rope type, and the rotation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.layers.rotary import get_rope, rope_inv_freq, rope_parameters_from_hf_config

HEAD_DIM = 16
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("rope_type", sorted(ROPE_CASES))
def test_inv_freq_matches_hf(rope_type: str) -> None:
    config = _hf_config(ROPE_CASES[rope_type])
    if rope_type == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    ours = rope_inv_freq(HEAD_DIM, rope_parameters_from_hf_config(config))
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("rope_type", sorted(ROPE_CASES))
def test_rotation_matches_apply_rotary_pos_emb(rope_type: str) -> None:
    config = _hf_config(ROPE_CASES[rope_type])
    rope = get_rope(
        HEAD_DIM, 512, rope_parameters_from_hf_config(config), torch.float32, torch.device("cpu")
    )
    positions = torch.tensor([0, 7, 3, 500, 64, 65, 1])  # unsorted, several requests
    q, k = torch.randn(7, 4 * HEAD_DIM), torch.randn(7, 2 * HEAD_DIM)
    q_ours, k_ours = rope(positions, q, k)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.view(1, 7, 4, HEAD_DIM), k.view(1, 7, 2, HEAD_DIM), cos, sin, unsqueeze_dim=2
    )
    torch.testing.assert_close(q_ours, q_hf.reshape(7, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_hf.reshape(7, -1), atol=1e-5, rtol=1e-5)


def test_legacy_rope_scaling_fields() -> None:
    """Configs from before transformers 5: rope_theta and rope_scaling (with 'type') at top level."""
    legacy = SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        max_position_embeddings=2048,
    )
    params = rope_parameters_from_hf_config(legacy)
    assert params["rope_type"] == "llama3"
    assert params["rope_theta"] == 500000.0
    assert params["original_max_position_embeddings"] == 2048
    plain = rope_parameters_from_hf_config(
        SimpleNamespace(rope_theta=1e6, max_position_embeddings=8)
    )
    assert plain == {"rope_theta": 1e6, "rope_type": "default"}


def test_unsupported_rope() -> None:
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        rope_inv_freq(HEAD_DIM, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        get_rope(
            HEAD_DIM,
            8,
            {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
            torch.float32,
            torch.device("cpu"),
        )
