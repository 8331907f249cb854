"""The fused residual add + RMSNorm kernel against RMSNorm's torch code on the CPU (its
reference); the kernel runs on the GPU when there is one, else under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, ON_GPU

from pagedserve.kernels.rms_norm import fused_add_rms_norm
from pagedserve.layers import layernorm
from pagedserve.layers.layernorm import RMSNorm

# Only the order of the fp32 sum of squares differs from torch: results within one rounding.
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return layernorm.add_rms_norm_torch(x.cpu(), residual.cpu(), weight.cpu(), eps)


def check(normed, summed, ref_normed, ref_summed) -> None:  # noqa: ANN001
    assert normed.dtype == summed.dtype == ref_summed.dtype
    torch.testing.assert_close(summed.cpu(), ref_summed, atol=0, rtol=0)  # one rounding
    tol = TOL[ref_summed.dtype]
    torch.testing.assert_close(normed.cpu(), ref_normed, atol=tol, rtol=tol)


@pytest.mark.parametrize("hidden", [64, 576, 896])  # powers of two and not (SmolLM2, Qwen2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_torch_norm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden).to(dtype)
    residual = (torch.randn(7, hidden) * 20).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    out = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-5)
    check(*out, *reference(x, residual, weight, 1e-5))


def test_wide_rows() -> None:
    """hidden 8192 (a 70B model's): one program holds the whole row, 16 warps."""
    x, residual = torch.randn(3, 8192).bfloat16(), torch.randn(3, 8192).bfloat16()
    weight = torch.rand(8192).bfloat16()
    out = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-6)
    check(*out, *reference(x, residual, weight, 1e-6))


def test_strided_rows() -> None:
    """x and residual as slices of wider tensors read the right elements."""
    wide_x, wide_residual = torch.randn(5, 96), torch.randn(5, 80)
    x, residual = wide_x[:, 16:80], wide_residual[:, 8:72]
    weight = torch.rand(64) + 0.5
    out = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-6)
    check(*out, *reference(x.contiguous(), residual.contiguous(), weight, 1e-6))


def test_no_rows_and_bad_shapes() -> None:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE)

    normed, summed = fused_add_rms_norm(t(0, 32), t(0, 32), t(32), 1e-5)
    assert normed.shape == summed.shape == (0, 32)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(t(3, 32), t(3, 16), t(32), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(t(3, 32), t(3, 32), t(16), 1e-5)


def test_the_opaque_op() -> None:
    """torch's checks of a custom op (its fake's shapes and strides against the real outputs),
    then the traced path under torch.compile at several token counts."""
    weight = torch.rand(64, device=DEVICE) + 0.5
    x = torch.randn(6, 64, device=DEVICE)
    torch.library.opcheck(
        torch.ops.pagedserve.fused_add_rms_norm.default, (x, torch.randn_like(x), weight, 1e-5)
    )

    def step(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = layernorm.fused_add_rms_norm(x * 2, residual, weight, 1e-5)
        return normed + 1, summed

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for num_tokens in (1, 5, 9):
        x, residual = torch.randn(num_tokens, 64), torch.randn(num_tokens, 64)
        normed, summed = compiled(x.to(DEVICE), residual.to(DEVICE))
        ref_normed, ref_summed = reference(x * 2, residual, weight, 1e-5)
        check(normed - 1, summed, ref_normed, ref_summed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_on_cuda_runs_the_kernel_and_matches_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = layernorm._kernel()
    monkeypatch.setattr(layernorm, "_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    norm_cpu = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm_cpu.weight.data.copy_(torch.randn(256))
    norm_gpu = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cuda"))
    norm_gpu.weight.data.copy_(norm_cpu.weight.data)
    x, residual = torch.randn(33, 256).bfloat16(), torch.randn(33, 256).bfloat16()
    out = norm_gpu(x.cuda(), residual.cuda())
    assert calls == [1]
    check(*out, *norm_cpu(x, residual))


def test_layer_keeps_the_torch_code_outside_the_kernels_case() -> None:
    """3-D rows, or a weight in another dtype, take the torch code; so does every layer built
    on the CPU (its platform has no Triton kernels)."""
    x, residual = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    assert not layernorm.kernel_applies(x.to(DEVICE), residual.to(DEVICE), torch.ones(64))
    x2 = torch.randn(3, 64, device=DEVICE)
    assert not layernorm.kernel_applies(x2.bfloat16(), x2.bfloat16(), torch.ones(64, device=DEVICE))
    assert layernorm.kernel_applies(x2, x2, torch.ones(64, device=DEVICE))
    assert RMSNorm(64, 1e-5, torch.float32, DEVICE).uses_kernel == ON_GPU
