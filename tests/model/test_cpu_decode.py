"""The CPU's decode step in C (``model/cpu_decode.py``) against the model's torch layers: the same
greedy tokens and logits through the paged KV cache (fp32: tight; bf16: close), at batch 1 and
several requests at once, over blocks of 4 tokens (the steps cross block boundaries); greedy
tokens equal transformers'; and the models, weights and caches it leaves to the torch layers."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.layer import attention_layers, bind_kv_caches
from pagedserve.layers.cpu_pack_budget import PackBudget
from pagedserve.layers.linear import UNQUANTIZED
from pagedserve.layers.panel_pack import PANEL_MIN_ROWS, panel_pack
from pagedserve.layers.quantization.fp8 import Fp8OnlineLinearMethod
from pagedserve.layers.weight_copies import WeightCopies
from pagedserve.model import cpu_decode
from pagedserve.model.cpu_decode import CpuDecodeForward, load_decode_step, unsupported_reason
from pagedserve.model.llama import LlamaForCausalLM, LlamaMLP
from pagedserve.model.registry import get_model_class
from tests.model.hf_tiny import make_hf_model, our_tiny_model, saved_checkpoint
from tests.model.paged_harness import greedy_generate

pytestmark = pytest.mark.skipif(load_decode_step() is None, reason="no C compiler here")
NUM_STEPS = 8
PROMPTS = [[5, 17, 3, 120, 9, 44, 8], [31], [7, 7, 1, 150, 2, 90, 61, 11, 4, 3, 100]]
C_CASES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "llama_head_dim_bias"]


class DecodeInC(nn.Module):
    """The model, with its forward through ``CpuDecodeForward`` (as the CPU runner's)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.inner = model
        forward = model.cpu_decode_forward()
        assert isinstance(forward, CpuDecodeForward)
        self.c_forward = forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.c_forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden_states)


def assert_bf16_close(step: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 logits of the C step against the torch layers': within 2% of their range (the C
    step rounds where the torch ops do, but sums in another order)."""
    assert (step - ref).abs().max() <= 0.02 * (ref.max() - ref.min())


def _compare(ours: LlamaForCausalLM, prompts: list[list[int]], atol: float) -> DecodeInC:
    want = greedy_generate(ours, prompts, NUM_STEPS)
    fused = DecodeInC(ours)
    got = greedy_generate(fused, prompts, NUM_STEPS)
    for g, w in zip(got, want, strict=True):
        assert g.generated == w.generated
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), atol=atol,
                                   rtol=0)
    return fused


@pytest.mark.parametrize("case", C_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_batch_1_same_tokens_and_logits_as_the_torch_layers(case: str, prompt: list[int],
                                                            tmp_path) -> None:
    """fp32, one request: the prefill on the torch layers (a one-token prompt's prefill is a
    one-token step, in C), every decode step in C."""
    torch.set_num_threads(1)
    fused = _compare(our_tiny_model(case, tmp_path), [prompt], atol=1e-4)
    assert fused.c_forward.c_steps == NUM_STEPS - 1 + (len(prompt) == 1)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_several_requests_of_different_lengths(case: str, threads: int, tmp_path) -> None:
    """fp32, three requests decoding together (the prompts prefill in one mixed step on the
    torch layers), with every bias (q/k/v, o_proj, gate/up, down) where Llama has them."""
    torch.set_num_threads(threads)
    extra = {"attention_bias": True, "mlp_bias": True} if case == "llama" else {}
    fused = _compare(our_tiny_model(case, tmp_path, **extra), PROMPTS, atol=1e-4)
    assert fused.c_forward.c_steps == NUM_STEPS - 1


def _panel_prompts() -> list[list[int]]:
    """PANEL_MIN_ROWS + 3 prompts of 1 to 11 tokens."""
    return [PROMPTS[i % 3][: 1 + i % 11] for i in range(PANEL_MIN_ROWS + 3)]


@pytest.mark.parametrize("case", ["llama", "qwen3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batches_on_packed_weights(case: str, threads: int, tmp_path) -> None:
    """fp32, a batch large enough for the packed weights (panel_gemm.h), with every bias; at 2
    threads the step's rows and products are shared by the threads of one region."""
    torch.set_num_threads(threads)
    extra = {"attention_bias": True, "mlp_bias": True} if case == "llama" else {}
    fused = _compare(our_tiny_model(case, tmp_path, **extra), _panel_prompts(), atol=1e-4)
    assert fused.c_forward.c_steps == NUM_STEPS - 1
    assert fused.c_forward._panels is not None


SPLIT_ROWS = 45
"""An even number of panel_gemm.h's row blocks, the last partial, with either kernel (six of
AVX512's 8-row blocks, eight of AVX2's 6-row ones): at 2 threads cpu_decode.c gives each
thread a run of whole blocks to take through the step on its own."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batches_split_by_rows_among_threads(dtype: torch.dtype, tmp_path) -> None:
    """2 threads, a batch large enough for each to take its own rows through every layer (cut
    by cost where the contexts differ): the same tokens as one thread's step, and the logits
    within rounding (the prompts' torch layers may sum in another order on 2 threads)."""
    prompts = [PROMPTS[i % 3][: 1 + i % 11] for i in range(SPLIT_ROWS)]
    ours = our_tiny_model("qwen2", tmp_path, dtype=dtype)
    torch.set_num_threads(1)
    want = greedy_generate(DecodeInC(ours), prompts, NUM_STEPS)
    torch.set_num_threads(2)
    fused = DecodeInC(ours)
    got = greedy_generate(fused, prompts, NUM_STEPS)
    assert fused.c_forward.c_steps == NUM_STEPS - 1
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        assert g.generated == w.generated
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), atol=atol,
                                   rtol=0)


