"""Matrix-vector products for decode steps of one token, with the work around them fused in.

At batch 1 a decode step is a weight read, and the kernels between the weight reads decide how
far from the floor it lands: the compiled path runs ~19 kernels per Llama layer (cuBLAS picks a
split-K GEMM plus a reduce kernel for one row, RMSNorm is a reduction and a pointwise kernel,
rotary embedding four, ...). Here each linear layer of a decoder layer is one launch that reads
its weight rows once and does the small work before and after it:

- prologue: RMSNorm of the input row (each program sums the row's squares as it streams the
  row past its weight tiles, and scales its sums by 1/rms at the end);
- epilogue: residual add (o_proj, down_proj), SiLU(gate) * up (gate_up_proj: the program
  owning output ``n`` reads weight rows ``n`` and ``n + I``), or rotary embedding plus the KV
  write (qkv_proj: the program owning dimension pair ``(j, j + D/2)`` of a head rotates it and
  stores queries to ``q_out``, keys and values straight into the paged cache; an FP8 cache
  gets them divided by its ``k_scale`` / ``v_scale`` and saturated, as
  ``kernels/rope_kv_write.py`` writes them).

``x`` is one row [1, K] (a decode step of one token: batch 1); weights are nn.Linear's [N, K],
row-major, in x's dtype, or float8_e4m3fn with an fp32 ``weight_scale`` per row (FP8 weights:
half the bytes to read; each row's sum is scaled once, the activation stays unquantized).
Sums are fp32, outputs x's dtype. On Hopper each kernel is launched with
programmatic dependent launch: it starts, and fetches its first weight tile, while the kernel
before it finishes, then waits for that kernel's writes (``gdc_wait``) before reading its
input. (Only a GEMV before it lets it start early: gate/up, down and the next layer's QKV
overlap their predecessor; o_proj follows the attention kernels, which do not trigger it.)

Rounding differs a little from the torch layers these replace, always towards more precision:
the norm's 1/rms and weight scale the fp32 sums instead of a bf16-rounded input, and the
residual add takes the product before it is rounded. So a batch-1 step's logits are close to,
not bit-equal with, the compiled forward's (the tests bound the difference).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_common import FP8_KV_DTYPE, cache_scales, check_kv_cache, to_cache
from pagedserve.kernels.interpreter_compat import INTERPRETING
from pagedserve.platform import platform_for

EPILOGUE_STORE = tl.constexpr(0)  # out = acc (+ bias) (+ residual)
EPILOGUE_SILU_MUL = tl.constexpr(1)  # out = silu(acc_gate) * acc_up
EPILOGUE_ROPE_KV = tl.constexpr(2)  # rotate q/k pairs; q -> q_out, k/v -> the KV cache


@triton.jit
def _accumulate(part_a, part_b, sum_sq, wa, wb, x_ptr, norm_ptr, k, K,
                PAIRED: tl.constexpr, NORM: tl.constexpr, W_VIA: tl.constexpr):
    """One K tile: partial products per lane ([BLOCK_N, BLOCK_K], summed once after the loop)
    and, for the RMSNorm prologue, the input's partial sum of squares. Weights widen to fp32
    through ``W_VIA`` (fp16 is exact for FP8 weights)."""
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if NORM:
        sum_sq += x * x
        x = x * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    part_a += wa.to(W_VIA).to(tl.float32) * x[None, :]
    if PAIRED:
        part_b += wb.to(W_VIA).to(tl.float32) * x[None, :]
    return part_a, part_b, sum_sq


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] the input row
    w_ptr,  # [N_rows, K] weight
    out_ptr,  # [N_out] (STORE, SILU_MUL) or queries [NUM_Q * HEAD_DIM] (ROPE_KV)
    bias_ptr,  # [N_rows] or unused
    scale_ptr,  # fp32 [N_rows]: FP8 weights' scale per row (HAS_SCALE) or unused
    res_ptr,  # [N_out] residual (ADD_RESIDUAL) or unused
    norm_ptr,  # [K] RMSNorm weight (NORM) or unused
    cos_sin_ptr,  # [max_position, HEAD_DIM]: cos half | sin half (ROPE_KV)
    positions_ptr,  # int64 [>= 1] (ROPE_KV)
    slot_ptr,  # int64 [>= 1], < 0: a padding row, nothing written (ROPE_KV)
    cache_ptr,  # [2, num_blocks, block_size, NUM_KV, HEAD_DIM] (ROPE_KV)
    K,
    N_out,  # output columns (STORE, SILU_MUL: also the row offset of the up half)
    eps,
    k_scale,  # an FP8 cache's scales (ROPE_KV; unused for a cache in the model's dtype)
    v_scale,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_off,
    BLOCK_SIZE: tl.constexpr,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_VIA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (dimension pairs: ROPE_KV)
    PAIRED: tl.constexpr = EPILOGUE != EPILOGUE_STORE
    HALF: tl.constexpr = HEAD_DIM // 2
    head = (pid * BLOCK_N) // HALF  # ROPE_KV: BLOCK_N divides HALF, one head per program
    j = cols % HALF
    if EPILOGUE == EPILOGUE_ROPE_KV:
        rows_a = head * HEAD_DIM + j
        col_mask = j < HALF
        rows_b = rows_a + HALF
    else:
        rows_a = cols
        col_mask = cols < N_out
        rows_b = cols + N_out
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * K
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * K

    # The first weight tile does not depend on the previous kernel: with programmatic
    # dependent launch it is in flight while that kernel finishes.
    k = tl.arange(0, BLOCK_K)
    w_mask = col_mask[:, None] & (k[None, :] < K)
    wa = tl.load(wa_ptrs + k[None, :], mask=w_mask, other=0.0)
    wb = wa
    if PAIRED:
        wb = tl.load(wb_ptrs + k[None, :], mask=w_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (our input) are visible now
        tl.extra.cuda.gdc_launch_dependents()

    part_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    part_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    part_a, part_b, sum_sq = _accumulate(part_a, part_b, sum_sq, wa, wb, x_ptr, norm_ptr, k, K,
                                         PAIRED, NORM, W_VIA)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w_mask = col_mask[:, None] & (k[None, :] < K)
        wa = tl.load(wa_ptrs + k[None, :], mask=w_mask, other=0.0)
        if PAIRED:
            wb = tl.load(wb_ptrs + k[None, :], mask=w_mask, other=0.0)
        part_a, part_b, sum_sq = _accumulate(part_a, part_b, sum_sq, wa, wb, x_ptr, norm_ptr,
                                             k, K, PAIRED, NORM, W_VIA)
    acc_a = tl.sum(part_a, axis=1)  # [BLOCK_N]
    acc_b = tl.sum(part_b, axis=1)
    if NORM:  # RMSNorm(x) = x * gamma / rms(x): the 1 / rms factor comes out of the sum
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        acc_a = acc_a * rstd
        acc_b = acc_b * rstd
    if HAS_SCALE:  # FP8 weights: w = w_fp8 * scale[row], so each row's sum scales once
        acc_a = acc_a * tl.load(scale_ptr + rows_a, mask=col_mask, other=0.0)
        if PAIRED:
            acc_b = acc_b * tl.load(scale_ptr + rows_b, mask=col_mask, other=0.0)
    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + rows_a, mask=col_mask, other=0.0).to(tl.float32)
        if PAIRED:
            acc_b += tl.load(bias_ptr + rows_b, mask=col_mask, other=0.0).to(tl.float32)

    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == EPILOGUE_STORE:
        if ADD_RESIDUAL:
            acc_a += tl.load(res_ptr + cols, mask=col_mask).to(tl.float32)
        tl.store(out_ptr + cols, acc_a.to(dtype), mask=col_mask)
    elif EPILOGUE == EPILOGUE_SILU_MUL:
        # SiluAndMul's rounding steps: both halves rounded to the model dtype first.
        gate = acc_a.to(dtype).to(tl.float32)
        up = acc_b.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        tl.store(out_ptr + cols, act.to(dtype), mask=col_mask)
    else:
        a = acc_a.to(dtype).to(tl.float32)
        b = acc_b.to(dtype).to(tl.float32)
        if head < NUM_Q + NUM_KV:  # queries and keys rotate, values do not
            pos = tl.load(positions_ptr).to(tl.int64)
            cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + j).to(tl.float32)
            sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + j).to(tl.float32)
            a, b = a * cos - b * sin, b * cos + a * sin
        if head < NUM_Q:
            tl.store(out_ptr + head * HEAD_DIM + j, a.to(dtype))
            tl.store(out_ptr + head * HEAD_DIM + HALF + j, b.to(dtype))
        else:
            kv_head = head - NUM_Q  # 0..NUM_KV-1: keys, NUM_KV..2*NUM_KV-1: values
            slot = tl.load(slot_ptr)
            if slot >= 0:
                dst = (cache_ptr + (kv_head // NUM_KV) * stride_cache_kv
                       + (slot // BLOCK_SIZE) * stride_cache_block
                       + (slot % BLOCK_SIZE) * stride_cache_off + (kv_head % NUM_KV) * HEAD_DIM
                       + j)
                kv_scale = tl.where(kv_head < NUM_KV, k_scale, v_scale)
                tl.store(dst, to_cache(a.to(dtype), kv_scale, dst))
                tl.store(dst + HALF, to_cache(b.to(dtype), kv_scale, dst))


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    """Output columns per program (dimension pairs for the paired epilogues)."""
    block_k: int
    num_warps: int
    num_stages: int = 1
    weight_via: str = "float32"
    """The type weights widen through before the fp32 products: "float32" (directly), or
    "float16" (FP8 weights only; exact for float8_e4m3fn)."""


DEFAULT_CONFIGS = {
    int(EPILOGUE_STORE): GemvConfig(block_n=4, block_k=1024, num_warps=4),
    int(EPILOGUE_SILU_MUL): GemvConfig(block_n=8, block_k=256, num_warps=4),
    int(EPILOGUE_ROPE_KV): GemvConfig(block_n=8, block_k=512, num_warps=4),
}
"""Fastest tiles of ``python benchmarks/gemv_sweep.py`` on an H200, Llama-3-8B shapes (o_proj and
down_proj, gate/up, QKV); docs/gpu.md#one-token-steps-gemv has the figures."""

