"""An FP8 GEMM in Triton: ``out = (a * a_scale) @ (b * b_scale)^T``, scales in the epilogue.

``a`` is the activation, float8_e4m3fn [M, K]; ``b`` the weight, float8_e4m3fn [N, K] (an
nn.Linear's layout); the scales are fp32, either one per row of ``a`` ([M, 1]) and one per row
of ``b`` ([N, 1]) (row-wise: per token x per output channel, the engine's scheme) or one per
tensor (one element each); the output is bf16 [M, N]. Each program owns a BLOCK_M x BLOCK_N
tile of the output, sums FP8 tile products in fp32 over K (``tl.dot`` on float8e4nv operands:
Hopper's FP8 tensor cores) and multiplies by ``a_scale[m] * b_scale[n]`` once at the end: the
scales are constant along K, so scaling the sum equals scaling every product.

A per-tensor scale is read through a stride of 0, so both scalings run the same code (no flag).
Programs are ordered in groups of GROUP_M row tiles, so consecutive programs share the same
``b`` tiles in L2 (the weight is the large operand at decode-sized M).

``fp8_gemm_persistent`` computes the same product with one wave of programs (one per SM), each
looping over output tiles, its operand tiles loaded by the tensor memory accelerator (TMA,
zero-filled past the edges; Hopper and newer) and its output tile stored by it (clipped at
the edges). The engine's FP8 linear layers run it from a few hundred tokens up
(``layers/quantization/fp8_ops.PERSISTENT_MIN_ROWS``), ``torch._scaled_mm`` below that, with
the launch shape of ``persistent_config_for``.

``benchmarks/fp8_gemm_sweep.py`` times both kernels against ``torch._scaled_mm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import sm_count

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch shape: the output tile, the K step, row-tile grouping, warps and pipeline
    depth (tl.dot on FP8 needs BLOCK_K >= 32 and every block >= 16)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {value}")
        if self.block_k < 32:
            raise ValueError(f"block_k: FP8 dots need at least 32, got {self.block_k}")
        if self.group_m < 1:
            raise ValueError(f"group_m: must be >= 1, got {self.group_m}")


# Launch shapes the sweep tries (no autotuning in the engine: the sweep picks per shape).
# Small tiles for decode-sized M (many programs over N), large ones for prefill-sized M.
FP8_GEMM_CONFIGS = (
    Fp8GemmConfig(16, 64, 256, 1, 4, 4),
    Fp8GemmConfig(32, 128, 128, 4, 4, 4),
    Fp8GemmConfig(64, 128, 128, 8, 4, 4),
    Fp8GemmConfig(64, 256, 128, 8, 8, 3),
    Fp8GemmConfig(128, 128, 128, 8, 8, 3),
    Fp8GemmConfig(128, 256, 128, 8, 8, 3),
)
DEFAULT_FP8_GEMM_CONFIG = FP8_GEMM_CONFIGS[4]
# Launch shapes of the persistent TMA kernel (M of a few hundred tokens and up): each fits a
# Hopper SM's 227 KB of shared memory with its pipeline stages and the staged output tile. The
# first is the engine's wide tiles and the fourth its narrow ones (persistent_config_for): in
# benchmarks/fp8_gemm_sweep.py on an H100 the engine's pick was the fastest of these or within
# 10% of it on Llama-3-8B's shapes at 384-8,192 tokens (docs/gpu.md#fp8-gemms).
PERSISTENT_CONFIGS = (
    Fp8GemmConfig(128, 256, 128, 8, 8, 3),
    Fp8GemmConfig(128, 256, 64, 8, 8, 4),
    Fp8GemmConfig(128, 128, 128, 8, 8, 4),
    Fp8GemmConfig(128, 128, 128, 8, 4, 4),
    Fp8GemmConfig(256, 128, 128, 8, 8, 3),
)
WIDE_TILES = PERSISTENT_CONFIGS[0]
NARROW_TILES = PERSISTENT_CONFIGS[3]


def output_tiles(m: int, n: int, config: Fp8GemmConfig) -> int:
    """Output tiles of an [M, N] product at ``config``'s tile shape."""
    return triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)


def wave_fill(m: int, n: int, config: Fp8GemmConfig, sms: int) -> float:
    """The share of the SM slots of all waves that hold a tile: tiles / (waves x SMs) (only
    the last wave has idle slots)."""
    tiles = output_tiles(m, n, config)
    return tiles / (triton.cdiv(tiles, sms) * sms)


def persistent_config_for(m: int, n: int, sms: int) -> Fp8GemmConfig:
    """The persistent kernel's launch shape for an [M, N] output on ``sms`` SMs: 128 x 256
    tiles, or 128 x 128 ones where those fill the SM slots by more than 0.1 better
    (``wave_fill``): an output of few tiles, mid-sized M or narrow N, where the wide tiles
    leave SMs idle."""
    if wave_fill(m, n, NARROW_TILES, sms) > wave_fill(m, n, WIDE_TILES, sms) + 0.1:
        return NARROW_TILES
    return WIDE_TILES


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of output tile number ``tile``, numbered down groups of GROUP_M row
    tiles so consecutive tiles share ``b``'s column tiles."""
    group = tile // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % (GROUP_M * tiles_n)) % group_size
    tile_n = (tile % (GROUP_M * tiles_n)) // group_size
    return tile_m, tile_n


