"""Reference attention over the paged KV cache in plain torch: the CPU path and the oracle.

Correct and clear first. Request ``i`` has ``query_len_i`` query rows at positions
``seq_len_i - query_len_i ... seq_len_i - 1``; keys of positions ``0 .. seq_len_i - 1`` sit in
its blocks (``block_table[i]``), the step's own keys already written. A query row at position
``p`` sees the keys at positions ``<= p`` (causal with a cached prefix). Query heads share KV
heads in groups (GQA): query head ``h`` reads KV head ``h // (Hq / Hkv)``.

Decode rows (query_len 1) of all requests run as one batched call; each other request runs
alone. How it is made fast on the CPU (these costs are per layer and step, 64 requests):
  - blocks are gathered with one ``index_select`` over the flattened block dimension
    (advanced indexing ``kv_cache[:, ids]`` is ~4x slower);
  - in decode, the ``G = Hq / Hkv`` query heads of a KV head become ``G`` query rows of that
    head, so the attention call needs no GQA expansion (``enable_gqa`` on bf16 takes the slow
    path: ~4x slower);
  - attention runs on 4-D ``[batch, heads, rows, head_dim]`` tensors (the fused CPU kernel;
    3-D inputs take a slower path);
  - the batch layout derived from the metadata (host lists, gather indices, masks) is built
    once per step: one metadata object is shared by every layer of the step.

An FP8 cache is quantized as it is written and dequantized into the query's dtype right after
its blocks are gathered (``attention/kv_quant.py``); the attention math is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.base import (
    FP8_KV_DTYPE,
    UNIT_KV_SCALES,
    AttentionMetadata,
    KVScales,
)
from pagedserve.attention.kv_quant import kv_from_cache, to_cache
from pagedserve.layers.rotary import rotate_neox
from pagedserve.math_utils import cdiv


@dataclass(frozen=True)
class _DecodePlan:
    """The decoding requests of a step, padded to the longest one (``max_len`` keys)."""

    rows: torch.Tensor  # int64 [n], the query row of each decoding request
    block_ids: torch.Tensor  # int64 [n * max_blocks]; entries past a request's blocks are 0
    num_blocks: int  # max_blocks
    max_len: int  # the longest seq_len
    mask: torch.Tensor | None  # bool [n, 1, 1, max_len]: key position < seq_len; None if all equal
    block_table: torch.Tensor  # int32 [n, max_num_blocks], contiguous: each request's blocks
    seq_lens: torch.Tensor  # int32 [n]


@dataclass(frozen=True)
class _PrefillPlan:
    """One request with several query rows (a prompt or a chunk after a cached prefix)."""

    rows: slice
    block_ids: torch.Tensor  # int64 [num_blocks], exactly the blocks holding seq_len keys
    seq_len: int
    mask: torch.Tensor | None  # bool [query_len, seq_len] with a cached prefix, else None


@dataclass(frozen=True)
class _StepPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillPlan]


def _host_list(host: torch.Tensor | None, device_tensor: torch.Tensor, n: int) -> list[int]:
    source = host if host is not None else device_tensor
    return source[:n].tolist()


class TorchRefBackend:
    name = "torch_ref"

    def __init__(self) -> None:
        # The last metadata seen and its plan. The metadata object is held (not its id), so a
        # new step's object can never be mistaken for it.
        self._planned: tuple[AttentionMetadata, _StepPlan] | None = None

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Scatter the step's keys and values into the cache (quantized, into an FP8 one);
        rows with slot -1 write nothing (the cache write of ``rope_and_write_kv``; tests fill
        caches with it too)."""
        if slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(
                f"slot_mapping: {slot_mapping.shape[0]} entries for {key.shape[0]} key rows"
            )
        valid = slot_mapping >= 0  # bool [num_tokens]; PAD_SLOT_ID rows write nothing
        if not bool(valid.all()):  # host-side check (a sync on GPUs: this is the reference)
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        key = to_cache(key, kv_cache.dtype, kv_scales.k)
        value = to_cache(value, kv_cache.dtype, kv_scales.v)
        if kv_cache.dtype == FP8_KV_DTYPE:  # CPU torch has no float8 index_copy_: the bytes
            kv_cache, key, value = (t.view(torch.uint8) for t in (kv_cache, key, value))
        kv_cache[0].flatten(0, 1).index_copy_(0, slot_mapping, key)
        kv_cache[1].flatten(0, 1).index_copy_(0, slot_mapping, value)

    def rope_and_write_kv(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        cos_sin: torch.Tensor,  # [num_tokens, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        query, key = rotate_neox(cos_sin, query, key)
        kv_shape = (key.shape[0], kv_cache.shape[3], kv_cache.shape[4])
        self.write_kv(key.view(kv_shape), value.reshape(kv_shape), kv_cache, slot_mapping,
                      kv_scales)
        return query

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        plan = self._plan(metadata, kv_cache.shape[2], query.device)
        if plan.decode is not None:
            self._decode(query, kv_cache, plan.decode, scale, output, kv_scales)
        for prefill in plan.prefills:
            output[prefill.rows] = _prefill(query, kv_cache, prefill, scale, metadata.causal,
                                            kv_scales)

    def _decode(
        self,
        query: torch.Tensor,  # [num_tokens, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        plan: _DecodePlan,
        scale: float,
        output: torch.Tensor,  # [num_tokens, Hq, D]
        kv_scales: KVScales,
    ) -> None:
        """Every decoding request's row at once (a subclass replaces this with a kernel)."""
        output[plan.rows] = _padded_decode(query, kv_cache, plan, scale, kv_scales)

    def _plan(
        self, metadata: AttentionMetadata, block_size: int, device: torch.device
    ) -> _StepPlan:
        if self._planned is None or self._planned[0] is not metadata:
            self._planned = (metadata, _make_plan(metadata, block_size, device))
        return self._planned[1]


def _make_plan(metadata: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    n = metadata.num_reqs
    starts = _host_list(metadata.query_start_loc_cpu, metadata.query_start_loc, n + 1)
    seq_lens = _host_list(metadata.seq_lens_cpu, metadata.seq_lens, n)
    decode_reqs = [i for i in range(n) if starts[i + 1] - starts[i] == 1]
    decode = None
    if decode_reqs:
        rows = [starts[i] for i in decode_reqs]
        lens = [seq_lens[i] for i in decode_reqs]
        block_table = metadata.block_table[decode_reqs]  # [num decodes, max_num_blocks]
        decode = _decode_plan(block_table, rows, lens, block_size, device)
    prefills = []
    for i in range(n):
        query_len = starts[i + 1] - starts[i]
        if query_len > 1:
            num_blocks = -(-seq_lens[i] // block_size)
            block_ids = metadata.block_table[i, :num_blocks].long()
            prefills.append(
                _PrefillPlan(
                    slice(starts[i], starts[i + 1]),
                    block_ids,
                    seq_lens[i],
                    _prefix_mask(query_len, seq_lens[i], device) if metadata.causal else None,
                )
            )
    return _StepPlan(decode, prefills)


def _decode_plan(
    block_table: torch.Tensor,  # int32 [n, max_num_blocks], the decoding requests' rows
    rows: list[int],
    seq_lens: list[int],
    block_size: int,
    device: torch.device,
) -> _DecodePlan:
    lens = torch.tensor(seq_lens, device=device)  # int64 [n]
    max_len = max(seq_lens)
    num_blocks = cdiv(max_len, block_size)
    # Entries past a request's last block may be stale or invalid: read block 0 (masked).
    col = torch.arange(num_blocks, device=device)
    in_use = col[None, :] < (lens[:, None] + block_size - 1) // block_size  # bool [n, nb]
    block_ids = torch.where(in_use, block_table[:, :num_blocks].long(), 0)  # [n, nb]
    mask = None
    if min(seq_lens) < max_len:
        key_pos = torch.arange(max_len, device=device)
        mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # bool [n, 1, 1, max_len]
    row_ids = torch.tensor(rows, device=device)  # int64 [n]
    return _DecodePlan(
        row_ids, block_ids.flatten(), num_blocks, max_len, mask,
        block_table[:, :num_blocks].contiguous(), lens.to(torch.int32),
    )  # fmt: skip


def _prefix_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask when the query rows follow a cached prefix; None when they start at 0
    (the attention call's own ``is_causal`` is then exact and faster)."""
    if query_len == seq_len:
        return None
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    key_pos = torch.arange(seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]  # bool [query_len, seq_len]


def _gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales
) -> torch.Tensor:
    """[2, len(block_ids), block_size, Hkv, D]: the blocks' keys and values, in order, in
    ``dtype`` (an FP8 cache's dequantized)."""
    return kv_from_cache(kv_cache.index_select(1, block_ids), dtype, kv_scales)


def _padded_decode(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    plan: _DecodePlan,
    scale: float,
    kv_scales: KVScales,
) -> torch.Tensor:
    """[n, Hq, D]: one query row per request over its keys, padded and masked by length."""
    n = plan.rows.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    kv = _gather_blocks(kv_cache, plan.block_ids, query.dtype, kv_scales)
    kv = kv.view(2, n, plan.num_blocks * block_size, num_kv_heads, head_dim)[:, :, : plan.max_len]
    # The query heads of one KV head as rows of that head: [n, Hkv, G, D].
    q = query[plan.rows].view(n, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(
        q,
        kv[0].transpose(1, 2),  # [n, Hkv, max_len, D]
        kv[1].transpose(1, 2),
        attn_mask=plan.mask,
        scale=scale,
    )  # [n, Hkv, G, D]
    return out.reshape(n, -1, head_dim)


def _prefill(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    plan: _PrefillPlan,
    scale: float,
    causal: bool,
    kv_scales: KVScales,
) -> torch.Tensor:
    """[query_len, Hq, D] for one request's query rows over its first seq_len keys."""
    kv = _gather_blocks(kv_cache, plan.block_ids, query.dtype, kv_scales)
    kv = kv.flatten(1, 2)[:, : plan.seq_len]  # [2, seq_len, Hkv, D]
    out = F.scaled_dot_product_attention(
        query[plan.rows].transpose(0, 1).unsqueeze(0),  # [1, Hq, query_len, D]
        kv[0].transpose(0, 1).unsqueeze(0),  # [1, Hkv, seq_len, D]
        kv[1].transpose(0, 1).unsqueeze(0),
        attn_mask=plan.mask,
        is_causal=causal and plan.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, query_len, D]
    return out[0].transpose(0, 1)