FP8_CONFIGS = {
    int(EPILOGUE_STORE): GemvConfig(block_n=8, block_k=1024, num_warps=4,
                                    weight_via="float16"),  # o_proj + down_proj
    int(EPILOGUE_SILU_MUL): GemvConfig(block_n=4, block_k=1024, num_warps=4,
                                       weight_via="float16"),  # gate_up
    int(EPILOGUE_ROPE_KV): GemvConfig(block_n=4, block_k=512, num_warps=4,
                                      weight_via="float16"),  # qkv
}
"""Tiles for float8_e4m3fn weights: the winners of ``python benchmarks/gemv_sweep.py --weights
fp8`` on an H200, Llama-3-8B shapes (docs/gpu.md). Widening FP8 through fp16 (exact) beat the
direct widening to fp32 on every shape."""


def tile_config(epilogue: int, weight_dtype: torch.dtype) -> GemvConfig:
    """The default tile of a kernel (``EPILOGUE_*``) reading weights of ``weight_dtype``."""
    table = FP8_CONFIGS if weight_dtype == torch.float8_e4m3fn else DEFAULT_CONFIGS
    return table[int(epilogue)]


@functools.cache
def uses_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper and newer, compiled kernels only (the
    interpreter cannot run ``griddepcontrol``)."""
    if INTERPRETING:
        return False
    return platform_for(device).compute_capability() >= (9, 0)


def _check_row(x: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected "
                         "one row [1, K] and [N, K]")
    if not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError("x and weight must be contiguous")
    weight_dtype = x.dtype if weight_scale is None else torch.float8_e4m3fn
    if weight.dtype != weight_dtype or x.device != weight.device:
        raise ValueError(f"x is {x.dtype} on {x.device}, weight {weight.dtype} on "
                         f"{weight.device} (expected {weight_dtype})")
    if weight_scale is not None and (
        weight_scale.dtype != torch.float32 or weight_scale.numel() != weight.shape[0]
        or not weight_scale.is_contiguous()
    ):
        raise ValueError(f"weight_scale: expected {weight.shape[0]} contiguous fp32 values, "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")


def _launch(num_cols: int, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
            n_out: int, epilogue: tl.constexpr, config: GemvConfig | None,
            bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            rope: tuple | None = None, weight_scale: torch.Tensor | None = None) -> None:
    """One program per ``block_n`` of the ``num_cols`` output columns (or pairs)."""
    k = x.shape[1]
    for name, t, numel in (("bias", bias, weight.shape[0]), ("residual", residual, n_out),
                           ("norm_weight", norm_weight, k)):
        if t is not None and (t.numel() != numel or not t.is_contiguous()):
            raise ValueError(f"{name}: expected {numel} contiguous values, got "
                             f"{tuple(t.shape)}")
    cfg = config or tile_config(int(epilogue), weight.dtype)
    if cfg.weight_via not in ("float32", "float16") or (
        cfg.weight_via == "float16" and weight_scale is None
    ):
        raise ValueError(f"weight_via {cfg.weight_via!r}: float32, or float16 for FP8 weights")
    if rope is None:
        cos_sin = positions = slots = cache = out
        block_size, num_q, num_kv, head_dim, cache_strides = 1, 1, 1, 2, (0, 0, 0)
        kv_scales = (1.0, 1.0)
    else:
        cos_sin, positions, slots, cache, num_q, num_kv, head_dim, k_scale, v_scale = rope
        kv_scales = cache_scales(cache, k_scale, v_scale)
        block_size = cache.shape[2]
        cache_strides = (cache.stride(0), cache.stride(1), cache.stride(2))
        if (head_dim // 2) % cfg.block_n:
            raise ValueError(f"block_n {cfg.block_n} must divide head_dim / 2 = {head_dim // 2}")
    use_pdl = uses_pdl(x.device)
    _gemv_kernel[(triton.cdiv(num_cols, cfg.block_n),)](
        x, weight, out,
        out if bias is None else bias,
        out if weight_scale is None else weight_scale,
        out if residual is None else residual,
        out if norm_weight is None else norm_weight,
        cos_sin, positions, slots, cache, k, n_out, eps, *kv_scales, *cache_strides,
        BLOCK_SIZE=block_size, NUM_Q=num_q, NUM_KV=num_kv, HEAD_DIM=head_dim,
        EPILOGUE=epilogue, NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None, ADD_RESIDUAL=residual is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_VIA=getattr(tl, cfg.weight_via),
        USE_PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=use_pdl,
    )  # fmt: skip


def linear_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None,
               config: GemvConfig | None = None, *,
               weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias [N]) (+ residual [1, N]) -> [1, N]. ``weight_scale``
    fp32 [N]: the weight is float8_e4m3fn, each row times its scale (module docstring)."""
    _check_row(x, weight, weight_scale)
    n = weight.shape[0]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _launch(n, x, weight, out, n, EPILOGUE_STORE, config, bias=bias, residual=residual,
            weight_scale=weight_scale)
    return out