@triton.jit
def _scaled(acc, rows, cols, a_scale_ptr, b_scale_ptr, M, N, stride_as, stride_bs):
    """acc [BLOCK_M, BLOCK_N] of output rows ``rows`` and columns ``cols`` times
    a_scale[row] * b_scale[col] (a stride of 0: one scale for the tensor)."""
    a_scale = tl.load(a_scale_ptr + rows * stride_as, mask=rows < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols * stride_bs, mask=cols < N, other=0.0)
    return acc * a_scale[:, None] * b_scale[None, :]


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # float8 [M, K]
    b_ptr,  # float8 [N, K]
    out_ptr,  # bf16 [M, N]
    a_scale_ptr,  # fp32 [M] (stride 1) or [1] (stride 0)
    b_scale_ptr,  # fp32 [N] (stride 1) or [1] (stride 0)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    stride_as,
    stride_bs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile_m, tile_n = _grouped_tile(
        tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M
    )
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_tile = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    b_tile = b_ptr + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        a = tl.load(a_tile + k, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_tile + k, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)

    out = _scaled(acc, rows, cols, a_scale_ptr, b_scale_ptr, M, N, stride_as, stride_bs)
    dst = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(dst, out.to(tl.bfloat16), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _scale_stride(scale: torch.Tensor, rows: int, name: str) -> int:
    """0 for one scale per tensor, 1 for one per row (``rows`` of them, contiguous)."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: must be float32, got {scale.dtype}")
    if scale.numel() == 1:
        return 0
    if scale.numel() != rows or not scale.is_contiguous():
        raise ValueError(f"{name}: one scale or {rows} contiguous ones, got {list(scale.shape)}")
    return 1


def _check_operands(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """(M, N, K, a_scale's stride, b_scale's stride) of valid operands; ValueError naming the
    operand else."""
    for name, t in (("a", a), ("b", b)):
        if t.dtype != FP8_DTYPE or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: a row-major float8_e4m3fn matrix, got {t.dtype} "
                             f"{list(t.shape)} strides {t.stride()}")  # fmt: skip
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"b: K = {b.shape[1]} differs from a's {k}")
    return m, n, k, _scale_stride(a_scale, m, "a_scale"), _scale_stride(b_scale, n, "b_scale")


def fp8_gemm(
    a: torch.Tensor,  # float8_e4m3fn [M, K]
    a_scale: torch.Tensor,  # fp32 [M, 1] or one element
    b: torch.Tensor,  # float8_e4m3fn [N, K]
    b_scale: torch.Tensor,  # fp32 [N, 1] or one element
    config: Fp8GemmConfig = DEFAULT_FP8_GEMM_CONFIG,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T as bf16 [M, N]; rows of ``a`` and ``b`` contiguous."""
    m, n, k, stride_as, stride_bs = _check_operands(a, a_scale, b, b_scale)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _fp8_gemm_kernel[grid](
        a, b, out, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        stride_as, stride_bs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["M", "num_programs"])
def _fp8_gemm_persistent_kernel(
    a_desc,  # TMA descriptor of float8 [M, K], blocks [BLOCK_M, BLOCK_K]
    b_desc,  # TMA descriptor of float8 [N, K], blocks [BLOCK_N, BLOCK_K]
    out_desc,  # TMA descriptor of bf16 [M, N], blocks [BLOCK_M, BLOCK_N]
    a_scale_ptr,  # fp32 [M] (stride 1) or [1] (stride 0)
    b_scale_ptr,  # fp32 [N] (stride 1) or [1] (stride 0)
    M,
    N,
    K,
    stride_as,
    stride_bs,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    # Program p computes output tiles p, p + num_programs, ...: one wave of programs, each
    # loading its next tile's operands while the previous tile's epilogue stores.
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        tile_m, tile_n = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = a_desc.load([tile_m * BLOCK_M, k * BLOCK_K])  # [BLOCK_M, BLOCK_K], 0 past K
            b = b_desc.load([tile_n * BLOCK_N, k * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(a, b.T, acc)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        out = _scaled(acc, rows, cols, a_scale_ptr, b_scale_ptr, M, N, stride_as, stride_bs)
        out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], out.to(tl.bfloat16))  # clipped


def fp8_gemm_persistent(
    a: torch.Tensor,  # float8_e4m3fn [M, K]
    a_scale: torch.Tensor,  # fp32 [M, 1] or one element
    b: torch.Tensor,  # float8_e4m3fn [N, K]
    b_scale: torch.Tensor,  # fp32 [N, 1] or one element
    config: Fp8GemmConfig | None = None,
    num_programs: int | None = None,
) -> torch.Tensor:
    """``fp8_gemm`` with the operands loaded by the tensor memory accelerator (TMA: one
    instruction per tile, edges filled with zeros) and one wave of ``num_programs`` programs
    (default: one per SM) looping over the output tiles; ``config`` defaults to
    ``persistent_config_for`` the output. Rows of ``a``, ``b`` and the output
    must start 16-byte aligned (K and N multiples of 16)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n, k, stride_as, stride_bs = _check_operands(a, a_scale, b, b_scale)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    sms = sm_count(a.device)
    c = config or persistent_config_for(m, n, sms)
    a_desc = TensorDescriptor.from_tensor(a, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(b, [c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    programs = min(output_tiles(m, n, c), num_programs or sms)
    _fp8_gemm_persistent_kernel[(programs,)](
        a_desc, b_desc, out_desc, a_scale, b_scale, m, n, k, stride_as, stride_bs, programs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out
