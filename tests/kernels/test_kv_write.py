"""The KV-cache write kernel against torch indexing (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.kernels.kv_write import write_kv

SENTINEL = 99.0


def _expected(key, value, kv_cache, slot_mapping) -> torch.Tensor:
    out = kv_cache.clone()
    flat = out.view(2, -1, *out.shape[3:])
    real = slot_mapping[: key.shape[0]] != PAD_SLOT_ID
    flat[0, slot_mapping[: key.shape[0]][real]] = key[real]
    flat[1, slot_mapping[: key.shape[0]][real]] = value[real]
    return out


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim",
    [(torch.float32, 2, 64), (torch.bfloat16, 3, 80), (torch.float16, 1, 128)],
)
def test_write_kv_scatters_by_slot_and_skips_padding(dtype, num_kv_heads, head_dim) -> None:
    num_blocks, block_size = 6, 8
    # Slots at block edges (offset 0 and block_size - 1), unordered, then padding rows.
    slots = [0, 7, 8, 15, 40, 23, 47, 2]
    slot_mapping = torch.tensor([*slots, PAD_SLOT_ID, PAD_SLOT_ID], dtype=torch.int64)
    num_tokens = slot_mapping.shape[0]
    # key/value are strided views of one fused buffer, as after a QKV projection split.
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), SENTINEL)
    kv_cache = kv_cache.to(dtype)
    expected = _expected(key, value, kv_cache, slot_mapping)
    write_kv(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, expected)


def test_write_kv_uses_only_the_first_num_tokens_slots() -> None:
    key = torch.randn(2, 1, 16)
    kv_cache = torch.full((2, 2, 4, 1, 16), SENTINEL)
    slot_mapping = torch.tensor([5, 1, 3, 6], dtype=torch.int64)  # a longer persistent buffer
    expected = _expected(key, key, kv_cache, slot_mapping)
    write_kv(key, key, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, expected)
    assert (kv_cache.view(2, -1, 16)[:, [3, 6]] == SENTINEL).all()


def test_write_kv_rejects_mismatched_inputs() -> None:
    kv_cache = torch.zeros(2, 2, 4, 2, 16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="key/value"):
        write_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), kv_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(torch.zeros(3, 2, 16).half(), torch.zeros(3, 2, 16).half(), kv_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), kv_cache, slots[:2])
