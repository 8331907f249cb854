"""Threshold search over one row of logits, without sorting it (jit helpers, one program per row).

top-k and top-p both ask for the same thing: the smallest logit value t present in the row with
H(t) < target, where H(c) sums a weight over the valid tokens whose logit is > c (weight 1 and
target k for top-k: t is the k-th largest logit; weight exp(x - max) and target p * sum for
top-p: t is the logit of the last kept token).

The search keeps an interval (lo, hi] of int32 keys (``float_key``, same order as the floats)
with H(lo) >= target > H(hi), so t lies in it. Each pass over the row evaluates H at
NUM_PIVOTS pivots inside the interval (evenly spaced in value, which fits logits, plus the key
midpoint, which halves the key range and so bounds the search by about 32 passes) and narrows
the interval to two neighbouring pivots. It ends when every token left in the interval has the
same value. All of a pass's sums share one reduction, so H is monotone in the pivot even after
rounding, and the narrowed interval always holds a token. Only tokens inside the interval are
summed, so blocks without any are cheap; and once the tokens above lo fit in the row's scratch
buffer they are compacted into it and the remaining passes read the buffer instead of the row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve.kernels.sampling_common import (
    INT32_MAX,
    INT32_MIN,
    NEG_INF,
    POS_INF,
    float_key,
    key_float,
    load_scaled,
)


@triton.jit
def load_source(row_ptr, buf_ptr, n_buf, vocab_size, temperature, offs):
    """fp32 [BLOCK] scaled logits, -0.0 turned into +0.0: from the compacted buffer when
    n_buf >= 0 (its values are already scaled), else from the row."""
    if n_buf >= 0:
        x = tl.load(buf_ptr + offs, mask=offs < n_buf, other=NEG_INF)
    else:
        x = load_scaled(row_ptr, offs, vocab_size, temperature) + 0.0
    return x


@triton.jit
def row_max_min(row_ptr, vocab_size, temperature, BLOCK: tl.constexpr):
    """The largest scaled logit of the row and its smallest finite one (never -0.0, whose key
    would sort below +0.0)."""
    top = tl.full([BLOCK], NEG_INF, tl.float32)
    bottom = tl.full([BLOCK], POS_INF, tl.float32)
    for start in range(0, vocab_size, BLOCK):
        x = load_scaled(row_ptr, start + tl.arange(0, BLOCK), vocab_size, temperature) + 0.0
        top = tl.maximum(top, x)
        bottom = tl.minimum(bottom, tl.where(x > NEG_INF, x, POS_INF))
    return tl.max(top, axis=0), tl.min(bottom, axis=0)


@triton.jit
def choose_pivots(key_lo, key_hi, key_min, key_max, NUM_PIVOTS: tl.constexpr):
    """int32 [NUM_PIVOTS] pivot keys for the interval (key_lo, key_hi] whose tokens have keys
    in [key_min, key_max]: first a key below all of them (so column 0 of a pass sums the whole
    interval with the same arithmetic as the other columns), then NUM_PIVOTS - 2 evenly spaced
    in value, then the key midpoint."""
    lo = tl.maximum(key_lo, key_min - 1).to(tl.int64)
    hi = tl.minimum(key_hi, key_max).to(tl.int64)
    value_lo = key_float((lo + 1).to(tl.int32))
    value_hi = key_float(hi.to(tl.int32))
    j = tl.arange(0, NUM_PIVOTS)
    values = value_lo + (value_hi - value_lo) * (j.to(tl.float32) / (NUM_PIVOTS - 1))
    keys = float_key(values + 0.0).to(tl.int64)
    keys = tl.where(j == 0, lo, keys)
    keys = tl.where(j == NUM_PIVOTS - 1, lo + (hi - lo) // 2, keys)
    return tl.minimum(tl.maximum(keys, lo), hi).to(tl.int32)


@triton.jit
def search_pass(
    row_ptr, buf_ptr, n_buf, vocab_size, temperature, floor, row_max, key_lo, key_hi, pivots,
    WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """One pass over the valid tokens (x >= floor) inside (key_lo, key_hi].

    Returns, per pivot, the count and weight of those with key > pivot; and their count,
    smallest and largest key. Every column is summed alike, so a pivot's weight never exceeds
    that of a lower pivot, rounding included. Block sums are fp32 trees, added up in fp64: a
    flat top-p cut sums ~10**5 weights, and a running fp32 sum would drift by about the mass of
    the boundary token.
    """
    n = tl.where(n_buf >= 0, n_buf, vocab_size)
    pivot_count = tl.zeros([NUM_PIVOTS], tl.int32)
    pivot_weight = tl.zeros([NUM_PIVOTS], tl.float64)  # fp64 across blocks: see the docstring
    count = tl.zeros([], tl.int32)
    key_min = tl.full([], INT32_MAX, tl.int32)
    key_max = tl.full([], INT32_MIN, tl.int32)
    for start in range(0, n, BLOCK):
        x = load_source(row_ptr, buf_ptr, n_buf, vocab_size, temperature,
                        start + tl.arange(0, BLOCK))
        key = float_key(x)
        inside = (x >= floor) & (key > key_lo) & (key <= key_hi)
        block_count = tl.sum(inside.to(tl.int32), axis=0)
        if block_count > 0:
            above = inside[:, None] & (key[:, None] > pivots[None, :])  # [BLOCK, NUM_PIVOTS]
            pivot_count += tl.sum(above.to(tl.int32), axis=0)
            if WEIGHTED:
                w = tl.exp(x - row_max)
                pivot_weight += tl.sum(tl.where(above, w[:, None], 0.0), axis=0).to(tl.float64)
            count += block_count
            key_min = tl.minimum(key_min, tl.min(tl.where(inside, key, INT32_MAX), axis=0))
            key_max = tl.maximum(key_max, tl.max(tl.where(inside, key, INT32_MIN), axis=0))
    if not WEIGHTED:
        pivot_weight = pivot_count.to(tl.float64)
    return pivot_count, pivot_weight, count, key_min, key_max


@triton.jit
def compact(row_ptr, buf_ptr, vocab_size, temperature, floor, key_lo, BLOCK: tl.constexpr,
            BUF_CAP: tl.constexpr):
    """Copy the row's valid tokens with key > key_lo, scaled, into buf in vocabulary order.

    The caller knows their count fits the buffer (the mask below only guards other rows'
    buffers); returns it.
    """
    n = tl.zeros([], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        x = load_source(row_ptr, buf_ptr, -1, vocab_size, temperature,
                        start + tl.arange(0, BLOCK))
        keep = (x >= floor) & (float_key(x) > key_lo)
        position = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(buf_ptr + position, x, mask=keep & (position < BUF_CAP))
        n += tl.sum(keep.to(tl.int32), axis=0)
    return n


@triton.jit
def search_threshold(
    row_ptr, buf_ptr, n_buf, vocab_size, temperature, floor, row_max, row_min,
    target_abs, target_frac, n_cand,
    WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, BUF_CAP: tl.constexpr,
):
    """Find t (module docstring) over the valid tokens of a row with at least one of them.

    target = target_abs + target_frac * (total weight), the total being taken in the first pass
    (target_frac fp64 or 0.0; the weights are summed in fp64).
    n_buf: tokens already in the scratch buffer (-1: none); n_cand: valid tokens with key > lo,
    or anything above BUF_CAP when unknown.

    Returns t; the count of valid tokens >= t; the weight of those > t; the number of tokens
    equal to t that top-p may split (0 when it must keep them all); the target; and n_buf.
    """
    key_lo = float_key(tl.full([], NEG_INF, tl.float32))  # -inf tokens never count
    key_hi = float_key(row_max)
    key_min = float_key(tl.maximum(floor, row_min))
    key_max = key_hi
    count_above = tl.zeros([], tl.int32)  # valid tokens with key > key_hi
    weight_above = tl.zeros([], tl.float64)  # and their weight
    target = tl.zeros([], tl.float64) + target_abs
    t_key = key_hi
    ties = tl.zeros([], tl.int32)
    count_ge = tl.zeros([], tl.int32)
    num_passes = tl.zeros([], tl.int32)
    finished = tl.zeros([], tl.int32)
    while finished == 0:
        if (n_buf < 0) & (n_cand <= BUF_CAP):
            n_buf = compact(row_ptr, buf_ptr, vocab_size, temperature, floor, key_lo, BLOCK,
                            BUF_CAP)
        pivots = choose_pivots(key_lo, key_hi, key_min, key_max, NUM_PIVOTS)
        pivot_count, pivot_weight, count, pass_min, pass_max = search_pass(
            row_ptr, buf_ptr, n_buf, vocab_size, temperature, floor, row_max, key_lo, key_hi,
            pivots, WEIGHTED, BLOCK, NUM_PIVOTS,
        )
        # Column 0 pivots below every token left: its sum is the interval's weight.
        weight = tl.sum(tl.where(tl.arange(0, NUM_PIVOTS) == 0, pivot_weight, 0.0), axis=0)
        if num_passes == 0:
            target = target_abs + target_frac * (weight_above + weight)
        num_passes += 1
        count_ge = count_above + count
        # One value left: it is t, and the tokens above it are exactly those above key_hi. Or
        # H(lo) < target: when the whole row weighs less than target, or through rounding
        # (H(lo) >= target held in the previous pass, summed in another order): every token
        # left stays, t is the least.
        collapsed = pass_min == pass_max
        finished = (collapsed | (weight_above + weight < target)).to(tl.int32)
        if finished != 0:
            t_key = pass_min
            ties = tl.where(collapsed, count, 0)
        else:
            below = (weight_above + pivot_weight) < target  # [NUM_PIVOTS]: H(pivot) < target
            count_pivot = count_above + pivot_count
            n_cand = tl.minimum(count_ge, tl.min(tl.where(below, INT32_MAX, count_pivot), axis=0))
            key_hi = tl.minimum(key_hi, tl.min(tl.where(below, pivots, INT32_MAX), axis=0))
            key_lo = tl.maximum(key_lo, tl.max(tl.where(below, INT32_MIN, pivots), axis=0))
            count_above = tl.maximum(count_above, tl.max(tl.where(below, count_pivot, -1), axis=0))
            weight_above = tl.maximum(
                weight_above, tl.max(tl.where(below, weight_above + pivot_weight, NEG_INF), axis=0)
            )
            key_min = pass_min
            key_max = pass_max
    return key_float(t_key), count_ge, weight_above, ties, target, n_buf


@triton.jit
def tie_cut_index(row_ptr, vocab_size, temperature, t, n_drop, BLOCK: tl.constexpr):
    """The vocabulary index of the (n_drop + 1)-th token, in index order, whose value is t."""
    seen = tl.zeros([], tl.int32)
    index = tl.full([], vocab_size, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tied = load_scaled(row_ptr, offs, vocab_size, temperature) == t
        rank = seen + tl.cumsum(tied.to(tl.int32), axis=0)  # 1-based among the tied tokens
        hit = tied & (rank == n_drop + 1)
        index = tl.minimum(index, tl.min(tl.where(hit, offs, vocab_size), axis=0))
        seen += tl.sum(tied.to(tl.int32), axis=0)
    return index
