"""What the sampling kernels share: the slot-indexed parameters, the truncation cut, and the
element-level helpers (scaled loads, an order-preserving integer key, a precise log).

Bit-exactness with the torch reference (``pagedserve/sample``) rests on three choices here:
temperature is applied with a correctly rounded division (``div_rn``, as torch's ``/``), the log
is libdevice's ``logf`` (the function torch's CUDA ``log`` calls), and everything else on the
exact path is integer arithmetic or a single IEEE add. The CPU interpreter has no libdevice, so
there the log is numpy's (interpreted kernels only run in tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
POS_INF: tl.constexpr = tl.constexpr(float("inf"))
INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)
INT32_MIN: tl.constexpr = tl.constexpr(-(2**31))


class SlotParams(NamedTuple):
    """Per-slot sampling parameters on the device, indexed by slot (gathered in the kernels
    through idx_mapping, so a step launches no gathers)."""

    temperature: torch.Tensor  # fp32 [max_num_reqs], 1.0 for greedy slots
    greedy: torch.Tensor  # bool [max_num_reqs]
    top_k: torch.Tensor  # int64 [max_num_reqs], 0 = off
    top_p: torch.Tensor  # fp32 [max_num_reqs], 1.0 = off
    min_p: torch.Tensor  # fp32 [max_num_reqs], 0.0 = off
    seeds: torch.Tensor  # int64 [max_num_reqs]
    counters: torch.Tensor  # int64 [max_num_reqs]: output tokens so far (the noise counter)


class Cuts(NamedTuple):
    """Per row, the kept tokens after min-p, top-k and top-p, in two numbers.

    Token v (temperature-scaled logit x_v) is kept iff x_v > value, or x_v == value and
    v >= tie_index. ``tie_index`` is 0 except where top-p keeps only part of a group of tied logits:
    then, as in the reference's stable ascending sort, the lowest vocabulary indices go first.
    Rows that truncate nothing (and greedy rows) have value -inf and index 0.
    """

    value: torch.Tensor  # fp32 [num_rows]
    tie_index: torch.Tensor  # int32 [num_rows]


def kept_mask(scaled_logits: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    """bool [num_rows, V]: the tokens ``cuts`` keeps, with -inf logits never kept (torch ops).

    scaled_logits: fp32 [num_rows, V], the logits after temperature. For tests and benchmarks.
    """
    value = cuts.value.unsqueeze(1)  # [num_rows, 1]
    vocab = torch.arange(scaled_logits.shape[1], device=scaled_logits.device)
    at_cut = (scaled_logits == value) & (vocab.unsqueeze(0) >= cuts.tie_index.unsqueeze(1))
    return ((scaled_logits > value) | at_cut) & (scaled_logits > float("-inf"))


@triton.jit
def _log_libdevice(x):
    return libdevice.log(x)


@triton.jit
def _log_numpy(x):
    return tl.log(x)


# The interpreter cannot call libdevice; ``triton.jit`` tells which mode this process runs in.
precise_log = _log_numpy if isinstance(_log_libdevice, InterpretedFunction) else _log_libdevice


@triton.jit
def float_key(x):
    """int32 keys ordered like the fp32 values x (NaN-free): x < y iff key(x) < key(y).

    -0.0 and +0.0 get different keys; callers normalise -0.0 away first (``x + 0.0``).
    """
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ INT32_MAX, bits)


@triton.jit
def key_float(key):
    """The fp32 value of an int32 key (inverse of ``float_key``)."""
    bits = tl.where(key < 0, key ^ INT32_MAX, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_scaled(row_ptr, offs, vocab_size, temperature):
    """fp32 logits of one block divided by temperature exactly as torch divides (-inf outside)."""
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=NEG_INF).to(tl.float32)
    return tl.math.div_rn(x, temperature)
