"""The fused rotary + KV-write kernel against the torch backend's rotation and cache write
(its reference); runs on the GPU when there is one, else under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, ON_GPU

from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.kernels.rope_kv_write import rope_and_write_kv
from pagedserve.layers.rotary import get_rope

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _case(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v as views of one fused projection output, positions' cos | sin, a cache full of a
    sentinel and slots at block edges, unordered, with padding rows."""
    slots = torch.tensor([0, 7, 8, 15, 40, 23, PAD_SLOT_ID, 2, PAD_SLOT_ID])
    num_tokens = slots.shape[0]
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes)).to(dtype)
    q, k, v = qkv.split(sizes, dim=-1)
    rope = get_rope(head_dim, 64, ROPE, dtype, torch.device("cpu"))
    cos_sin = rope.cos_sin(torch.randint(0, 64, (num_tokens,)))
    kv_cache = torch.full((2, 6, 8, num_kv_heads, head_dim), 99.0).to(dtype)
    return q, k, v, cos_sin, kv_cache, slots


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,head_dim",
    [(torch.bfloat16, 4, 2, 64), (torch.float16, 3, 1, 80), (torch.float32, 6, 3, 32),
     (torch.bfloat16, 6, 3, 80)],
)
def test_matches_the_torch_backend(dtype, num_heads, num_kv_heads, head_dim) -> None:  # noqa: ANN001
    q, k, v, cos_sin, kv_cache, slots = _case(dtype, num_heads, num_kv_heads, head_dim)
    want_cache = kv_cache.clone()
    want_q = TorchRefBackend().rope_and_write_kv(q, k, v, cos_sin, want_cache, slots)
    cache = kv_cache.to(DEVICE)
    on = [t.to(DEVICE) for t in (q, k, v, cos_sin)]
    got_q = rope_and_write_kv(*on, cache, slots.to(DEVICE))
    # Same roundings as the eager torch code: equal under the interpreter. The GPU compile
    # may differ by one rounding step.
    tol = 0 if not ON_GPU else {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got_q.cpu(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(cache.cpu(), want_cache, atol=tol, rtol=tol)
    assert (cache.cpu()[:, 0, 1] == 99.0).all()  # padding rows and unused slots untouched


def test_uses_only_the_first_num_tokens_slots() -> None:
    """The slot mapping may be a longer persistent buffer: entries past the step's tokens are
    not read."""
    q, k, v, cos_sin, kv_cache, _ = _case(torch.float32, 2, 1, 16)
    slots = torch.tensor([5, 1, 3, 6, 9, 10, 11, 12, 13, 14, 15])  # 9 tokens, 11 slots
    want_cache = kv_cache.clone()
    TorchRefBackend().rope_and_write_kv(q, k, v, cos_sin, want_cache, slots[: q.shape[0]])
    cache = kv_cache.to(DEVICE)
    rope_and_write_kv(*(t.to(DEVICE) for t in (q, k, v, cos_sin)), cache, slots.to(DEVICE))
    tol = 1e-6 if ON_GPU else 0
    torch.testing.assert_close(cache.cpu(), want_cache, atol=tol, rtol=tol)
    assert (cache.cpu().view(2, -1, 1, 16)[:, [14, 15]] == 99.0).all()


def test_rejects_mismatched_inputs() -> None:
    q, k, v, cos_sin, kv_cache, slots = _case(torch.float32, 2, 1, 16)
    with pytest.raises(ValueError, match="key/value"):
        rope_and_write_kv(q, k[:, :8], v, cos_sin, kv_cache, slots)
    with pytest.raises(ValueError, match="cos_sin"):
        rope_and_write_kv(q, k, v, cos_sin[:, :8], kv_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        rope_and_write_kv(q.half(), k, v, cos_sin, kv_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_write_kv(q, k, v, cos_sin, kv_cache, slots[:3])
