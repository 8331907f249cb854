"""Scatter one step's keys and values into the paged KV cache through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int64 [>= num_tokens]
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # PAD_SLOT_ID: a padding row, nothing lands in the cache.
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    kc_row = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off
    tl.store(kc_row + heads * stride_kc_head + dims, key, mask=mask)

    value_off = token * stride_value_tok + heads * stride_value_head + dims
    value = tl.load(value_ptr + value_off, mask=mask)
    vc_row = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off
    tl.store(vc_row + heads * stride_vc_head + dims, value, mask=mask)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """The layout every kernel assumes: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache: expected [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache: the head_dim axis must be contiguous")


def _check_kv_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_kv_cache(kv_cache)
    if key.shape != value.shape or key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"key/value: shapes {tuple(key.shape)}, {tuple(value.shape)} do not match "
            f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])}"
        )
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(
            f"key/value: dtype {key.dtype}/{value.dtype}, kv_cache has {kv_cache.dtype}"
        )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value: the head_dim axis must be contiguous")
    check_slot_mapping(slot_mapping, key.shape[0])


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """int64 with an entry for each of the step's tokens (a longer persistent buffer is fine)."""
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping: expected int64 with >= {num_tokens} entries, "
            f"got {slot_mapping.dtype} [{slot_mapping.shape[0]}]"
        )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [>= num_tokens]
) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key, value for every token whose
    slot is not PAD_SLOT_ID (-1). One program per token."""
    _check_kv_write(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
    )
