"""Counter-based random noise for the Gumbel-max sampler.

The noise of one row depends only on (the request's seed, the request's output-token index, the
vocabulary index): never on the batch around it, the row's position in it, or any generator
state. So a seeded request samples the same tokens alone or inside any batch, and a preempted
request that resumes at output index t continues the same stream.

The hash is Thomas Mueller's 32-bit integer mixer (two multiply/xor-shift rounds), computed on
int64 tensors that hold values in [0, 2**32). Its multiplier is below 2**27, so no product
overflows int64 and the arithmetic is exact and identical on every device. Per element it costs
one xor with the row key and one mix; the per-vocab-index half is precomputed once.

On CUDA, ``pagedserve/kernels/sampling_gumbel.py`` computes the same hash, logs, add and argmax
in one pass over the logits (uint32 arithmetic, libdevice's log), so its tokens equal these.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
HASH_MUL = 0x045D9F3B  # < 2**27: (x < 2**32) * HASH_MUL < 2**59 fits int64 exactly
SEED_SALT = 0x9E3779B9  # golden ratio: keeps seed 0, counter 0 off the fixed point 0
VOCAB_SALT = 0x7F4A7C15
UNIFORM_BITS = 23  # (m + 0.5) * 2**-23 is exact in fp32 and lies strictly inside (0, 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mix of int64 values in [0, 2**32); returns a new tensor in that range."""
    x = ((x >> 16) ^ x) * HASH_MUL & _MASK32
    x = ((x >> 16) ^ x) * HASH_MUL & _MASK32
    return (x >> 16) ^ x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``mix32`` for the large [num_rows, V] tensor (saves allocations)."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(HASH_MUL).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """int64 [V]: the per-vocab-index half of the hash, computed once per sampler."""
    return mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ VOCAB_SALT)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """int64 [num_rows] keys from seeds and counters, both int64 [num_rows] and >= 0."""
    h = mix32((seeds & _MASK32) ^ SEED_SALT)
    for word in (seeds >> 32, counters & _MASK32, counters >> 32):
        h = mix32(h ^ (word & _MASK32))
    return h


def uniform_noise(
    seeds: torch.Tensor, counters: torch.Tensor, keys_v: torch.Tensor
) -> torch.Tensor:
    """fp32 [num_rows, V] uniforms in (0, 1); element (r, v) depends on seeds[r], counters[r], v."""
    x = keys_v.unsqueeze(0) ^ row_keys(seeds, counters).unsqueeze(1)  # int64 [num_rows, V]
    x = _mix32_(x) >> (32 - UNIFORM_BITS)
    return x.to(torch.float32).add_(0.5).mul_(2.0**-UNIFORM_BITS)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, keys_v: torch.Tensor) -> torch.Tensor:
    """fp32 [num_rows, V] standard Gumbel noise -log(-log(u)); finite (|g| < 17)."""
    return uniform_noise(seeds, counters, keys_v).log_().neg_().log_().neg_()


def gumbel_argmax(
    logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, keys_v: torch.Tensor
) -> torch.Tensor:
    """int64 [num_rows]: a draw from softmax(logits) per row (Gumbel-max trick).

    argmax(logits + g) with g ~ Gumbel(0, 1) i.i.d. picks token v with probability
    softmax(logits)[v]; -inf logits stay -inf, so masked tokens are never picked. This is the same
    race as argmax(probs / E) with E ~ Exp(1), without forming probs.
    """
    return (logits + gumbel_noise(seeds, counters, keys_v)).argmax(dim=-1)
