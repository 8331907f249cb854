"""Attention plumbing of the runner: backend choice, one metadata object per step and the
forward context that carries it to every layer by name.

docs/architecture.md#step-5-attention-metadata and #step-6-forward."""

from __future__ import annotations

import importlib.util

import torch

from pagedserve.attention.backends.base import AttentionBackend, AttentionMetadata
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.cpu_native import load_paged_decode_kernel
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.forward_context import ForwardContext
from pagedserve.attention.layer import Attention
from pagedserve.worker.cudagraph import CudaGraphMode
from pagedserve.worker.input_batch import InputBatch


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton paged attention on CUDA when triton is installed; on the CPU the native decode
    kernel when a C compiler can build it; else the torch reference."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from pagedserve.attention.backends.triton import TritonBackend

        return TritonBackend()
    if device.type == "cpu":
        kernel = load_paged_decode_kernel()
        if kernel is not None:
            return CpuBackend(kernel)
    return TorchRefBackend()


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
        attn_layers=dict(attn_layers),
    )
