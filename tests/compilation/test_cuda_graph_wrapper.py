"""CUDAGraphWrapper dispatch that needs no GPU: other modes, and sizes without a graph outside a
capture phase, run the runnable as it is (a graph is never captured lazily while serving)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from pagedserve.attention.forward_context import ForwardContext, set_forward_context
from pagedserve.compilation.cuda_graph import CUDAGraphWrapper


def _calls() -> tuple[list[int], Callable[[torch.Tensor], torch.Tensor]]:
    seen: list[int] = []

    def runnable(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x + 1

    return seen, runnable


def _ctx(mode: str, num_tokens: int) -> ForwardContext:
    return ForwardContext(attn_metadata={}, slot_mapping={}, num_tokens=num_tokens,
                          cudagraph_mode=mode)


def test_other_modes_and_uncaptured_sizes_run_eagerly_outside_a_capture_phase() -> None:
    seen, runnable = _calls()
    pool = SimpleNamespace(capture_stream=None, handle=None)  # no capture phase running
    wrapper = CUDAGraphWrapper(runnable, "PIECEWISE", pool, "submod_0")
    x = torch.zeros(8)
    for mode in ("NONE", "FULL", "PIECEWISE"):
        with set_forward_context(_ctx(mode, 8)):
            assert torch.equal(wrapper(x), x + 1)
    assert seen == [8, 8, 8] and wrapper.entries == {}


def test_mode_must_be_a_graph_mode() -> None:
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        CUDAGraphWrapper(lambda: None, "NONE", SimpleNamespace(), "x")
