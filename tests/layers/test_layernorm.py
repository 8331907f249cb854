"""RMSNorm against transformers' LlamaRMSNorm; the fused residual add."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.layers.layernorm import RMSNorm


def _pair(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    weight = torch.randn(hidden)
    ours = RMSNorm(hidden, 1e-5, dtype, torch.device("cpu"))
    ours.weight.weight_loader(ours.weight, weight)
    ref = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
    return ours, ref


def test_plain_matches_hf() -> None:
    ours, ref = _pair(32, torch.float32)
    x = torch.randn(5, 32) * 3
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)


def test_fused_add_returns_normed_sum_and_sum() -> None:
    ours, ref = _pair(32, torch.float32)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ref(x + residual), atol=1e-6, rtol=1e-6)


def test_fused_add_bf16_adds_in_fp32() -> None:
    """The sum is normalized before rounding; the residual is the sum rounded once."""
    ours, _ = _pair(64, torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    residual = (torch.randn(4, 64) * 100).to(torch.bfloat16)
    normed, new_residual = ours(x, residual)
    summed = x.float() + residual.float()
    assert new_residual.dtype == torch.bfloat16
    torch.testing.assert_close(new_residual, summed.to(torch.bfloat16), atol=0, rtol=0)
    expected = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = ours.weight * expected.to(torch.bfloat16)
    torch.testing.assert_close(normed, expected, atol=0, rtol=0)


def test_per_head_shape() -> None:
    """Qwen3 normalizes [T, heads, head_dim]: each head separately."""
    ours, ref = _pair(8, torch.float32)
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
