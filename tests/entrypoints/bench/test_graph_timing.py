"""graph_timing on a CUDA device: a captured graph replays the captured work, timings are
positive and a median of more work is longer."""

from __future__ import annotations

import pytest
import torch

from pagedserve.entrypoints.bench.graph_timing import capture_graph, graph_time_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_graph_replays_the_captured_work() -> None:
    x = torch.zeros(4, device="cuda")
    graph = capture_graph(lambda: x.add_(1))  # the warm-up ran it once, the capture did not
    assert x.tolist() == [1.0] * 4
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4


def test_more_work_takes_longer() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    one = graph_time_ms(lambda: a @ a)
    eight = graph_time_ms(lambda: [a @ a for _ in range(8)])
    assert 0 < one < eight
