"""Reference attention over the paged KV cache in plain torch: the CPU path and the oracle.

Correct and clear first. Request ``i`` has ``query_len_i`` query rows at positions
``seq_len_i - query_len_i ... seq_len_i - 1``; keys of positions ``0 .. seq_len_i - 1`` sit in
its blocks (``block_table[i]``), the step's own keys already written. A query row at position
``p`` sees the keys at positions ``<= p`` (causal with a cached prefix). Query heads share KV
heads in groups (GQA). Decode rows (query_len 1) of all requests run as one batched call; each
other request runs alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.base import AttentionMetadata


def _host_list(host: torch.Tensor | None, device_tensor: torch.Tensor, n: int) -> list[int]:
    source = host if host is not None else device_tensor
    return source[:n].tolist()


class TorchRefBackend:
    name = "torch_ref"

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
    ) -> None:
        if slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(
                f"slot_mapping: {slot_mapping.shape[0]} entries for {key.shape[0]} key rows"
            )
        valid = slot_mapping >= 0  # bool [num_tokens]; PAD_SLOT_ID rows write nothing
        slots = slot_mapping[valid]
        kv_cache[0].flatten(0, 1).index_copy_(0, slots, key[valid].to(kv_cache.dtype))
        kv_cache[1].flatten(0, 1).index_copy_(0, slots, value[valid].to(kv_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> None:
        n = metadata.num_reqs
        starts = _host_list(metadata.query_start_loc_cpu, metadata.query_start_loc, n + 1)
        seq_lens = _host_list(metadata.seq_lens_cpu, metadata.seq_lens, n)
        decode_reqs = [i for i in range(n) if starts[i + 1] - starts[i] == 1]
        if decode_reqs:
            rows = [starts[i] for i in decode_reqs]
            lens = [seq_lens[i] for i in decode_reqs]
            block_table = metadata.block_table[decode_reqs]  # [num decodes, max_num_blocks]
            self._decode(query, kv_cache, block_table, rows, lens, scale, output)
        for i in range(n):
            if starts[i + 1] - starts[i] > 1:
                req_rows = slice(starts[i], starts[i + 1])
                keys, values = self._gather(kv_cache, metadata.block_table[i], seq_lens[i])
                out = self._prefill(query[req_rows], keys, values, scale, metadata.causal)
                output[req_rows] = out

    def _gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's keys and values, [seq_len, num_kv_heads, head_dim] each."""
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        blocks = kv_cache[:, block_ids[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
        kv = blocks.flatten(1, 2)[:, :seq_len]
        return kv[0], kv[1]

    def _prefill(
        self,
        query: torch.Tensor,  # [query_len, Hq, D]
        keys: torch.Tensor,  # [seq_len, Hkv, D]
        values: torch.Tensor,  # [seq_len, Hkv, D]
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        query_len, seq_len = query.shape[0], keys.shape[0]
        mask = None
        if causal and query_len != seq_len:
            first_pos = seq_len - query_len  # position of the first query row
            query_pos = torch.arange(first_pos, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # bool [query_len, seq_len]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1),
            keys.transpose(0, 1).to(query.dtype),
            values.transpose(0, 1).to(query.dtype),
            attn_mask=mask,
            is_causal=causal and query_len == seq_len,
            scale=scale,
            enable_gqa=True,
        )  # [Hq, query_len, D]
        return out.transpose(0, 1)

    def _decode(
        self,
        query: torch.Tensor,  # [num_tokens, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        block_table: torch.Tensor,  # int32 [n, max_num_blocks], the decoding requests' rows
        rows: list[int],  # the query row of each decoding request
        seq_lens: list[int],
        scale: float,
        output: torch.Tensor,  # [num_tokens, Hq, D]
    ) -> None:
        """One query row per request: keys padded to the longest request, masked by length."""
        device = query.device
        block_size = kv_cache.shape[2]
        row_ids = torch.tensor(rows, device=device)  # int64 [n]
        lens = torch.tensor(seq_lens, device=device)  # int64 [n]
        max_blocks = -(-max(seq_lens) // block_size)
        # Entries past a request's last block may be stale: point them at block 0 (masked).
        col = torch.arange(max_blocks, device=device)
        in_use = col[None, :] < (lens[:, None] + block_size - 1) // block_size
        block_ids = torch.where(in_use, block_table[:, :max_blocks].long(), 0)  # [n, max_blocks]
        kv = kv_cache[:, block_ids].flatten(2, 3)  # [2, n, max_blocks * block_size, Hkv, D]
        key_pos = torch.arange(kv.shape[2], device=device)
        mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # bool [n, 1, 1, S]
        out = F.scaled_dot_product_attention(
            query[row_ids].unsqueeze(2),  # [n, Hq, 1, D]
            kv[0].transpose(1, 2).to(query.dtype),  # [n, Hkv, S, D]
            kv[1].transpose(1, 2).to(query.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [n, Hq, 1, D]
        output[row_ids] = out.squeeze(2)