def rmsnorm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: GemvConfig | None = None, *,
                         weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u with [g | u] = RMSNorm(x) @ gate_up_weight^T: x [1, K], weight [2 I, K]
    -> [1, I]. ``weight_scale``: as ``linear_row``'s."""
    _check_row(x, gate_up_weight, weight_scale)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight: {gate_up_weight.shape[0]} rows, expected gate and "
                         "up halves of equal size")
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty((1, inter), dtype=x.dtype, device=x.device)
    _launch(inter, x, gate_up_weight, out, inter, EPILOGUE_SILU_MUL, config, bias=bias,
            norm_weight=norm_weight, eps=eps, weight_scale=weight_scale)
    return out


def rmsnorm_qkv_rope_kv_write(
    x: torch.Tensor,  # [1, K] the residual stream
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    qkv_weight: torch.Tensor,  # [(NUM_Q + 2 NUM_KV) * D, K]: q heads | k heads | v heads
    bias: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,  # [max_position, D]: cos half | sin half
    positions: torch.Tensor,  # int64 [>= 1]
    slot_mapping: torch.Tensor,  # int64 [>= 1], < 0: a padding row
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, NUM_KV, D]
    num_heads: int,
    config: GemvConfig | None = None,
    *,
    weight_scale: torch.Tensor | None = None,  # fp32 [rows of qkv_weight]: as linear_row's
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Queries [1, NUM_Q * D], rotated; the key (rotated) and value land in ``kv_cache`` (an FP8
    cache's divided by ``k_scale`` / ``v_scale``)."""
    _check_row(x, qkv_weight, weight_scale)
    check_kv_cache(kv_cache)
    num_kv, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if qkv_weight.shape[0] != (num_heads + 2 * num_kv) * head_dim:
        raise ValueError(f"qkv_weight: {qkv_weight.shape[0]} rows, expected "
                         f"({num_heads} + 2 * {num_kv}) * {head_dim}")
    if not kv_cache.is_contiguous() or kv_cache.dtype not in (x.dtype, FP8_KV_DTYPE):
        raise ValueError("kv_cache: must be contiguous and of x's dtype or float8_e4m3fn")
    if cos_sin_cache.shape[1] != head_dim or not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache: expected contiguous [max_position, {head_dim}]")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    q = torch.empty((1, num_heads * head_dim), dtype=x.dtype, device=x.device)
    _launch(qkv_weight.shape[0] // 2, x, qkv_weight, q, 0, EPILOGUE_ROPE_KV, config,
            bias=bias, norm_weight=norm_weight, eps=eps,
            rope=(cos_sin_cache, positions, slot_mapping, kv_cache, num_heads, num_kv,
                  head_dim, k_scale, v_scale), weight_scale=weight_scale)
    return q
