"""FULL CUDA graphs of verify batches (speculative decoding): every request runs 1 + k tokens,
so the batch pads on a ladder of request counts times 1 + k, and its graphs are kept apart
from the one-token ones of the same token count. The capture loop runs on the CPU runner
with a pool that records nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.config import EngineConfig
from pagedserve.worker import cudagraph
from pagedserve.worker.capture_sizes import (
    BatchDescriptor,
    CaptureLadders,
    CudaGraphMode,
    describe_batch,
    verify_ladder,
)
from tests.worker.conftest import RunnerFactory
from tests.worker.test_cudagraph import _FakePool, _plan

FULL, PIECEWISE, NONE = CudaGraphMode.FULL, CudaGraphMode.PIECEWISE, CudaGraphMode.NONE
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}


def test_verify_ladder_takes_request_counts_up_to_the_batch_limit():
    config = EngineConfig.from_kwargs(max_num_batched_tokens=64, speculative_config=SPEC)
    assert verify_ladder(config, [1, 2, 4, 8, 16]) == ([4, 8, 16], 4)
    assert verify_ladder(EngineConfig(), [1, 2, 4]) == ([], 0)


def test_uniform_verify_batches_pad_requests_alike():
    ladders = CaptureLadders(full=[1, 2, 4, 8], piecewise=[8, 16, 32], verify=[4, 8, 16],
                             verify_query_len=4)
    assert describe_batch(3, 12, 4, ladders, False) == BatchDescriptor(FULL, 16, 4)
    assert describe_batch(1, 4, 4, ladders, False) == BatchDescriptor(FULL, 4, 1)
    assert describe_batch(8, 8, 1, ladders, False) == BatchDescriptor(FULL, 8, 8)
    assert describe_batch(8, 32, 4, ladders, False).mode is PIECEWISE  # above the ladder
    assert describe_batch(2, 6, 3, ladders, False).mode is PIECEWISE  # fewer drafts
    assert BatchDescriptor(FULL, 16, 4).query_len == 4
    assert BatchDescriptor(FULL, 8, 8).query_len == BatchDescriptor(PIECEWISE, 8, None).query_len


def test_verify_graphs_are_captured_through_the_runner(make_runner: RunnerFactory,
                                                      monkeypatch: pytest.MonkeyPatch):
    runner = make_runner(max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                         num_blocks=64, max_capture_size=8, speculative_config=SPEC)
    graphs = runner.graphs
    assert (graphs.ladders.verify, graphs.ladders.verify_query_len) == ([4, 8, 16], 4)
    graphs.pool = _FakePool()
    monkeypatch.setattr(cudagraph, "used_device_bytes", lambda device: 0)
    steps = []
    dispatch = graphs.dispatch

    def spy(plan):  # noqa: ANN001, ANN202
        descriptor, mode = dispatch(plan)
        steps.append((descriptor, mode))
        return descriptor, mode

    graphs.dispatch = spy
    forward = SimpleNamespace(piecewise_wrappers=[object()],
                              full_graph=SimpleNamespace(drop=lambda size: None))
    sizes = graphs.capture(runner, forward, runner.num_blocks)
    assert sizes["FULL_VERIFY"] == [16, 8, 4] and sizes["FULL"] == [4, 2, 1]
    verify_steps = [(d, m) for d, m in steps if d.query_len == 4]
    assert verify_steps == [(BatchDescriptor(FULL, s, s // 4), FULL) for s in (16, 8, 4)]
    assert runner.states.req_id_to_index == {}  # the capture plans freed their slots

    graphs.dispatch = dispatch  # captured now: verify batches replay, one-token ones too
    assert graphs.dispatch(_plan(3, 12, 4)) == (BatchDescriptor(FULL, 16, 4), FULL)
    assert graphs.dispatch(_plan(3, 3, 1)) == (BatchDescriptor(FULL, 4, 4), FULL)
    assert graphs.dispatch(_plan(2, 2, 1)) == (BatchDescriptor(FULL, 2, 2), FULL)
    graphs.captured_verify.discard(8)
    assert graphs.dispatch(_plan(2, 8, 4)) == (BatchDescriptor(FULL, 8, 2), NONE)
