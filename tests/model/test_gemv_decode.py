"""The one-token forward on the fused GEMV kernels against the model's own forward: the same
greedy tokens and logits through the paged KV cache (fp32), close logits in bf16 (Triton's CPU
interpreter)."""

from __future__ import annotations

import dataclasses
import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (the kernels run on CPU)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pagedserve.layers.linear import UNQUANTIZED  # noqa: E402
from pagedserve.layers.quantization.fp8 import Fp8OnlineLinearMethod  # noqa: E402
from pagedserve.model.gemv_decode import GemvDecodeForward, unsupported_reason  # noqa: E402
from pagedserve.model.llama import LLAMA_LAYERS, LlamaForCausalLM, LlamaMLP  # noqa: E402
from tests.model.hf_tiny import our_tiny_model  # noqa: E402
from tests.model.paged_harness import greedy_generate  # noqa: E402

NUM_STEPS = 3
ONLINE_FP8 = Fp8OnlineLinearMethod("dequantize")


class OneTokenOnGemv(nn.Module):
    """The model, with every one-token step on ``GemvDecodeForward`` (as the runner's FULL
    graph of size 1 does)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.gemv = model.one_token_forward()
        assert isinstance(self.gemv, GemvDecodeForward)
        self.one_token_steps = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            self.one_token_steps += 1
            return self.gemv(input_ids, positions)
        return self.inner(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden_states)


PROMPT, ONE_TOKEN_PROMPT = [5, 17, 3, 120, 9, 44, 8], [31]


@pytest.mark.parametrize(("case", "prompt"), [
    *((case, PROMPT) for case in ("llama", "llama3_rope", "qwen2", "llama_all_biases",
                                  "llama_fp8", "qwen2_fp8")),
    ("llama", ONE_TOKEN_PROMPT), ("qwen2_fp8", ONE_TOKEN_PROMPT),
])
def test_same_tokens_and_logits_as_the_model(case: str, prompt: list[int], tmp_path) -> None:
    """A 7-token prompt (prefill on the model, decode on the kernels), each architecture and
    weight kind; and a 1-token prompt, whose prefill is a one-token step too (the same path
    for every architecture: two cases)."""
    torch.set_num_threads(1)
    if case == "llama_all_biases":  # q/k/v, o_proj, gate/up and down_proj all with a bias
        ours = our_tiny_model("llama", tmp_path, attention_bias=True, mlp_bias=True)
    elif case.endswith("_fp8"):  # FP8 weights: the model dequantizes, the kernels scale rows
        ours = our_tiny_model(case.removesuffix("_fp8"), tmp_path, linear_method=ONLINE_FP8)
    else:
        ours = our_tiny_model(case, tmp_path)
    want = greedy_generate(ours, [prompt], NUM_STEPS)[0]
    fused = OneTokenOnGemv(ours)
    got = greedy_generate(fused, [prompt], NUM_STEPS)[0]
    assert fused.one_token_steps == NUM_STEPS - 1 + (len(prompt) == 1)
    assert got.generated == want.generated
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4,
                               rtol=0)


def test_bf16_logits_stay_close_to_the_model(tmp_path) -> None:
    """bf16: the kernels round less often than the torch layers (see ``kernels/gemv.py``), so
    the first decode step's logits are close, not equal: within 2% of their range, and the
    same greedy token."""
    torch.set_num_threads(1)
    ours = our_tiny_model("llama", tmp_path, dtype=torch.bfloat16)
    prompt = [5, 17, 3, 120, 9, 44, 8]
    want = greedy_generate(ours, [prompt], 2)[0]
    got = greedy_generate(OneTokenOnGemv(ours), [prompt], 2)[0]
    assert got.generated[0] == want.generated[0]  # the prefill ran on the model in both
    step, ref = got.logits[len(prompt)], want.logits[len(prompt)]  # the first decode step
    assert (step - ref).abs().max() <= 0.02 * (ref.max() - ref.min())
    assert step.argmax() == ref.argmax()


@pytest.mark.parametrize(("case", "reason"), [
    ("qwen3", "attention Qwen3Attention is not LlamaAttention"),  # its q/k norms
    ("llama_head_dim_bias", "head_dim 24"),
])
def test_unsupported_models_say_why(case: str, reason: str, tmp_path,
                                    caplog: pytest.LogCaptureFixture) -> None:
    ours = our_tiny_model(case, tmp_path)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert ours.one_token_forward() is None
    assert reason in caplog.text
    with pytest.raises(ValueError, match=reason):
        GemvDecodeForward(ours, ours.one_token_layers)


class GatedGeluMLP(LlamaMLP):
    """Another MLP: the fused gate/up kernel applies SiLU, so this one must not reach it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate) * up)


class LlamaWithGeluMLP(LlamaForCausalLM):
    """A Llama subclass that swaps the MLP class and declares nothing new."""

    def __init__(self, hf_config: object, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hf_config, dtype, device)
        for layer in self.model.layers:
            layer.mlp = GatedGeluMLP(hf_config, dtype, device, self.tp, UNQUANTIZED)


def test_a_subclass_with_another_mlp_gets_no_gemv_forward(tmp_path) -> None:
    ours = our_tiny_model("llama", tmp_path)
    assert ours.one_token_forward() is not None  # the same weights and shapes fit the kernels
    other = LlamaWithGeluMLP(ours.config, torch.float32, torch.device("cpu"))
    assert other.one_token_layers is LLAMA_LAYERS
    assert other.one_token_forward() is None
    assert "MLP GatedGeluMLP is not LlamaMLP" in unsupported_reason(other, LLAMA_LAYERS)


def test_tensor_parallel_models_are_refused(tmp_path) -> None:
    """o_proj and down_proj of a TP rank need an all-reduce before the residual add, which the
    kernels' epilogue cannot do: such engines keep the compiled forward."""
    ours = our_tiny_model("llama", tmp_path)
    ours.tp = dataclasses.replace(ours.tp, size=2, group_name="tp")
    assert "tensor parallelism" in unsupported_reason(ours, ours.one_token_layers)
    assert ours.one_token_forward() is None
