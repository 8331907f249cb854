"""The attention-backend interface: one metadata type, one small backend protocol.

KV cache of one layer: ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). Token ``t`` of a step is written to cache slot
``slot_mapping[t] = block_id * block_size + offset``; ``PAD_SLOT_ID`` (-1) writes nothing.

An FP8 cache (``float8_e4m3fn``) holds ``value / scale``, saturated to e4m3's +-448, with one
scale for the keys and one for the values of each layer (``KVScales``); readers multiply by
the scale again. A cache in the model's dtype holds the values themselves and ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

PAD_SLOT_ID = -1
FP8_KV_DTYPE = torch.float8_e4m3fn
"""The element type of an FP8 KV cache (``kv_cache_dtype`` fp8 / fp8_e4m3)."""


@dataclass(frozen=True)
class KVScales:
    """Per-tensor scales of one layer's FP8 keys and values: the checkpoint's ``k_scale`` /
    ``v_scale`` where it has them, else 1.0 (``model/kv_scales.py``)."""

    k: float = 1.0
    v: float = 1.0


UNIT_KV_SCALES = KVScales()


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer of a KV-cache group.

    Rows are in batch order. Tokens of request ``i`` are rows
    ``query_start_loc[i] : query_start_loc[i + 1]``; their positions run from
    ``seq_lens[i] - query_len_i`` to ``seq_lens[i] - 1`` (the cached prefix comes first).
    """

    num_reqs: int
    num_actual_tokens: int
    """Real (unpadded) query tokens; rows beyond it are padding."""
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device: computed + scheduled tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req], device
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded], device; PAD_SLOT_ID on padding
    query_start_loc_cpu: torch.Tensor | None = None  # int32 [num_reqs + 1], host
    seq_lens_cpu: torch.Tensor | None = None  # int32 [num_reqs], host
    causal: bool = True
    num_decodes: int = 0
    """Leading requests whose query is one row (the batch orders them first): a backend may
    run them apart from the rest, on its decode kernel."""


class AttentionBackend(Protocol):
    """What an attention implementation provides. ``torch_ref`` is the oracle for the others."""

    name: str

    def rope_and_write_kv(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        cos_sin: torch.Tensor,  # [num_tokens, head_dim]: cos half | sin half
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """Rotate queries and keys (neox rotary embedding, ``layers/rotary.py``) and scatter
        the rotated keys and the values into the cache (rows with slot -1 write nothing;
        an FP8 cache gets them quantized with ``kv_scales``); returns the rotated queries
        [num_tokens, num_heads * head_dim]."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Causal attention of each query row over its request's cached keys (the step's own
        keys are already written; an FP8 cache's dequantized with ``kv_scales``). Writes
        ``output[:num_actual_tokens]`` only."""
        ...
