"""Test batches over a paged KV cache, and the dense causal attention they must match."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID, AttentionMetadata

# Cache entries no request owns hold NaN: a kernel reading one poisons its output.
POISON = float("nan")
# Output rows a kernel must not write start as this value.
SENTINEL = 1234.5


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens_padded, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]: prefixes only
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    new_keys: torch.Tensor  # [num_tokens_padded, num_kv_heads, head_dim]: this step's keys
    new_values: torch.Tensor  # [num_tokens_padded, num_kv_heads, head_dim]
    metadata: AttentionMetadata


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding: int = 3,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Requests with a cached prefix of ``context_lens`` keys already in the cache (scattered
    over shuffled blocks) and ``query_lens`` new rows whose keys are returned, not written.
    Built on the CPU (the same random batch for every device), then moved to ``device``.
    ``metadata.num_decodes`` counts the leading one-row queries, as the runner's does."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks - 1).tolist()  # the last block is never assigned
    # int32 [num_reqs, max_blocks + 2]; unused entries name the never-assigned (NaN) block
    block_table = torch.full((len(seq_lens), max(blocks_per_req) + 2), num_blocks - 1)
    block_table = block_table.int()
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), POISON, dtype=dtype)
    keys, values, slots = [], [], []
    for i, (seq_len, ctx) in enumerate(zip(seq_lens, context_lens, strict=True)):
        ids = torch.tensor([order.pop() for _ in range(blocks_per_req[i])], dtype=torch.int32)
        block_table[i, : len(ids)] = ids
        pos = torch.arange(seq_len)
        req_slots = ids[pos // block_size].long() * block_size + pos % block_size
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim).to(dtype))
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, req_slots[:ctx]] = keys[i][:ctx]
        flat[1, req_slots[:ctx]] = values[i][:ctx]
        slots.append(req_slots[ctx:])
    num_tokens = sum(query_lens)
    pad_slots = torch.full((num_padding,), PAD_SLOT_ID, dtype=torch.int64)
    new_keys = torch.cat([k[c:] for k, c in zip(keys, context_lens, strict=True)])
    new_values = torch.cat([v[c:] for v, c in zip(values, context_lens, strict=True)])
    pad_kv = torch.randn(num_padding, num_kv_heads, head_dim).to(dtype)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).int()
    metadata = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat([*slots, pad_slots]),
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
    )
    batch = PagedBatch(
        query=torch.randn(num_tokens + num_padding, num_heads, head_dim).to(dtype),
        kv_cache=kv_cache,
        keys=keys,
        values=values,
        new_keys=torch.cat([new_keys, pad_kv]),
        new_values=torch.cat([new_values, pad_kv]),
        metadata=metadata,
    )
    return batch_on(batch, torch.device(device))


def batch_on(batch: PagedBatch, device: torch.device) -> PagedBatch:
    """``batch`` with every tensor, the metadata's included, on ``device``."""
    meta = batch.metadata
    return PagedBatch(
        query=batch.query.to(device),
        kv_cache=batch.kv_cache.to(device),
        keys=[k.to(device) for k in batch.keys],
        values=[v.to(device) for v in batch.values],
        new_keys=batch.new_keys.to(device),
        new_values=batch.new_values.to(device),
        metadata=replace(
            meta,
            query_start_loc=meta.query_start_loc.to(device),
            seq_lens=meta.seq_lens.to(device),
            block_table=meta.block_table.to(device),
            slot_mapping=meta.slot_mapping.to(device),
        ),
    )


def write_step_kv(batch: PagedBatch) -> None:
    """Reference cache write of the step's own keys (what a backend's cache write must do)."""
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    real = batch.metadata.slot_mapping != PAD_SLOT_ID
    flat[0, batch.metadata.slot_mapping[real]] = batch.new_keys[real]
    flat[1, batch.metadata.slot_mapping[real]] = batch.new_values[real]


def dense_causal_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """fp32 [num_actual_tokens, num_heads, head_dim] from the unpaged keys and values."""
    meta = batch.metadata
    num_heads = batch.query.shape[1]
    out = []
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
        seq_len = meta.seq_lens[i].item()
        group = num_heads // batch.keys[i].shape[1]
        k = batch.keys[i].float().repeat_interleave(group, dim=1)
        v = batch.values[i].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.query[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=k.device)
        k_pos = torch.arange(seq_len, device=k.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


def sentinel_like(query: torch.Tensor) -> torch.Tensor:
    return torch.full_like(query, SENTINEL)
