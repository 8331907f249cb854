"""Attention plumbing of the runner: one metadata object per step and the forward context
that carries it to every layer by name (the backend comes from ``Platform.attention_backend``).

docs/architecture.md#step-5-attention-metadata and #step-6-forward."""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import AttentionMetadata
from pagedserve.attention.forward_context import ForwardContext
from pagedserve.attention.layer import Attention
from pagedserve.worker.capture_sizes import CudaGraphMode
from pagedserve.worker.input_batch import InputBatch


def build_attn_metadata(
    batch: InputBatch,
    block_table: torch.Tensor,  # int32 [num_reqs_after_padding, max_num_blocks], device
    slot_mapping: torch.Tensor,  # int64 [num_tokens_after_padding], device
    max_model_len: int,
) -> AttentionMetadata:
    """The step's batch layout. Host copies of query_start_loc and seq_lens ride along, so
    max_query_len, max_seq_len and a host-side backend need no device-to-host copy.

    A FULL graph serves every later context length, so its metadata claims the longest one
    (``max_model_len``): the backend's launch choices (split-KV segments) are made for it at
    capture and stay valid at every replay."""
    n = batch.num_reqs_after_padding
    full_graph = batch.mode is CudaGraphMode.FULL
    return AttentionMetadata(
        num_reqs=n,
        num_actual_tokens=batch.num_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=max_model_len if full_graph else batch.max_seq_len,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=torch.from_numpy(batch.query_start_loc_np),
        seq_lens_cpu=torch.from_numpy(batch.seq_lens_np),
        causal=True,
        num_decodes=batch.plan.num_decodes,
    )


def make_forward_context(
    attn_layers: dict[str, Attention], metadata: AttentionMetadata, batch: InputBatch
) -> ForwardContext:
    """All layers form one KV-cache group: the same metadata and slot mapping under every
    name. The mode is how this forward really runs (``batch.mode``: eager until graphs are
    captured), not the descriptor the dispatcher chose."""
    return ForwardContext(
        attn_metadata={name: metadata for name in attn_layers},
        slot_mapping={name: metadata.slot_mapping for name in attn_layers},
        num_tokens=batch.num_tokens_after_padding,
        cudagraph_mode=batch.mode.name,
        query_len=batch.descriptor.query_len,
        attn_layers=dict(attn_layers),
    )
