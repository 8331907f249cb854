"""The fused sampling pass: temperature, the truncation cut, seeded Gumbel noise and the argmax.

Reads each logit once and writes nothing of vocabulary size. Per row (batch row -> slot through
idx_mapping): x = logit / temperature; greedy rows take argmax(x); the others argmax(x + g) over
the tokens their cut keeps, where g = -log(-log(u)) and u comes from the counter-based hash of
``pagedserve/sample/noise.py`` (seed, output-token counter, vocabulary index). The hash is
recomputed here in uint32 arithmetic, which equals the reference's masked int64 arithmetic bit
for bit, so the noise, and with it the sampled token, is the reference's.

Small batches split the vocabulary over several programs per row; each writes its best
(score, index) and a torch argmax over the splits picks the first best, as torch's argmax does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels.sampling_common import (
    INT32_MAX,
    NEG_INF,
    Cuts,
    SlotParams,
    load_scaled,
    precise_log,
)

_BLOCK = 1024
MIN_SPLIT_SIZE = 4096  # fewer tokens per program than this are not worth another program


class NoiseHash(NamedTuple):
    """The constants of the reference's counter-based hash (``pagedserve.sample.noise``)."""

    mul: int
    seed_salt: int
    vocab_salt: int
    uniform_bits: int


@triton.jit
def _mix32(x, MUL: tl.constexpr):
    """The reference's ``mix32`` on uint32 (products wrap mod 2**32, as its ``& MASK32``)."""
    x = ((x >> 16) ^ x) * MUL
    x = ((x >> 16) ^ x) * MUL
    return (x >> 16) ^ x


@triton.jit
def _row_key(seed, counter, MUL: tl.constexpr, SEED_SALT: tl.constexpr):
    """uint32 key of (seed, counter), both int64 >= 0: the reference's ``row_keys``."""
    h = _mix32(seed.to(tl.uint32) ^ SEED_SALT, MUL)  # the cast keeps the low 32 bits
    h = _mix32(h ^ (seed >> 32).to(tl.uint32), MUL)
    h = _mix32(h ^ counter.to(tl.uint32), MUL)
    return _mix32(h ^ (counter >> 32).to(tl.uint32), MUL)


@triton.jit
def _gumbel(row_key, offs, MUL: tl.constexpr, VOCAB_SALT: tl.constexpr,
            UNIFORM_BITS: tl.constexpr, UNIFORM_SCALE: tl.constexpr):
    """fp32 Gumbel noise of tokens offs: the reference's ``gumbel_noise``."""
    vocab_key = _mix32(offs.to(tl.uint32) ^ VOCAB_SALT, MUL)
    bits = _mix32(vocab_key ^ row_key, MUL) >> (32 - UNIFORM_BITS)
    u = (bits.to(tl.float32) + 0.5) * UNIFORM_SCALE  # exact, strictly inside (0, 1)
    return -precise_log(-precise_log(u))


@triton.jit
def _race_block(best, best_index, x, kept, offs, greedy, row_key, MUL: tl.constexpr,
                VOCAB_SALT: tl.constexpr, UNIFORM_BITS: tl.constexpr,
                UNIFORM_SCALE: tl.constexpr):
    """Fold one block into the per-lane best (score, token); only a strictly better score
    replaces the best, so among equal scores the first token stays."""
    noise = _gumbel(row_key, offs, MUL, VOCAB_SALT, UNIFORM_BITS, UNIFORM_SCALE)
    score = tl.where(kept, tl.where(greedy, x, x + noise), NEG_INF)
    better = score > best
    return tl.where(better, score, best), tl.where(better, offs, best_index)


