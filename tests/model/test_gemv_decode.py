"""The one-token forward on the fused GEMV kernels against the model's own forward: the same
greedy tokens and logits through the paged KV cache (fp32, Triton's CPU interpreter)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (the kernels run on CPU)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pagedserve.model.gemv_decode import GemvDecodeForward, unsupported_reason  # noqa: E402
from pagedserve.model.registry import get_model_class  # noqa: E402
from tests.model.hf_tiny import make_hf_model, saved_checkpoint  # noqa: E402
from tests.model.paged_harness import greedy_generate  # noqa: E402

NUM_STEPS = 6


class OneTokenOnGemv(nn.Module):
    """The model, with every one-token step on ``GemvDecodeForward`` (as the runner's FULL
    graph of size 1 does)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.gemv = GemvDecodeForward(model)
        self.one_token_steps = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            self.one_token_steps += 1
            return self.gemv(input_ids, positions)
        return self.inner(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden_states)


def _ours(case: str, tmp_path) -> nn.Module:
    hf_model = make_hf_model(case)
    ours = get_model_class(hf_model.config)(hf_model.config, torch.float32, torch.device("cpu"))
    ours.load_weights(saved_checkpoint(hf_model, tmp_path).items())
    return ours


@pytest.mark.parametrize("case", ["llama", "llama3_rope", "qwen2"])
@pytest.mark.parametrize("prompt", [[5, 17, 3, 120, 9, 44, 8], [31]])
def test_same_tokens_and_logits_as_the_model(case: str, prompt: list[int], tmp_path) -> None:
    """A 7-token prompt (prefill on the model, decode on the kernels) and a 1-token prompt
    (its prefill is a one-token step too)."""
    torch.set_num_threads(1)
    ours = _ours(case, tmp_path)
    want = greedy_generate(ours, [prompt], NUM_STEPS)[0]
    fused = OneTokenOnGemv(ours)
    got = greedy_generate(fused, [prompt], NUM_STEPS)[0]
    assert fused.one_token_steps == NUM_STEPS - 1 + (len(prompt) == 1)
    assert got.generated == want.generated
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize(("case", "reason"), [
    ("qwen3", "normalizes q/k"),
    ("llama_head_dim_bias", "head_dim 24"),
])
def test_unsupported_models_say_why(case: str, reason: str, tmp_path) -> None:
    ours = _ours(case, tmp_path)
    assert reason in unsupported_reason(ours)
    with pytest.raises(ValueError, match=reason):
        GemvDecodeForward(ours)


def test_tensor_parallel_models_are_refused(tmp_path) -> None:
    """o_proj and down_proj of a TP rank need an all-reduce before the residual add, which the
    kernels' epilogue cannot do: such engines keep the compiled forward."""
    ours = _ours("llama", tmp_path)
    ours.tp = dataclasses.replace(ours.tp, size=2, group_name="tp")
    assert "tensor parallelism" in unsupported_reason(ours)
