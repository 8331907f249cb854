"""The CUDA-graph dispatcher (padding to the next capture size of the batch's mode, FULL only
for uniform decodes), the capture sizes of each mode, the FULL graphs' memory estimate, and the
CudaGraphManager: dispatch and execution mode, and its capture loop run on the CPU runner."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from pagedserve.config import EngineConfig, default_capture_sizes, default_piecewise_capture_sizes
from pagedserve.model.shape import ModelShape
from pagedserve.worker import cudagraph
from pagedserve.worker.capture_sizes import (
    BatchDescriptor,
    CaptureLadders,
    CudaGraphMode,
    describe_batch,
    full_sizes,
    padded_buffer_sizes,
    padded_size,
    piecewise_sizes,
    prompt_lens,
)
from pagedserve.worker.cudagraph import CudaGraphManager, GraphMemory, full_graph_estimate
from tests.worker.conftest import RunnerFactory

DENSE = default_capture_sizes(512)  # 1, 2, 4, 8..256 by 8, 272..512 by 16
SPARSE = default_piecewise_capture_sizes(512)  # 2, 4, ..., 64, then by 64 to 512
H200 = CaptureLadders(full=DENSE, piecewise=SPARSE)  # the defaults
ONE_LADDER = CaptureLadders(full=DENSE, piecewise=DENSE)  # vLLM's sizes
FULL, PIECEWISE, NONE = CudaGraphMode.FULL, CudaGraphMode.PIECEWISE, CudaGraphMode.NONE


def test_mixed_batch_pads_on_the_piecewise_ladder() -> None:
    assert describe_batch(3, 300, None, ONE_LADDER, False) == BatchDescriptor(PIECEWISE, 304, None)
    assert describe_batch(3, 300, None, H200, False) == BatchDescriptor(PIECEWISE, 320, None)


def test_uniform_decode_pads_tokens_and_requests_on_the_full_ladder() -> None:
    assert describe_batch(3, 3, 1, H200, False) == BatchDescriptor(FULL, 4, 4)
    assert describe_batch(8, 8, 1, H200, False) == BatchDescriptor(FULL, 8, 8)
    assert describe_batch(200, 200, 1, H200, False) == BatchDescriptor(FULL, 200, 200)
    assert describe_batch(100, 200, None, H200, False) == BatchDescriptor(PIECEWISE, 256, None)


def test_above_largest_capture_size_runs_eagerly_unpadded() -> None:
    assert describe_batch(3, 600, None, H200, False) == BatchDescriptor(NONE, 600, None)
    assert describe_batch(600, 600, 1, H200, False) == BatchDescriptor(NONE, 600, None)


def test_decode_above_the_full_ladder_falls_to_piecewise() -> None:
    ladders = CaptureLadders(full=[1, 2, 4], piecewise=[8, 64])
    assert describe_batch(6, 6, 1, ladders, False) == BatchDescriptor(PIECEWISE, 8, None)
    assert describe_batch(4, 4, 1, CaptureLadders(full=[], piecewise=[8]), False).mode is PIECEWISE
    assert describe_batch(4, 4, 1, CaptureLadders([], []), False).mode is NONE


def test_only_a_step_of_exactly_the_budget_replays_the_budget_graph() -> None:
    ladders = CaptureLadders(full=DENSE, piecewise=SPARSE, exact=[8192])
    assert describe_batch(14, 8192, None, ladders, False) == BatchDescriptor(PIECEWISE, 8192, None)
    assert describe_batch(14, 8191, None, ladders, False) == BatchDescriptor(NONE, 8191, None)
    assert describe_batch(3, 600, None, ladders, False) == BatchDescriptor(NONE, 600, None)
    assert describe_batch(3, 300, None, ladders, False) == BatchDescriptor(PIECEWISE, 320, None)
    assert describe_batch(14, 8192, None, ladders, True).mode is NONE  # enforce_eager
    assert ladders.max_padded_tokens(8192) == 8192


def test_exact_sizes_lie_above_the_piecewise_ladder() -> None:
    with pytest.raises(ValueError, match="exact"):
        CaptureLadders(full=DENSE, piecewise=SPARSE, exact=[256])
    with pytest.raises(ValueError, match="exact"):
        CaptureLadders(full=DENSE, piecewise=SPARSE, exact=[9000, 8192])


def test_enforce_eager_never_pads() -> None:
    assert describe_batch(3, 300, None, H200, True) == BatchDescriptor(NONE, 300, None)
    assert describe_batch(3, 3, 1, H200, True) == BatchDescriptor(NONE, 3, None)


def test_prefill_of_uniform_length_is_piecewise() -> None:
    # Two requests of 5 tokens each, not decoding: uniform_decode_len is None.
    assert describe_batch(2, 10, None, H200, False) == BatchDescriptor(PIECEWISE, 16, None)
    # A one-token prefill pads to the smallest PIECEWISE size (there is no size 1).
    assert describe_batch(1, 1, None, H200, False) == BatchDescriptor(PIECEWISE, 2, None)


def test_exact_capture_size_is_not_padded() -> None:
    assert describe_batch(2, 512, None, H200, False).num_tokens == 512
    assert describe_batch(2, 192, None, H200, False).num_tokens == 192
    assert padded_size(257, DENSE) == 272 and padded_size(257, SPARSE) == 320
    assert padded_size(513, DENSE) == 513


def test_buffers_hold_the_largest_padding_of_either_ladder() -> None:
    assert H200.max_padded_tokens(300) == 320  # a mixed batch; a decode pads to 304
    assert H200.max_padded_tokens(70) == 128
    assert H200.max_padded_tokens(8192) == 8192  # above both ladders: no padding
    assert H200.max_padded_reqs(250) == 256 and H200.max_padded_reqs(1024) == 1024
    assert CaptureLadders(full=[8], piecewise=[64]).max_padded_reqs(5) == 8  # FULL pads requests


def test_ladders_must_be_ascending_and_distinct() -> None:
    with pytest.raises(ValueError, match="piecewise"):
        CaptureLadders(full=DENSE, piecewise=[64, 8])
    with pytest.raises(ValueError, match="full"):
        CaptureLadders(full=[8, 8], piecewise=SPARSE)


def test_ladder_of_each_mode() -> None:
    assert H200.ladder(FULL) == DENSE
    assert H200.ladder(PIECEWISE) == SPARSE and H200.ladder(NONE) == SPARSE


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="dispatch"):
        describe_batch(0, 0, None, H200, False)
    with pytest.raises(ValueError, match="dispatch"):
        describe_batch(4, 3, None, H200, False)


# ---- capture sizes and the FULL-graph memory estimate (worker/capture_sizes.py, cudagraph.py)


def test_full_sizes_fit_slots_tokens_and_blocks_largest_first() -> None:
    assert full_sizes(DENSE, max_num_reqs=64, max_num_batched_tokens=8192,
                      usable_blocks=10_000)[:3] == [64, 56, 48]
    assert full_sizes(DENSE, 256, 8192, 10_000)[0] == 256
    assert full_sizes(DENSE, 256, 8192, usable_blocks=20) == [16, 8, 4, 2, 1]
    assert full_sizes(DENSE, 256, max_num_batched_tokens=3, usable_blocks=99) == [2, 1]


def test_piecewise_sizes_skip_one_and_fit_budget_slots_and_blocks() -> None:
    sizes = piecewise_sizes(DENSE, 8192, 256, 4096, usable_blocks=10_000, block_size=16)
    assert sizes[0] == 512 and sizes[-1] == 2 and 1 not in sizes
    assert len(sizes) == len(DENSE) - 1
    assert piecewise_sizes(DENSE, max_num_batched_tokens=20, max_num_reqs=256,
                           max_model_len=4096, usable_blocks=99, block_size=16) == [16, 8, 4, 2]
    assert piecewise_sizes(DENSE, 8192, 256, 4096, usable_blocks=2, block_size=16)[0] == 32
    assert piecewise_sizes(SPARSE + [8192], 8192, 256, 4096, usable_blocks=512,
                           block_size=16) == [8192, 512, 448, 384, 320, 256, 192, 128, 64, 32,
                                              16, 8, 4, 2]
    # Above the context a size needs several prompts, so several request slots: 2 x 100
    # tokens (96 in whole blocks per prompt) reach 192, not 256.
    assert piecewise_sizes(SPARSE, 8192, max_num_reqs=2, max_model_len=100, usable_blocks=99,
                           block_size=16) == [192, 128, 64, 32, 16, 8, 4, 2]


def test_a_size_above_the_context_is_captured_as_several_prompts() -> None:
    assert prompt_lens(256, max_model_len=4096, block_size=16) == [256]
    assert prompt_lens(8192, max_model_len=4096, block_size=16) == [4096, 4096]
    assert prompt_lens(8192, max_model_len=3000, block_size=16) == [2992, 2992, 2208]
    assert prompt_lens(20, max_model_len=10, block_size=16) == [10, 10]
    for size, context in ((8192, 3000), (300, 64), (7, 5)):
        lens = prompt_lens(size, context, 16)
        assert sum(lens) == size and max(lens) <= context


def test_llama_8b_shape_capture_counts() -> None:
    """The 8B shape's defaults (max_num_seqs 256, max_num_batched_tokens 8192, context 8192):
    35 FULL graphs, and 13 PIECEWISE sizes (x 33 pieces = 429 graphs, down from 50 sizes)."""
    assert len(full_sizes(H200.full, 256, 8192, usable_blocks=100_000)) == 35
    sizes = piecewise_sizes(H200.piecewise, 8192, 256, 8192, usable_blocks=100_000,
                            block_size=16)
    assert sizes == [512, 448, 384, 320, 256, 192, 128, 64, 32, 16, 8, 4, 2]


def test_full_graph_estimate_is_first_capture_plus_per_graph_times_the_rest() -> None:
    mib = 2**20
    assert full_graph_estimate([40 * mib, 2 * mib], num_graphs=35) == 40 * mib + 34 * 2 * mib
    assert full_graph_estimate([40 * mib], num_graphs=1) == 40 * mib
    assert full_graph_estimate([40 * mib, -2 * mib], num_graphs=3) == 40 * mib
    assert full_graph_estimate([], num_graphs=0) == 0


# ---- CudaGraphManager: the buffers' bound, dispatch, and the capture loop ---------------------

LLAMA_3_8B = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        ffn=14336, vocab=128256)


def _plan(num_reqs: int, num_tokens: int, uniform_decode_len: int | None) -> SimpleNamespace:
    """The three facts of a BatchPlan that dispatch reads."""
    return SimpleNamespace(num_reqs=num_reqs, num_tokens=num_tokens,
                           uniform_decode_len=uniform_decode_len)


def _manager(**kwargs: object) -> CudaGraphManager:
    config = EngineConfig.from_kwargs(device="cpu", **kwargs)
    return CudaGraphManager(config, LLAMA_3_8B, max_model_len=8192, device=torch.device("cpu"))


def test_buffers_are_sized_before_the_shape_and_hold_every_exact_size() -> None:
    config = EngineConfig.from_kwargs(max_num_batched_tokens=300, max_num_seqs=250)
    assert padded_buffer_sizes(config) == (320, 256)
    config = EngineConfig.from_kwargs(max_num_batched_tokens=8192, max_num_seqs=250,
                                      budget_step_graph=True)
    assert padded_buffer_sizes(config) == (8192, 256)
    assert _manager(max_num_batched_tokens=8192, budget_step_graph=True).ladders.exact == [8192]


def test_manager_dispatch_pads_and_runs_eagerly_while_nothing_is_captured() -> None:
    graphs = _manager(max_num_batched_tokens=8192, budget_step_graph=True)
    assert not graphs.enabled and graphs.pool is None  # the CPU: graphs are off
    assert graphs.dispatch(_plan(3, 3, 1)) == (BatchDescriptor(FULL, 4, 4), NONE)
    assert graphs.dispatch(_plan(3, 300, None)) == (BatchDescriptor(PIECEWISE, 320, None), NONE)
    assert graphs.dispatch(_plan(14, 8192, None)) == (BatchDescriptor(PIECEWISE, 8192, None),
                                                      NONE)
    assert graphs.dispatch(_plan(3, 600, None)) == (BatchDescriptor(NONE, 600, None), NONE)
    eager = _manager(enforce_eager=True)
    assert eager.dispatch(_plan(3, 3, 1)) == (BatchDescriptor(NONE, 3, None), NONE)
    assert graphs.capture(None, None, 100) == {}  # nothing to capture without a pool
    assert graphs.captured_sizes() == {"FULL": [], "PIECEWISE": []}


class _FakePool:
    """A GraphPool without the device: counts its capture phases."""

    def __init__(self) -> None:
        self.phases = 0

    @contextmanager
    def capture_phase(self, device: torch.device) -> Iterator[None]:
        self.phases += 1
        yield None


def test_manager_captures_through_the_runner_largest_first(
    make_runner: RunnerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture loop on the CPU runner, with a pool that records nothing and scripted
    device-memory readings: the order of warm-ups and captures, the modes each step ran in,
    the sizes kept, the probe's dropped graphs and the memory figures."""
    runner = make_runner(max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                         num_blocks=64, max_capture_size=8)
    graphs = runner.graphs
    assert (graphs.ladders.full, graphs.ladders.piecewise, graphs.ladders.exact) == (
        [1, 2, 4, 8], [2, 4, 8], [16])  # the tiny model wants the budget graph
    graphs.pool = pool = _FakePool()
    readings = iter([1000, 1600, 1600, 1600, 1700, 1700, 1710, 1650, 1650, 1800])
    monkeypatch.setattr(cudagraph, "used_device_bytes", lambda device: next(readings))
    steps: list[tuple[CudaGraphMode, int, CudaGraphMode]] = []
    dispatch = graphs.dispatch

    def spy(plan):  # noqa: ANN001, ANN202
        descriptor, mode = dispatch(plan)
        steps.append((descriptor.mode, descriptor.num_tokens, mode))
        return descriptor, mode

    graphs.dispatch = spy
    dropped: list[int] = []
    forward = SimpleNamespace(piecewise_wrappers=[object()] * 3,
                              full_graph=SimpleNamespace(drop=dropped.append))

    assert graphs.capture_before_kv_cache(runner, forward, runner.num_blocks) == 600 + 120
    assert steps == [(PIECEWISE, 16, NONE),  # the one warm-up, eager
                     (PIECEWISE, 16, PIECEWISE), (PIECEWISE, 8, PIECEWISE),
                     (PIECEWISE, 4, PIECEWISE), (PIECEWISE, 2, PIECEWISE),
                     (FULL, 4, NONE), (FULL, 4, FULL), (FULL, 2, FULL)]  # the probe
    assert dropped == [4, 2] and graphs.captured_sizes() == {"FULL": [],
                                                              "PIECEWISE": [16, 8, 4, 2]}
    # Estimate: the first FULL sample (100) plus the second (10) for each of 2 more sizes.
    assert graphs.memory == GraphMemory(piecewise=600, full_estimate=120, full_probe_kept=50)

    steps.clear()
    assert graphs.capture(runner, forward, runner.num_blocks) == {"FULL": [4, 2, 1],
                                                                  "PIECEWISE": [16, 8, 4, 2]}
    assert steps == [(FULL, 4, NONE), (FULL, 4, FULL), (FULL, 2, FULL), (FULL, 1, FULL)]
    assert graphs.memory.full == 150 + 50 and pool.phases == 3
    assert graphs.capturing is None and runner.states.req_id_to_index == {}

    graphs.dispatch = dispatch  # captured now: the steps replay
    assert graphs.dispatch(_plan(3, 3, 1)) == (BatchDescriptor(FULL, 4, 4), FULL)
    assert graphs.dispatch(_plan(2, 5, None)) == (BatchDescriptor(PIECEWISE, 8, None),
                                                  PIECEWISE)
    assert graphs.dispatch(_plan(2, 16, None)) == (BatchDescriptor(PIECEWISE, 16, None),
                                                   PIECEWISE)
    assert graphs.dispatch(_plan(2, 12, None)) == (BatchDescriptor(NONE, 12, None), NONE)
    assert graphs.dispatch(_plan(8, 8, 1)) == (BatchDescriptor(FULL, 8, 8), NONE)  # too few slots
