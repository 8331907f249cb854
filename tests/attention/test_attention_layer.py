"""The Attention layer: lookup by layer name in the forward context, cache binding helpers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.attention.backends.base import PAD_SLOT_ID, AttentionMetadata
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.forward_context import ForwardContext, set_forward_context
from pagedserve.attention.layer import Attention, attention_layers, bind_kv_caches
from pagedserve.layers.rotary import get_rope, rotate_neox
from pagedserve.model.llama import LlamaForCausalLM

NAME = "model.layers.0.self_attn.attn"


def _metadata() -> AttentionMetadata:
    """One request: 3 new tokens at positions 0..2 in block 1 (block_size 4), one padding row."""
    return AttentionMetadata(
        num_reqs=1,
        num_actual_tokens=3,
        max_query_len=3,
        max_seq_len=3,
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6, PAD_SLOT_ID], dtype=torch.int64),
    )


def test_forward_rotates_writes_cache_and_attends() -> None:
    layer = Attention(num_heads=4, head_dim=8, scale=0.3, num_kv_heads=2, layer_name=NAME)
    kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks=3, block_size=4))
    bind_kv_caches(layer, {NAME: kv_cache}, TorchRefBackend())
    q, k, v = torch.randn(4, 32), torch.randn(4, 16), torch.randn(4, 16)
    rope = get_rope(8, 16, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32,
                    torch.device("cpu"))  # fmt: skip
    cos_sin = rope.cos_sin(torch.tensor([0, 1, 2, 0]))  # [4, 8]; the last row is padding
    metadata = _metadata()
    ctx = ForwardContext(
        {NAME: metadata}, {NAME: metadata.slot_mapping}, num_tokens=4, attn_layers={NAME: layer}
    )
    with set_forward_context(ctx):
        out = layer(q, k, v, cos_sin)

    assert out.shape == (4, 32)
    q, k = rotate_neox(cos_sin, q, k)  # the cache and the attention see rotated keys
    assert not torch.equal(k[1:3], torch.zeros(2, 16)) and q.shape == (4, 32)
    torch.testing.assert_close(kv_cache[0, 1, :3], k[:3].view(3, 2, 8))
    torch.testing.assert_close(kv_cache[1, 1, :3], v[:3].view(3, 2, 8))
    assert not kv_cache[:, 1, 3].any() and not kv_cache[:, [0, 2]].any()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:3].view(3, 4, 8).transpose(0, 1),
        k[:3].view(3, 2, 8).transpose(0, 1),
        v[:3].view(3, 2, 8).transpose(0, 1),
        is_causal=True,
        scale=0.3,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out[:3].view(3, 4, 8), expected)


def test_forward_needs_context_and_cache() -> None:
    layer = Attention(4, 8, 0.3, 2, NAME)
    x = torch.randn(1, 32)
    with pytest.raises(RuntimeError, match="no forward context"):
        layer(x, x[:, :16], x[:, :16], x[:, :8])
    metadata = _metadata()
    ctx = ForwardContext({NAME: metadata}, {NAME: metadata.slot_mapping}, num_tokens=1)
    with set_forward_context(ctx), pytest.raises(RuntimeError, match="not in the forward context"):
        layer(x, x[:, :16], x[:, :16], x[:, :8])
    ctx.attn_layers[NAME] = layer
    with set_forward_context(ctx), pytest.raises(RuntimeError, match="no KV cache bound"):
        layer(x, x[:, :16], x[:, :16], x[:, :8])


def test_bind_kv_caches_errors() -> None:
    layer = Attention(4, 8, 0.3, 2, NAME)
    with pytest.raises(ValueError, match=r"missing layers \['model.layers.0.self_attn.attn'\]"):
        bind_kv_caches(layer, {}, TorchRefBackend())
    with pytest.raises(ValueError, match=r"unknown layers \['other'\]"):
        bind_kv_caches(
            layer,
            {NAME: torch.zeros(layer.kv_cache_shape(2, 4)), "other": torch.zeros(1)},
            TorchRefBackend(),
        )
    with pytest.raises(ValueError, match=r"expected shape \[2, num_blocks, block_size, 2, 8\]"):
        bind_kv_caches(layer, {NAME: torch.zeros(2, 2, 4, 2, 16)}, TorchRefBackend())
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        Attention(4, 8, 0.3, 3, NAME)


def test_model_layer_names_are_module_paths() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    layers = attention_layers(model)
    assert list(layers) == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    paths = {module: path for path, module in model.named_modules()}
    assert all(paths[layer] == name for name, layer in layers.items())
