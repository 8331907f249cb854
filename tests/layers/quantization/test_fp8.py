"""FP8 linear layers: row-wise quantization, the fused layers' scales, the loaders' errors,
and (on an FP8 GPU) ``torch._scaled_mm`` against the dequantized reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    finish_loading,
)
from pagedserve.layers.quantization.fp8 import (
    ONLINE_SCHEME,
    Fp8LinearMethod,
    Fp8OnlineLinearMethod,
    Fp8Scheme,
)
from pagedserve.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    PERSISTENT_MIN_ROWS,
    dequantize_rows,
    quantize_rows,
    quantize_static,
    scaled_mm_linear,
)
from pagedserve.platform.base import FP8_MIN_CAPABILITY

CPU = torch.device("cpu")
F32 = torch.float32
ONLINE = Fp8OnlineLinearMethod("dequantize")
PER_TENSOR_STATIC = Fp8LinearMethod(Fp8Scheme("fp8", "tensor", "static"), "dequantize")
PER_CHANNEL = Fp8LinearMethod(Fp8Scheme("compressed-tensors", "channel", "dynamic"),
                              "dequantize")


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = layer.get_parameter(name)
    param.weight_loader(param, tensor, shard_id)


def _fp8(w: torch.Tensor, scale: float) -> torch.Tensor:
    """Clamped to the FP8 range, as a checkpoint's quantizer does: the cast of a value past it
    is NaN on some CPUs' conversion paths and saturates on others."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def test_quantize_rows_scales_each_row_to_the_fp8_range() -> None:
    # Seeded here: a 1e-3 row whose largest value falls below 1.95e-3 (one draw in six of the
    # global generator, whose state depends on the tests run before) gets MIN_SCALE, not 448.
    values = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    t = values * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [1e4]])
    q, scale = quantize_rows(t)
    assert q.dtype == FP8_DTYPE and scale.dtype == F32 and scale.shape == (5,)
    assert scale[3] == MIN_SCALE and torch.all(q[3].float() == 0)  # an all-zero row
    assert torch.all(q.float().abs().amax(dim=1)[[0, 1, 2, 4]] == FP8_MAX)
    deq = dequantize_rows(q, scale)
    assert torch.all((deq - t).abs() <= t.abs() * 2**-4 + scale[:, None] * 2**-9)


