"""min-p, top-k and top-p as per-row cuts (``Cuts``), found without sorting the vocabulary.

The kept set is the one of the torch reference (``pagedserve/sample/topk_topp.py``), applied in
its order to the temperature-scaled logits x:
  min-p: keep x >= max(x) + log(min_p) (the same fp32 sum);
  top-k: keep x >= the k-th largest of what min-p kept (ties with it stay) -- exact, by counts;
  top-p: over what top-k kept, keep a token when the softmax mass of the tokens before it
         (larger logit, or equal logit and larger index: the reference's stable sort) is
         below p; the first token always stays. Exact up to the rounding of the mass sums
         (fp32 block sums added in fp64 here, an fp32 cumsum in the reference, which already
         differs between torch on CPU and on CUDA): only a token whose boundary mass lies
         within about 1e-6 of p can go either way.
One program per row; see ``sampling_search`` for the search itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.sampling_common import NEG_INF, Cuts, SlotParams, precise_log
from pagedserve.kernels.sampling_search import row_max_min, search_threshold, tie_cut_index

_BLOCK = 512  # tokens per loop iteration; a pass also holds a [_BLOCK, _NUM_PIVOTS] tile
_NUM_PIVOTS = 16
DEFAULT_BUFFER_SIZE = 4096  # per-row scratch: once the candidates fit, passes read only them


@triton.jit
def _top_p_cut(
    row_ptr, buf_ptr, n_buf, vocab_size, temperature, floor, row_max, row_min, top_p, n_cand,
    BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, BUF_CAP: tl.constexpr,
):
    """(value, index) of the top-p cut over the tokens >= floor (see ``Cuts``)."""
    # The reference drops a token when the mass up to it, from the bottom, is <= 1 - top_p
    # (computed in fp32): it keeps a token while the mass before it is below 1 - (1 - top_p).
    kept_mass = 1.0 - (1.0 - top_p).to(tl.float64)
    t, _, weight_above, ties, target, _ = search_threshold(
        row_ptr, buf_ptr, n_buf, vocab_size, temperature, floor, row_max, row_min,
        0.0, kept_mass, n_cand, True, BLOCK, NUM_PIVOTS, BUF_CAP,
    )
    # The j-th tied token from the top (j = 0, 1, ...) has weight_above + j * e before it; it
    # stays while that is below target.
    e = tl.exp(t - row_max).to(tl.float64)
    n_keep = tl.minimum(tl.ceil((target - weight_above) / e), ties.to(tl.float64))
    n_drop = ties - n_keep.to(tl.int32)
    index = tl.zeros([], tl.int32)
    if n_drop > 0:
        index = tie_cut_index(row_ptr, vocab_size, temperature, t, n_drop, BLOCK)
    return t, index


@triton.jit
def _truncation_kernel(
    logits_ptr,  # [num_rows, V], any float dtype
    logits_stride,
    idx_mapping_ptr,  # int64 [num_rows]
    temperature_ptr,  # fp32 [max_num_reqs]
    greedy_ptr,  # bool [max_num_reqs]
    top_k_ptr,  # int64 [max_num_reqs]
    top_p_ptr,  # fp32 [max_num_reqs]
    min_p_ptr,  # fp32 [max_num_reqs]
    buf_ptr,  # fp32 [num_rows, BUF_CAP], scratch
    cut_value_ptr,  # fp32 [num_rows] (out)
    cut_index_ptr,  # int32 [num_rows] (out)
    vocab_size,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    BUF_CAP: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row)
    temperature = tl.load(temperature_ptr + slot)
    top_k = tl.load(top_k_ptr + slot).to(tl.int32)
    top_p = tl.load(top_p_ptr + slot)
    min_p = tl.load(min_p_ptr + slot)
    greedy = tl.load(greedy_ptr + slot)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    buf = buf_ptr + row.to(tl.int64) * BUF_CAP
    cut_value = tl.full([], NEG_INF, tl.float32)
    cut_index = tl.zeros([], tl.int32)
    if (greedy == 0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)):
        row_max, row_min = row_max_min(row_ptr, vocab_size, temperature, BLOCK)
        if row_max > NEG_INF:
            log_min_p = precise_log(tl.where(min_p > 0.0, min_p, 1.0))
            cut_value = tl.where(min_p > 0.0, row_max + log_min_p, NEG_INF)
            n_buf = tl.full([], -1, tl.int32)  # tokens in the scratch buffer; -1: none yet
            n_cand = vocab_size + BUF_CAP  # valid tokens above the search's lower end: unknown
            if top_k > 0:
                t, n_cand, _, _, _, n_buf = search_threshold(
                    row_ptr, buf, n_buf, vocab_size, temperature, cut_value, row_max, row_min,
                    top_k.to(tl.float32), 0.0, n_cand, False, BLOCK, NUM_PIVOTS, BUF_CAP,
                )
                cut_value = tl.maximum(cut_value, t)
            if top_p < 1.0:
                cut_value, cut_index = _top_p_cut(
                    row_ptr, buf, n_buf, vocab_size, temperature, cut_value, row_max, row_min,
                    top_p, n_cand, BLOCK, NUM_PIVOTS, BUF_CAP,
                )
    tl.store(cut_value_ptr + row, cut_value)
    tl.store(cut_index_ptr + row, cut_index)


def truncation_cuts(
    logits: torch.Tensor,  # [num_rows, V], any float dtype, unit stride along V
    idx_mapping: torch.Tensor,  # int64 [num_rows]
    params: SlotParams,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> Cuts:
    """Each row's min-p / top-k / top-p cut (greedy rows and rows without truncation: -inf)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [num_rows, V] with unit stride along V, got "
                         f"shape {list(logits.shape)} strides {list(logits.stride())}")
    if buffer_size < 1 or buffer_size & (buffer_size - 1):
        raise ValueError(f"buffer_size: expected a power of two, got {buffer_size}")
    num_rows, vocab_size = logits.shape
    cuts = Cuts(
        value=torch.empty(num_rows, dtype=torch.float32, device=logits.device),
        tie_index=torch.empty(num_rows, dtype=torch.int32, device=logits.device),
    )
    if num_rows == 0:
        return cuts
    scratch = torch.empty(num_rows, buffer_size, dtype=torch.float32, device=logits.device)
    _truncation_kernel[(num_rows,)](
        logits, logits.stride(0), idx_mapping,
        params.temperature, params.greedy, params.top_k, params.top_p, params.min_p,
        scratch, cuts.value, cuts.tie_index, vocab_size,
        BLOCK=_BLOCK, NUM_PIVOTS=_NUM_PIVOTS, BUF_CAP=buffer_size,
        num_warps=8,
    )
    return cuts
