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
from pagedserve.model.shape import ModelShape
from pagedserve.worker.capture_sizes import HOST_BOUND_LAYER_FLOPS, capture_ladders


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


def _ladders(shape: ModelShape | None = None, **kwargs):  # noqa: ANN202
    budget = kwargs.pop("max_num_batched_tokens", 8192)
    config = EngineConfig.from_kwargs(max_num_batched_tokens=budget, **kwargs)
    return capture_ladders(config, shape)


# Layer shapes (the vocab plays no part): Qwen3-0.6B (0.26 TFLOP per layer at 8,192 tokens)
# and Llama-3-8B (3.57 TFLOP).
QWEN3_0_6B = ModelShape(num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                        ffn=3072, vocab=151936)
LLAMA_3_8B = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        ffn=14336, vocab=128256)


def test_budget_step_graph_adds_the_token_budget_as_an_exact_size() -> None:
    on = _ladders(budget_step_graph=True)
    assert on.exact == [8192] and on.piecewise == default_piecewise_capture_sizes(512)
    assert _ladders(budget_step_graph=True, max_num_batched_tokens=16384).exact == [16384]
    # A budget the ladder already reaches needs no graph of its own.
    assert _ladders(budget_step_graph=True, max_num_batched_tokens=512).exact == []
    assert _ladders(budget_step_graph=True, max_num_batched_tokens=300).exact == []


def test_unset_budget_step_graph_follows_the_model_shape() -> None:
    assert _ladders(QWEN3_0_6B).exact == [8192]  # 0.26 TFLOP per layer: host-bound
    assert _ladders(LLAMA_3_8B).exact == []  # 3.57 TFLOP per layer
    assert _ladders().exact == []  # no shape yet: not decided, no graph
    # The rule counts the budget's tokens: Qwen3-0.6B at 16,384 does 0.52 TFLOP per layer.
    assert 2 * 16384 * QWEN3_0_6B.layer_matmul_params > HOST_BOUND_LAYER_FLOPS
    assert _ladders(QWEN3_0_6B, max_num_batched_tokens=16384).exact == []
    assert _ladders(LLAMA_3_8B, max_num_batched_tokens=1024).exact == [1024]


def test_under_tensor_parallelism_the_rule_counts_one_rank_s_flops() -> None:
    # Qwen3-0.6B at 16,384 tokens: 0.52 TFLOP per layer, 0.26 per rank on two.
    assert _ladders(QWEN3_0_6B, max_num_batched_tokens=16384, tensor_parallel_size=2).exact == [
        16384]
    assert _ladders(LLAMA_3_8B, tensor_parallel_size=2).exact == []  # 1.8 TFLOP per rank


def test_a_set_budget_step_graph_overrides_the_shape() -> None:
    assert _ladders(LLAMA_3_8B, budget_step_graph=True).exact == [8192]
    assert _ladders(QWEN3_0_6B, budget_step_graph=False).exact == []


def test_the_loaded_model_decides_an_unset_budget_step_graph(make_runner) -> None:  # noqa: ANN001
    runner = make_runner(max_num_batched_tokens=64, max_capture_size=16)
    # The tiny Llama's budget step is far below the threshold; buffers stay as sized.
    assert runner.graphs.ladders.piecewise[-1] == 16
    assert runner.graphs.ladders.exact == [64]
    assert runner.max_num_tokens == 64