@triton.jit
def _gumbel_kernel(
    logits_ptr,  # [num_rows, V], any float dtype
    logits_stride,
    idx_mapping_ptr,  # int64 [num_rows]
    temperature_ptr,  # fp32 [max_num_reqs]
    greedy_ptr,  # bool [max_num_reqs]
    seeds_ptr,  # int64 [max_num_reqs]
    counters_ptr,  # int64 [max_num_reqs]
    cut_value_ptr,  # fp32 [num_rows] (read when HAS_CUTS)
    cut_index_ptr,  # int32 [num_rows] (read when HAS_CUTS)
    best_score_ptr,  # fp32 [num_rows, num_splits] (out)
    best_index_ptr,  # int64 [num_rows, num_splits] (out)
    vocab_size,
    split_size,  # tokens per program, a multiple of BLOCK
    HAS_CUTS: tl.constexpr,
    BLOCK: tl.constexpr,
    MUL: tl.constexpr,
    SEED_SALT: tl.constexpr,
    VOCAB_SALT: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(idx_mapping_ptr + row)
    temperature = tl.load(temperature_ptr + slot)
    greedy = tl.load(greedy_ptr + slot) != 0
    row_key = _row_key(tl.load(seeds_ptr + slot), tl.load(counters_ptr + slot), MUL, SEED_SALT)
    cut_value = tl.full([], NEG_INF, tl.float32)
    cut_index = tl.zeros([], tl.int32)
    if HAS_CUTS:
        cut_value = tl.load(cut_value_ptr + row)
        cut_index = tl.load(cut_index_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    start = split * split_size
    end = tl.minimum(start + split_size, vocab_size)
    # Per lane, the best score so far and its token; a later token wins only if strictly better.
    best = tl.full([BLOCK], NEG_INF, tl.float32)
    best_index = start + tl.arange(0, BLOCK)
    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        x = load_scaled(row_ptr, offs, end, temperature)
        kept = ((x > cut_value) | ((x == cut_value) & (offs >= cut_index))) & (offs < end)
        if HAS_CUTS:
            # Truncated rows keep few tokens: blocks without any skip the noise.
            if tl.max(kept.to(tl.int32), axis=0) > 0:
                best, best_index = _race_block(best, best_index, x, kept, offs, greedy, row_key,
                                               MUL, VOCAB_SALT, UNIFORM_BITS, UNIFORM_SCALE)
        else:
            best, best_index = _race_block(best, best_index, x, kept, offs, greedy, row_key,
                                           MUL, VOCAB_SALT, UNIFORM_BITS, UNIFORM_SCALE)
    top = tl.max(best, axis=0)
    top_index = tl.min(tl.where(best == top, best_index, INT32_MAX), axis=0)
    out = row.to(tl.int64) * tl.num_programs(1) + split
    tl.store(best_score_ptr + out, top)
    tl.store(best_index_ptr + out, top_index.to(tl.int64))


def num_splits_for(num_rows: int, vocab_size: int, target_programs: int) -> int:
    """How many programs share a row: enough for about target_programs in all."""
    max_splits = max(1, vocab_size // MIN_SPLIT_SIZE)
    return max(1, min(max_splits, -(-target_programs // max(num_rows, 1))))


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, V], any float dtype, unit stride along V
    idx_mapping: torch.Tensor,  # int64 [num_rows]
    params: SlotParams,
    cuts: Cuts | None,  # None: no row truncates
    noise_hash: NoiseHash,
    num_splits: int = 1,
) -> torch.Tensor:
    """int64 [num_rows]: each row's sampled token (greedy rows: the argmax)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [num_rows, V] with unit stride along V, got "
                         f"shape {list(logits.shape)} strides {list(logits.stride())}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    num_rows, vocab_size = logits.shape
    split_size = triton.cdiv(triton.cdiv(vocab_size, num_splits), _BLOCK) * _BLOCK
    num_splits = triton.cdiv(vocab_size, split_size)
    device = logits.device
    best_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    best_index = torch.empty(num_rows, num_splits, dtype=torch.int64, device=device)
    if num_rows == 0:
        return best_index.view(0)
    _gumbel_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), idx_mapping,
        params.temperature, params.greedy, params.seeds, params.counters,
        cuts.value if cuts is not None else best_score,
        cuts.tie_index if cuts is not None else best_score,
        best_score, best_index, vocab_size, split_size,
        HAS_CUTS=cuts is not None,
        BLOCK=_BLOCK,
        MUL=noise_hash.mul,
        SEED_SALT=noise_hash.seed_salt,
        VOCAB_SALT=noise_hash.vocab_salt,
        UNIFORM_BITS=noise_hash.uniform_bits,
        UNIFORM_SCALE=2.0**-noise_hash.uniform_bits,
        num_warps=8,
    )
    if num_splits == 1:
        return best_index.view(num_rows)
    # The first split holding the best score: torch's argmax returns the first maximum.
    return best_index.gather(1, best_score.argmax(dim=1, keepdim=True)).view(num_rows)
