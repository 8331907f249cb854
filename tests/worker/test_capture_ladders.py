"""CompilationConfig's capture sizes: a dense FULL ladder, a sparse PIECEWISE one, and the
explicit sizes that override them."""

from __future__ import annotations

import pytest

from pagedserve.config import (
    CompilationConfig,
    EngineConfig,
    default_capture_sizes,
    default_piecewise_capture_sizes,
)
from pagedserve.worker.model_runner import capture_ladders


def test_default_ladders() -> None:
    config = CompilationConfig()
    assert config.full_capture_sizes == default_capture_sizes(512)
    assert len(config.full_capture_sizes) == 51
    assert config.piecewise_capture_sizes == [2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384,
                                              448, 512]


@pytest.mark.parametrize(
    "max_capture_size,expected",
    [
        (8, [2, 4, 8]),
        (100, [2, 4, 8, 16, 32, 64, 96]),  # ends where the dense ladder does (96)
        (300, [2, 4, 8, 16, 32, 64, 128, 192, 256, 288]),
        (1, [1]),
    ],
)
def test_piecewise_ladder_ends_with_the_dense_one(max_capture_size: int,
                                                  expected: list[int]) -> None:
    assert default_piecewise_capture_sizes(max_capture_size) == expected
    assert expected[-1] == default_capture_sizes(max_capture_size)[-1]


def test_explicit_sizes_serve_both_modes() -> None:
    config = CompilationConfig(cudagraph_capture_sizes=(8, 1, 8))
    assert config.full_capture_sizes == [1, 8] and config.piecewise_capture_sizes == [1, 8]


def test_explicit_piecewise_sizes_override_for_piecewise_only() -> None:
    config = CompilationConfig(cudagraph_capture_sizes=(1, 8),
                               piecewise_cudagraph_capture_sizes=(64, 16))
    assert config.full_capture_sizes == [1, 8] and config.piecewise_capture_sizes == [16, 64]
    config = CompilationConfig(piecewise_cudagraph_capture_sizes=(300,))
    assert config.full_capture_sizes == default_capture_sizes(512)
    assert config.piecewise_capture_sizes == [300]


@pytest.mark.parametrize("field", ["cudagraph_capture_sizes",
                                   "piecewise_cudagraph_capture_sizes"])
def test_sizes_below_one_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CompilationConfig(**{field: (0, 8)})


def test_budget_step_graph_adds_the_token_budget_as_an_exact_size() -> None:
    def ladders(**kwargs):  # noqa: ANN202
        budget = kwargs.pop("max_num_batched_tokens", 8192)
        return capture_ladders(EngineConfig.from_kwargs(max_num_batched_tokens=budget, **kwargs))

    assert ladders().exact == []  # off by default
    on = ladders(budget_step_graph=True)
    assert on.exact == [8192] and on.piecewise == default_piecewise_capture_sizes(512)
    assert ladders(budget_step_graph=True, max_num_batched_tokens=16384).exact == [16384]
    # A budget the ladder already reaches needs no graph of its own.
    assert ladders(budget_step_graph=True, max_num_batched_tokens=512).exact == []
    assert ladders(budget_step_graph=True, max_num_batched_tokens=300).exact == []
