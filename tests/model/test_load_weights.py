"""load_weights: fused mapping, ignored tensors, and errors that name the tensor."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.model.llama import LlamaForCausalLM
from tests.model.hf_tiny import make_hf_model


def _ours(config) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, torch.float32, torch.device("cpu"))


def _checkpoint(case: str = "llama") -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    hf = make_hf_model(case)
    return hf.config, {k: v.clone() for k, v in hf.state_dict().items()}


def test_fused_params_hold_the_checkpoint_tensors() -> None:
    config, weights = _checkpoint()
    model = _ours(config)
    model.load_weights(weights.items())
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_qkv, atol=0, rtol=0)
    mlp = model.model.layers[1].mlp
    expected_gate_up = torch.cat(
        [weights[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    )
    torch.testing.assert_close(mlp.gate_up_proj.weight, expected_gate_up, atol=0, rtol=0)


def test_rotary_buffers_and_tied_head_copy_are_skipped() -> None:
    config, weights = _checkpoint("llama_tied")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    assert "lm_head.weight" in weights  # the state dict repeats the tied tensor
    model = _ours(config)
    loaded = model.load_weights(weights.items())
    assert "lm_head.weight" not in loaded and model.lm_head is model.model.embed_tokens


def test_unknown_tensor_is_named() -> None:
    config, weights = _checkpoint()
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match="'model.layers.0.self_attn.extra.weight' matches no parameter"
    ):
        _ours(config).load_weights(weights.items())


def test_shape_mismatch_is_named() -> None:
    config, weights = _checkpoint()
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(31, 64)
    with pytest.raises(
        ValueError,
        match=r"'model.layers.1.self_attn.k_proj.weight' -> model.layers.1.self_attn.qkv_proj.weight: "
        r"expected a tensor of shape \(32, 64\), got \(31, 64\)",
    ):
        _ours(config).load_weights(weights.items())


def test_missing_tensors_are_listed() -> None:
    config, weights = _checkpoint()
    del weights["model.layers.0.self_attn.v_proj.weight"]
    del weights["model.norm.weight"]
    with pytest.raises(
        ValueError,
        match=r"no tensor for: model.layers.0.self_attn.qkv_proj.weight\[v\], model.norm.weight",
    ):
        _ours(config).load_weights(weights.items())


def test_unsupported_config_values() -> None:
    config, _ = _checkpoint()
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act: 'gelu' is not supported"):
        _ours(config)
