"""The fused residual add + RMSNorm kernel against RMSNorm's torch code on the CPU (its
reference); the kernel runs on the GPU when there is one, else under the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kernels.rms_norm import fused_add_rms_norm
from pagedserve.layers.layernorm import RMSNorm

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    norm = RMSNorm(x.shape[1], eps, x.dtype, torch.device("cpu"))
    norm.weight.data.copy_(weight.cpu())
    normed, summed = norm(x.cpu(), residual.cpu())
    return normed, summed


@pytest.mark.parametrize("hidden", [64, 576, 896])  # powers of two and not (SmolLM2, Qwen2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_norm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden).to(dtype)
    residual = (torch.randn(7, hidden) * 20).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    normed, summed = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-5)
    normed, summed = normed.cpu(), summed.cpu()
    ref_normed, ref_summed = reference(x, residual, weight, 1e-5)
    assert normed.dtype == summed.dtype == dtype
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)  # one rounding of the sum
    # Only the order of the fp32 sum of squares differs: bf16 results within one rounding.
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(normed, ref_normed, atol=tol, rtol=tol)


def test_strided_rows() -> None:
    """Rows with a stride (a slice of a wider tensor) read the right elements."""
    wide = torch.randn(5, 96, device=DEVICE)
    x, residual = wide[:, 16:80], torch.randn(5, 64, device=DEVICE)
    weight = torch.rand(64, device=DEVICE) + 0.5
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = reference(x.contiguous(), residual, weight, 1e-6)
    torch.testing.assert_close(summed.cpu(), ref_summed)
    torch.testing.assert_close(normed.cpu(), ref_normed)


def test_no_rows_and_bad_shapes() -> None:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE)

    normed, summed = fused_add_rms_norm(t(0, 32), t(0, 32), t(32), 1e-5)
    assert normed.shape == summed.shape == (0, 32)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(t(3, 32), t(3, 16), t(32), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(t(3, 32), t(3, 32), t(16), 1e-5)


def test_opaque_op_under_torch_compile() -> None:
    """The op compiles (its fake gives the shapes) and the compiled call runs the kernel."""
    from pagedserve.layers import layernorm  # registers pagedserve::fused_add_rms_norm

    assert layernorm is not None
    weight = torch.rand(64, device=DEVICE) + 0.5

    def step(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = torch.ops.pagedserve.fused_add_rms_norm(x * 2, residual, weight, 1e-5)
        return normed + 1, summed

    x, residual = torch.randn(6, 64, device=DEVICE), torch.randn(6, 64, device=DEVICE)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    normed, summed = compiled(x, residual)
    ref_normed, ref_summed = reference(x * 2, residual, weight, 1e-5)
    torch.testing.assert_close(summed.cpu(), ref_summed)
    torch.testing.assert_close(normed.cpu(), ref_normed + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_on_cuda_takes_the_kernel_and_matches_cpu() -> None:
    norm_cpu = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm_cpu.weight.data.copy_(torch.randn(256))
    norm_gpu = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cuda"))
    norm_gpu.weight.data.copy_(norm_cpu.weight.data)
    x, residual = torch.randn(33, 256).bfloat16(), torch.randn(33, 256).bfloat16()
    normed, summed = norm_gpu(x.cuda(), residual.cuda())
    ref_normed, ref_summed = norm_cpu(x, residual)
    torch.testing.assert_close(summed.cpu(), ref_summed, atol=0, rtol=0)
    torch.testing.assert_close(normed.cpu(), ref_normed, atol=8e-3, rtol=8e-3)
