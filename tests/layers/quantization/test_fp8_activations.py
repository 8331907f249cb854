"""The norm and SiLU-and-mul layers that hand FP8 linear layers their activations quantized
per token: which linear methods get them, and a model built with them computes what the same
model computes with the plain layers and the GEMMs' own quantization pass (on the CPU, where
``torch._scaled_mm`` runs too, through the torch references of the layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.linear import finish_loading
from pagedserve.layers.quantization.fp8 import Fp8OnlineLinearMethod, input_layers_for
from pagedserve.layers.quantization.fp8_activations import (
    FP8_INPUT_LAYERS,
    PLAIN_INPUT_LAYERS,
    Fp8RMSNorm,
    Fp8SiluAndMul,
)
from pagedserve.layers.quantization.fp8_ops import Fp8Activation
from pagedserve.model.llama import LlamaForCausalLM
from tests.model.hf_tiny import make_hf_model, saved_checkpoint
from tests.model.paged_harness import greedy_generate

CPU = torch.device("cpu")


def test_fp8_input_layers_only_before_per_token_fp8_gemms() -> None:
    assert input_layers_for("scaled_mm", "dynamic") == FP8_INPUT_LAYERS
    assert input_layers_for("scaled_mm", "static") == PLAIN_INPUT_LAYERS  # the static scale
    assert input_layers_for("dequantize", "dynamic") == PLAIN_INPUT_LAYERS  # not quantized
    assert Fp8OnlineLinearMethod("scaled_mm").input_layers == FP8_INPUT_LAYERS


def test_layers_write_what_the_gemm_would_quantize() -> None:
    norm = Fp8RMSNorm(64, 1e-5, torch.bfloat16, CPU)
    x, residual = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    out, summed = norm(x, residual)
    ref_normed, ref_summed = RMSNorm.forward(norm, x, residual)
    assert isinstance(out, Fp8Activation) and torch.equal(summed, ref_summed)
    torch.testing.assert_close(out.dequantize(), ref_normed, rtol=0.07, atol=1e-3)
    act = Fp8SiluAndMul(CPU)(torch.randn(3, 128).bfloat16())
    assert act.data.shape == (3, 64) and act.scale.shape == (3, 1)


def _plain_twin(model: nn.Module) -> None:
    """Swap the FP8-writing norms and activations for plain ones with the same weights."""
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            fp8 = getattr(layer, name)
            plain = RMSNorm(fp8.hidden_size, fp8.eps, fp8.weight.dtype, CPU)
            plain.weight.data.copy_(fp8.weight.data)
            setattr(layer, name, plain)
        layer.mlp.act_fn = SiluAndMul(CPU)


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch's CPU ``_scaled_mm`` takes a scale per row from torch 2.13 on; before, only one
    scale per operand."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm_takes_row_scales(),
                    reason="this torch's CPU _scaled_mm takes only per-tensor scales")
def test_model_on_fp8_tensor_cores_equals_it_with_a_quantization_pass(tmp_path: Path) -> None:
    hf = make_hf_model("llama")
    tensors = saved_checkpoint(hf, tmp_path)
    model = LlamaForCausalLM(hf.config, torch.bfloat16, CPU,
                             linear_method=Fp8OnlineLinearMethod("scaled_mm"))
    model.load_weights(tensors.items())
    finish_loading(model)
    layer = model.model.layers[0]
    assert type(layer.input_layernorm) is Fp8RMSNorm and type(layer.mlp.act_fn) is Fp8SiluAndMul
    prompts = [[3, 17, 99, 5, 64, 2, 41], [8, 120, 77]]
    fused = greedy_generate(model, prompts, num_steps=4)
    _plain_twin(model)
    plain = greedy_generate(model, prompts, num_steps=4)
    for a, b in zip(fused, plain, strict=True):
        assert a.generated == b.generated
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))
