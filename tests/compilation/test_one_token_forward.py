"""CompiledForward sends one-token steps to its one-token forward (the fused GEMV kernels on
GPUs) and every other step to the compiled pieces; here on the CPU, through the model runner,
with the kernels in Triton's interpreter (the conftest chooses it)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.model.gemv_decode import GemvDecodeForward
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
    gemv = GemvDecodeForward(compiled.model)
    num_tokens = []

    def one_token_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens.append(input_ids.shape[0])
        return gemv(input_ids, positions)

    compiled.compiled_forward.one_token_forward = one_token_forward
    assert _generate(compiled) == _generate(eager)
    assert num_tokens == [1, 1]