def test_batches_without_room_for_packed_weights_read_the_plain_ones(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    no_room = WeightCopies(panel_pack, "linear's panels", PackBudget(lambda: 0))
    monkeypatch.setattr(cpu_decode, "panel_copies", lambda: no_room)
    fused = _compare(our_tiny_model("llama", tmp_path), _panel_prompts(), atol=1e-4)
    assert fused.c_forward.c_steps == NUM_STEPS - 1
    panels = fused.c_forward._panels
    assert panels is not None and all(p is None for layer in panels for p in layer)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_batches_on_packed_weights_stay_close(threads: int, tmp_path) -> None:
    """bf16 on packed weights: the first decode step's logits within 2% of their range."""
    torch.set_num_threads(threads)
    ours, prompts = our_tiny_model("qwen2", tmp_path, dtype=torch.bfloat16), _panel_prompts()
    want = greedy_generate(ours, prompts, 2)
    fused = DecodeInC(ours)
    got = greedy_generate(fused, prompts, 2)
    assert fused.c_forward._panels is not None
    for g, w, prompt in zip(got, want, prompts, strict=True):
        step, ref = g.logits[len(prompt)], w.logits[len(prompt)]
        assert_bf16_close(step, ref)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_bf16_logits_stay_close(case: str, tmp_path) -> None:
    """bf16: the C step rounds where the torch ops do, but sums in another order, so logits are
    close, not equal: within 2% of their range; the first decode step's greedy token is the
    same."""
    torch.set_num_threads(1)
    ours = our_tiny_model(case, tmp_path, dtype=torch.bfloat16)
    want = greedy_generate(ours, PROMPTS, 2)
    got = greedy_generate(DecodeInC(ours), PROMPTS, 2)
    for g, w, prompt in zip(got, want, PROMPTS, strict=True):
        assert g.generated[0] == w.generated[0]  # the prefill ran on the torch layers in both
        step, ref = g.logits[len(prompt)], w.logits[len(prompt)]  # the first decode step
        assert_bf16_close(step, ref)
        assert step.argmax() == ref.argmax()


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers(case: str, tmp_path) -> None:
    torch.set_num_threads(1)
    hf_model = make_hf_model(case)
    config = hf_model.config
    ours = get_model_class(config)(config, torch.float32, torch.device("cpu"))
    ours.load_weights(saved_checkpoint(hf_model, tmp_path).items())
    fused = DecodeInC(ours)
    seqs = greedy_generate(fused, PROMPTS, 24)
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                do_sample=False)
        assert seq.generated == out[0, len(prompt):].tolist()
    assert fused.c_forward.c_steps == 23


class GatedGeluMLP(LlamaMLP):
    """Another MLP: the C step applies SiLU, so this one must not reach it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate) * up)


def test_unsupported_models_keep_the_torch_layers(tmp_path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Another MLP class, FP8 weights, tensor parallelism: no C forward, the reason logged."""
    ours = our_tiny_model("llama", tmp_path)
    for layer in ours.model.layers:
        layer.mlp = GatedGeluMLP(ours.config, torch.float32, torch.device("cpu"), ours.tp,
                                 UNQUANTIZED)
    fp8 = our_tiny_model("llama", tmp_path, linear_method=Fp8OnlineLinearMethod("dequantize"))
    tp = our_tiny_model("llama", tmp_path)
    tp.tp = dataclasses.replace(tp.tp, size=2, group_name="tp")
    reasons = {"MLP GatedGeluMLP is not LlamaMLP": ours, "Fp8OnlineLinearMethod weights": fp8,
               "tensor parallelism": tp}
    for reason, model in reasons.items():
        with caplog.at_level(logging.INFO, logger="pagedserve"):
            assert model.cpu_decode_forward() is None
        assert reason in caplog.text
        assert reason in (unsupported_reason(model, model.cpu_decode_layers) or "")


def test_an_fp8_kv_cache_keeps_the_torch_layers(tmp_path) -> None:
    """The C step writes and reads a cache in the model's dtype: with FP8 caches bound it
    builds no tables, and every step runs the torch layers."""
    ours = our_tiny_model("llama", tmp_path)
    forward = ours.cpu_decode_forward()
    assert isinstance(forward, CpuDecodeForward)
    caches = {name: torch.zeros(layer.kv_cache_shape(8, 4), dtype=torch.float8_e4m3fn)
              for name, layer in attention_layers(ours).items()}
    bind_kv_caches(ours, caches, TorchRefBackend())
    assert forward._c_model() is None
    assert forward.cache_refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_batches_run_in_c(dtype: torch.dtype, tmp_path) -> None:
    """Decode batches of any size run in C, in both dtypes: 300 one-token requests (more than
    the default ``max_num_seqs``), each step in C, the first step's logits as the torch
    layers' (fp32: tight; bf16: within 2% of their range, as above)."""
    torch.set_num_threads(2)
    prompts = [[1 + i % 199] for i in range(300)]
    ours = our_tiny_model("llama", tmp_path, dtype=dtype)
    want = greedy_generate(ours, prompts, 2, num_blocks=400)
    fused = DecodeInC(ours)
    got = greedy_generate(fused, prompts, 2, num_blocks=400)
    assert fused.c_forward.c_steps == 2
    for g, w in zip(got, want, strict=True):
        step, ref = g.logits[0], w.logits[0]
        if dtype == torch.float32:
            torch.testing.assert_close(step, ref, atol=1e-4, rtol=0)
        else:
            assert_bf16_close(step, ref)
