"""The CUDA-graph dispatcher (padding to the next capture size, FULL only for uniform decodes),
the capture sizes of each mode, and the FULL graphs' memory estimate."""

from __future__ import annotations

import pytest

from pagedserve.config import default_capture_sizes
from pagedserve.worker.cudagraph import BatchDescriptor, CudaGraphMode, dispatch, padded_size
from pagedserve.worker.graph_capture import full_graph_estimate, full_sizes, piecewise_sizes

H200_SIZES = default_capture_sizes(512)  # 1, 2, 4, 8..256 by 8, 272..512 by 16


def test_seed_mixed_batch_is_piecewise_304() -> None:
    desc = dispatch(3, 300, None, H200_SIZES, enforce_eager=False)
    assert desc == BatchDescriptor(CudaGraphMode.PIECEWISE, 304, None)


def test_uniform_decode_pads_tokens_and_requests() -> None:
    assert dispatch(3, 3, 1, H200_SIZES, False) == BatchDescriptor(CudaGraphMode.FULL, 4, 4)
    assert dispatch(8, 8, 1, H200_SIZES, False) == BatchDescriptor(CudaGraphMode.FULL, 8, 8)


def test_above_largest_capture_size_runs_eagerly_unpadded() -> None:
    assert dispatch(3, 600, None, H200_SIZES, False) == BatchDescriptor(CudaGraphMode.NONE, 600,
                                                                         None)
    assert dispatch(600, 600, 1, H200_SIZES, False).mode is CudaGraphMode.NONE


def test_enforce_eager_never_pads() -> None:
    assert dispatch(3, 300, None, H200_SIZES, True) == BatchDescriptor(CudaGraphMode.NONE, 300,
                                                                        None)
    assert dispatch(3, 3, 1, H200_SIZES, True) == BatchDescriptor(CudaGraphMode.NONE, 3, None)


def test_prefill_of_uniform_length_is_piecewise() -> None:
    # Two requests of 5 tokens each, not decoding: uniform_decode_len is None.
    assert dispatch(2, 10, None, H200_SIZES, False) == BatchDescriptor(
        CudaGraphMode.PIECEWISE, 16, None)


def test_exact_capture_size_is_not_padded() -> None:
    assert dispatch(2, 512, None, H200_SIZES, False).num_tokens == 512
    assert padded_size(257, H200_SIZES) == 272
    assert padded_size(513, H200_SIZES) == 513


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="dispatch"):
        dispatch(0, 0, None, H200_SIZES, False)
    with pytest.raises(ValueError, match="dispatch"):
        dispatch(4, 3, None, H200_SIZES, False)


# ---- capture sizes and the FULL-graph memory estimate (worker/graph_capture.py) ----------------


def test_full_sizes_fit_slots_tokens_and_blocks_largest_first() -> None:
    assert full_sizes(H200_SIZES, max_num_reqs=64, max_num_batched_tokens=8192,
                      usable_blocks=10_000)[:3] == [64, 56, 48]
    assert full_sizes(H200_SIZES, 256, 8192, 10_000)[0] == 256
    assert full_sizes(H200_SIZES, 256, 8192, usable_blocks=20) == [16, 8, 4, 2, 1]
    assert full_sizes(H200_SIZES, 256, max_num_batched_tokens=3, usable_blocks=99) == [2, 1]


def test_piecewise_sizes_skip_one_and_fit_budget_context_and_blocks() -> None:
    sizes = piecewise_sizes(H200_SIZES, 8192, 4096, usable_blocks=10_000, block_size=16)
    assert sizes[0] == 512 and sizes[-1] == 2 and 1 not in sizes
    assert len(sizes) == len(H200_SIZES) - 1
    assert piecewise_sizes(H200_SIZES, 8192, max_model_len=20, usable_blocks=99,
                           block_size=16) == [16, 8, 4, 2]
    assert piecewise_sizes(H200_SIZES, 8192, 4096, usable_blocks=2, block_size=16)[0] == 32


def test_full_graph_estimate_is_first_capture_plus_per_graph_times_the_rest() -> None:
    mib = 2**20
    assert full_graph_estimate([40 * mib, 2 * mib], num_graphs=35) == 40 * mib + 34 * 2 * mib
    assert full_graph_estimate([40 * mib], num_graphs=1) == 40 * mib
    assert full_graph_estimate([40 * mib, -2 * mib], num_graphs=3) == 40 * mib
    assert full_graph_estimate([], num_graphs=0) == 0
