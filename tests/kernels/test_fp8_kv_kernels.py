"""The FP8 KV cache in the Triton kernels against the torch reference: the fused rotary + KV
write and the GEMV QKV kernel quantize as ``attention/kv_quant.py`` does, and the paged
attention kernels read an FP8 cache as TorchRefBackend does (which dequantizes it first).
Runs under the interpreter in CI; on a GPU with ``TRITON_INTERPRET=0`` compiled on the card."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE, ON_GPU
from paged_kv_cases import SENTINEL, batch_on, make_paged_batch, write_step_kv

from pagedserve.attention.backends.base import FP8_KV_DTYPE, PAD_SLOT_ID, KVScales
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.backends.triton import TritonBackend
from pagedserve.attention.kv_quant import kv_from_cache, to_cache
from pagedserve.kernels import gemv
from pagedserve.kernels.rope_kv_write import rope_and_write_kv
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.rotary import get_rope

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Not powers of two: a scale applied twice, or not at all, changes the result.
SCALES = KVScales(k=0.37, v=2.5)
FP8_STEP = 0.0625
"""Half of e4m3's relative spacing (3 mantissa bits): one rounding step, as a relative error."""


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 elements equal, or (compiled, where the rotation may round differently) one
    rounding step apart."""
    if not ON_GPU:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * FP8_STEP, atol=2**-9)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_dim"),
                         [(torch.bfloat16, 4, 2, 64), (torch.float32, 2, 1, 32)])
def test_rope_kv_write_stores_the_reference_fp8_bytes(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    slots = torch.tensor([0, 7, 8, 15, 23, PAD_SLOT_ID, 2])
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = torch.randn(slots.shape[0], sum(sizes)).to(dtype).split(sizes, dim=-1)
    v[0, :3] = torch.tensor([5000.0, -5000.0, 1e-3])  # saturates at +-448; a subnormal
    rope = get_rope(head_dim, 64, ROPE, dtype, torch.device("cpu"))
    cos_sin = rope.cos_sin(torch.randint(0, 64, (slots.shape[0],)))
    cache = torch.full((2, 4, 8, num_kv_heads, head_dim), 7.0).to(FP8_KV_DTYPE)
    want = cache.clone()
    want_q = TorchRefBackend().rope_and_write_kv(q, k, v, cos_sin, want, slots, SCALES)
    got = cache.to(DEVICE)
    got_q = rope_and_write_kv(*(t.to(DEVICE) for t in (q, k, v, cos_sin)), got,
                              slots.to(DEVICE), SCALES.k, SCALES.v)
    tol = 0 if not ON_GPU else 8e-3
    torch.testing.assert_close(got_q.cpu(), want_q, atol=tol, rtol=tol)
    _within_one_step(got.cpu(), want)
    assert want[1, 0, 0, 0, :2].float().tolist() == [448.0, -448.0]
    assert (got.cpu()[:, 0, 1].float() == 7.0).all()  # unused slots untouched


def _quantized(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, ...] keys and values as an FP8 cache with SCALES stores them."""
    return torch.stack((to_cache(kv_cache[0], FP8_KV_DTYPE, SCALES.k),
                        to_cache(kv_cache[1], FP8_KV_DTYPE, SCALES.v)))


@pytest.mark.parametrize(("query_lens", "context_lens"),
                         [([1, 1], [37, 90]),  # decode: the split-KV kernel, several segments
                          ([1, 6, 3], [20, 4, 0])])  # mixed: the varlen kernel
def test_paged_attention_over_fp8_equals_the_reference_on_the_dequantized_cache(
    query_lens: list[int], context_lens: list[int]
) -> None:
    batch = make_paged_batch(query_lens, context_lens, 4, 2, 32, 8, torch.bfloat16)
    write_step_kv(batch)
    # Entries no request owns: NaN for the kernels (reading one would show), finite filler
    # for the torch reference (it multiplies them by a zero weight).
    cache = _quantized(batch.kv_cache)
    finite = _quantized(batch.kv_cache.nan_to_num(SENTINEL))
    meta, scale, n = batch.metadata, 32**-0.5, batch.metadata.num_actual_tokens
    # The oracle: the torch reference over the dequantized cache, in the model's dtype.
    want = torch.full_like(batch.query, SENTINEL)
    TorchRefBackend().forward(batch.query, kv_from_cache(finite, torch.bfloat16, SCALES), meta,
                              scale, want)
    ref_on_fp8 = torch.full_like(batch.query, SENTINEL)
    TorchRefBackend().forward(batch.query, finite, meta, scale, ref_on_fp8, SCALES)
    assert torch.equal(ref_on_fp8[:n], want[:n])

    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    on_device = batch_on(batch, DEVICE)
    got = torch.full_like(on_device.query, SENTINEL)
    backend.forward(on_device.query, cache.to(DEVICE), on_device.metadata, scale, got, SCALES)
    torch.testing.assert_close(got[:n].cpu(), want[:n], atol=2e-2, rtol=2e-2)
    assert (got[n:].cpu() == SENTINEL).all(), "padding rows were written"


def test_gemv_qkv_writes_keys_and_values_into_an_fp8_cache() -> None:
    hq, hkv, d, hidden, dt = 4, 2, 32, 96, torch.bfloat16
    rope = get_rope(d, 64, ROPE, dt, DEVICE)
    x = torch.randn(1, hidden).to(dt).to(DEVICE)
    norm = RMSNorm(hidden, 1e-5, dt, DEVICE)
    w = (torch.randn((hq + 2 * hkv) * d, hidden) * 0.2).to(dt).to(DEVICE)
    positions = torch.tensor([37], device=DEVICE)
    cache = torch.zeros(2, 4, 4, hkv, d, dtype=FP8_KV_DTYPE, device=DEVICE)
    gemv.rmsnorm_qkv_rope_kv_write(x, norm.weight, 1e-5, w, None, rope.cos_sin_cache,
                                   positions, torch.tensor([9], device=DEVICE), cache, hq,
                                   config=gemv.GemvConfig(8, 64, 4), k_scale=SCALES.k,
                                   v_scale=SCALES.v)
    want_q, want_k, want_v = F.linear(norm(x), w).split([hq * d, hkv * d, hkv * d], -1)
    _, want_k = rope.rotate(rope.cos_sin(positions), want_q, want_k)
    stored = kv_from_cache(cache, torch.float32, SCALES).reshape(2, -1, hkv * d).cpu()
    # The GEMV's sums run in another order than F.linear's: a bf16 step, then e4m3's.
    for got, want in ((stored[0, 9], want_k[0]), (stored[1, 9], want_v[0])):
        torch.testing.assert_close(got, want.float().cpu(), rtol=3 * FP8_STEP,
                                   atol=0.02 * want.float().abs().max().item())
    assert stored[:, [s for s in range(16) if s != 9]].abs().max() == 0
