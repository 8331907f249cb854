"""benchmarks/mixed_attention.py: its mixed batch is what the engine builds (decodes first,
prompt chunks after a cached prefix), and both ways of running it agree with the reference.
Under the interpreter in CI (a small batch), compiled on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.backends.triton import TritonBackend
from tests.benchmarks.script_loader import loaded_script
from tests.kernels.kernel_device import DEVICE


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_mixed_batch_runs_the_same_apart_and_together(cache_dtype: torch.dtype) -> None:
    with loaded_script("mixed_attention") as script:
        query, kv_cache, meta, decode_tokens = script.mixed_batch(
            6, (20, 40), [(7, 0), (5, 19)], cache_dtype, dev=str(DEVICE))
    assert meta.num_decodes == 6 and meta.num_reqs == 8 and meta.num_actual_tokens == 18
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 13, 18]
    seq_lens = meta.seq_lens.tolist()
    assert seq_lens[6:] == [7, 24] and decode_tokens == sum(seq_lens[:6])
    table = meta.block_table.cpu()
    owned = [table[i, : -(-s // script.BLOCK)] for i, s in enumerate(seq_lens)]
    ids = torch.cat(owned)
    assert ids.unique().numel() == ids.numel() and ids.min() >= 1  # block 0 is never used

    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    scale = script.HEAD_DIM**-0.5
    outputs = []
    for num_apart in (0, 6):
        outputs.append(torch.empty_like(query))
        backend.forward_apart(query, kv_cache, meta, num_apart, scale, outputs[-1])
    want = torch.empty_like(query)
    TorchRefBackend().forward(query, kv_cache, meta, scale, want)
    for got in outputs:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