def test_quantize_static_saturates() -> None:
    q = quantize_static(torch.tensor([[1.0, -1000.0, 0.5]]), torch.tensor([0.5]))
    assert q.float().tolist() == [[2.0, -FP8_MAX, 1.0]]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_online_layers_equal_f_linear_on_their_dequantized_weights(tp_size: int) -> None:
    """Each rank quantizes its own slice; every kind of layer computes with exactly its
    dequantized weights."""
    torch.manual_seed(0)
    w, b, x = torch.randn(32, 16), torch.randn(32), torch.randn(3, 16)
    for rank in range(tp_size):
        layers: list[tuple[LinearBase, list[tuple[torch.Tensor, object]]]] = [
            (ColumnParallelLinear(16, 32, True, F32, CPU, rank, tp_size, ONLINE), [(w, None)]),
            (MergedColumnParallelLinear(16, [16, 16], True, F32, CPU, rank, tp_size, ONLINE),
             [(w[:16], 0), (w[16:], 1)]),
            (QKVParallelLinear(16, 4, 4, 2, True, F32, CPU, rank, tp_size, ONLINE),
             [(w[:16], "q"), (w[16:24], "k"), (w[24:], "v")]),
        ]
        for layer, pieces in layers:
            for piece, shard_id in pieces:
                _load(layer, "weight", piece, shard_id)
            _load_bias(layer, b, pieces)
            _check_forward(layer, x)
        row = RowParallelLinear(32, 16, True, F32, CPU, rank, tp_size, lambda t: t, ONLINE)
        _load(row, "weight", w.t().contiguous())
        _load(row, "bias", b[:16])
        _check_forward(row, torch.randn(3, 32 // tp_size))


def _load_bias(layer: LinearBase, b: torch.Tensor, pieces: list) -> None:
    start = 0
    for piece, shard_id in pieces:
        _load(layer, "bias", b[start : start + piece.shape[0]], shard_id)
        start += piece.shape[0]


def _check_forward(layer: LinearBase, x: torch.Tensor) -> None:
    finish_loading(layer)
    assert layer.weight.dtype == FP8_DTYPE
    deq = dequantize_rows(layer.weight, layer.get_buffer("weight_scale"))
    bias = None if isinstance(layer, RowParallelLinear) and layer.tp_rank else layer.bias
    torch.testing.assert_close(layer(x), F.linear(x, deq, bias), rtol=0, atol=0)


def test_per_tensor_scales_of_fused_shards_cover_their_rows() -> None:
    """q, k and v keep their own scales (spread over their rows); the static input scale is
    the largest of the three."""
    torch.manual_seed(0)
    layer = QKVParallelLinear(16, 4, 4, 2, False, F32, CPU, linear_method=PER_TENSOR_STATIC)
    parts = {"q": (torch.randn(16, 16), 0.01), "k": (torch.randn(8, 16), 0.02),
             "v": (torch.randn(8, 16), 0.005)}
    for shard_id, (w, scale) in parts.items():
        _load(layer, "weight", _fp8(w, scale), shard_id)
        _load(layer, "weight_scale", torch.tensor(scale), shard_id)
        _load(layer, "input_scale", torch.tensor([scale * 10]), shard_id)
    finish_loading(layer)
    expected = torch.tensor([0.01] * 16 + [0.02] * 8 + [0.005] * 8)
    torch.testing.assert_close(layer.get_buffer("weight_scale"), expected)
    torch.testing.assert_close(layer.get_buffer("input_scale"), torch.tensor([0.2]))
    assert "weight_scale" not in dict(layer.named_parameters())  # buffers once loaded
    reference = torch.cat([_fp8(w, s).float() * s for w, s in parts.values()])
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, reference), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_per_channel_scales_split_with_the_rows(tp_size: int) -> None:
    torch.manual_seed(0)
    w8 = torch.randn(32, 16).to(FP8_DTYPE)
    scale = torch.rand(32, 1) + 0.5  # as compressed-tensors stores it: [N, 1]
    for rank in range(tp_size):
        column = MergedColumnParallelLinear(16, [16, 16], False, F32, CPU, rank, tp_size,
                                            PER_CHANNEL)
        for i in (0, 1):
            _load(column, "weight", w8[16 * i : 16 * (i + 1)], i)
            _load(column, "weight_scale", scale[16 * i : 16 * (i + 1)], i)
        finish_loading(column)
        rows = [torch.arange(16 * i, 16 * (i + 1)).chunk(tp_size)[rank] for i in (0, 1)]
        torch.testing.assert_close(column.get_buffer("weight_scale"),
                                   scale[torch.cat(rows), 0])
        row = RowParallelLinear(16, 32, False, F32, CPU, rank, tp_size, lambda t: t,
                                PER_CHANNEL)
        _load(row, "weight", w8)
        _load(row, "weight_scale", scale)
        finish_loading(row)
        torch.testing.assert_close(row.get_buffer("weight_scale"), scale[:, 0])  # not split


def test_loader_errors_name_the_problem() -> None:
    layer = ColumnParallelLinear(16, 16, False, F32, CPU, linear_method=PER_TENSOR_STATIC)
    with pytest.raises(ValueError, match="float8_e4m3fn weight .* got torch.bfloat16"):
        _load(layer, "weight", torch.zeros(16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"one scale per tensor, got shape \(16, 1\)"):
        _load(layer, "weight_scale", torch.ones(16, 1))
    with pytest.raises(ValueError, match="shard_id"):
        _load(layer, "weight_scale", torch.ones(1), "q")
    channel = ColumnParallelLinear(16, 16, False, F32, CPU, linear_method=PER_CHANNEL)
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(16,\), got \(1,\)"):
        _load(channel, "weight_scale", torch.ones(1))
    online = ColumnParallelLinear(16, 16, False, F32, CPU, linear_method=ONLINE)
    with pytest.raises(ValueError, match="float8 weight in a checkpoint without"):
        _load(online, "weight", torch.zeros(16, 16, dtype=FP8_DTYPE))


def test_online_scheme_is_per_channel_and_dynamic() -> None:
    assert ONLINE.scheme == ONLINE_SCHEME
    assert (ONLINE_SCHEME.weight_scale, ONLINE_SCHEME.activation) == ("channel", "dynamic")


def _fp8_gpu() -> bool:
    return (torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, PERSISTENT_MIN_ROWS + 76])
def test_scaled_mm_matches_the_dequantized_reference(static: bool, dtype: torch.dtype,
                                                     m: int) -> None:
    """The FP8 tensor-core path against fp32 math on the same quantized operands: the
    activation quantized per token (or with the static scale) as the kernel's input is. The
    largest M runs the persistent TMA kernel on a Hopper card, the others ``_scaled_mm``."""
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    x = torch.randn(m, 256, device=cuda).to(dtype)
    w, w_scale = quantize_rows(torch.randn(384, 256, device=cuda) * 0.05)
    bias = torch.randn(384, device=cuda).to(dtype)
    input_scale = x.float().abs().amax().reshape(1) / FP8_MAX if static else None
    out = scaled_mm_linear(x, w, w_scale, input_scale, bias)
    if static:
        assert input_scale is not None
        xq, x_scale = quantize_static(x, input_scale), input_scale.expand(m)
    else:  # the Triton kernel's bytes: quantize_rows' on the CPU. On CUDA, torch divides by
        # the Python scalar FP8_MAX as a multiply by its reciprocal, a rounding step off.
        xq, x_scale = (t.to(cuda) for t in quantize_rows(x.cpu()))
    ref = dequantize_rows(xq, x_scale) @ dequantize_rows(w, w_scale).t() + bias.float()
    assert out.dtype == dtype and out.shape == (m, 384)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores")
def test_fp8_layer_on_the_gpu_stays_close_to_bf16() -> None:
    """An online-quantized layer on tensor cores against the bf16 layer it came from."""
    torch.manual_seed(0)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    w = torch.randn(512, 256, device=cuda, dtype=bf16) * 0.05
    method: LinearMethod = Fp8OnlineLinearMethod("scaled_mm")
    layer = ColumnParallelLinear(256, 512, False, bf16, cuda, linear_method=method)
    _load(layer, "weight", w)
    finish_loading(layer)
    x = torch.randn(16, 256, device=cuda, dtype=bf16)
    ref = F.linear(x, w).float()
    error = (layer(x).float() - ref).norm() / ref.norm()
    assert error < 0.05


def test_scaled_mm_linear_compiles_with_an_unbacked_token_count() -> None:
    """Compiled pieces see the token count as an unbacked size; ``_scaled_mm``'s shape checks
    would guard on it, so the FP8 GEMM runs as an opaque op (``pagedserve::fp8_linear``).
    On the card where there is one: torch's CPU ``_scaled_mm`` takes row-wise scales only from
    2.13 on."""
    torch.manual_seed(0)
    device = torch.device("cuda" if _fp8_gpu() else "cpu")
    weight, weight_scale = quantize_rows(torch.randn(32, 64, device=device))
    x = torch.randn(5, 64, dtype=torch.bfloat16, device=device)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return scaled_mm_linear(t, weight, weight_scale, None, None)

    torch._dynamo.decorators.mark_unbacked(x, 0)
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), forward(x), rtol=0, atol=0)
