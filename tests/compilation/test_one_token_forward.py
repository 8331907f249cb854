"""CompiledForward sends one-token steps to its one-token forward (the fused GEMV kernels on
GPUs) and every other step to the compiled pieces; here on the CPU, through the model runner,
with the kernels in Triton's interpreter (the conftest chooses it)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.model.cpu_decode import CpuDecodeForward
from pagedserve.model.gemv_decode import GemvDecodeForward
from pagedserve.platform import platform_for
from tests.compilation.conftest import DEEP_LLAMA, _runner
from tests.compilation.test_compiled_forward import _generate


def test_runner_sends_one_token_steps_to_the_kernels(tmp_path) -> None:
    """The sampled tokens equal an eager runner's; the two lone decode steps of ``_generate``
    (and only they) ran on ``GemvDecodeForward``. head_dim 16: the kernels' rotary tile fits."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**DEEP_LLAMA, "hidden_size": 64, "intermediate_size": 128})
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    torch.set_num_threads(1)
    eager, compiled = _runner(tmp_path / "model", "none"), _runner(tmp_path / "model", "compile")
    gemv = compiled.model.one_token_forward()
    assert isinstance(gemv, GemvDecodeForward)
    num_tokens = []

    def one_token_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens.append(input_ids.shape[0])
        return gemv(input_ids, positions)

    compiled.compiled_forward.one_token_forward = one_token_forward
    assert _generate(compiled) == _generate(eager)
    assert num_tokens == [1, 1]


def test_runner_chooses_the_gemv_forward_where_it_applies(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """CUDA + ``one_token_step="gemv"`` + a supported model: the GEMV forward; otherwise none
    (the compiled forward serves one-token steps), with the reason logged; the CPU: its C
    decode step. The choice touches
    no device, so a CPU runner given the CUDA platform shows it."""
    torch.manual_seed(0)
    for name, head_dim in (("fits", 16), ("odd_tile", 8)):
        config = LlamaConfig(**{**DEEP_LLAMA, "hidden_size": 4 * head_dim})
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
    runner = _runner(tmp_path / "fits", "compile")
    # the CPU: no Triton kernels in serving; its decode step in C, where a compiler builds it
    assert isinstance(runner._one_token_forward(), CpuDecodeForward | None)
    runner.platform = platform_for(torch.device("cuda"))
    assert isinstance(runner._one_token_forward(), GemvDecodeForward)
    compilation = dataclasses.replace(runner.config.compilation, one_token_step="compiled")
    runner.config = dataclasses.replace(runner.config, compilation=compilation)
    assert runner._one_token_forward() is None

    runner = _runner(tmp_path / "odd_tile", "compile")
    runner.platform = platform_for(torch.device("cuda"))
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert runner._one_token_forward() is None
    assert "one-token steps run the compiled forward: head_dim 8" in caplog.text
