"""CUDA-graph dispatch: which graph (if any) serves a batch, and how far it is padded (stop 2).

The runner asks before it builds any input, because the answer sets the padded token count
(and, for FULL graphs, the padded request count) of every buffer view of the step.

- Above the largest capture size, or with ``enforce_eager``: NONE (eager, no padding).
- A uniform decode batch (every request runs exactly 1 token): FULL, the graph of the whole
  forward, padded to the next capture size in tokens *and* requests.
- Anything else: PIECEWISE, the compiled pieces between attention ops, padded in tokens only.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass

DECODE_QUERY_LEN = 1
"""Tokens a decode step runs per request (no speculative decoding)."""


class CudaGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass(frozen=True)
class BatchDescriptor:
    mode: CudaGraphMode
    num_tokens: int
    """Token count after padding (the capture size of the graph, or the real count for NONE)."""
    num_reqs: int | None
    """Request count after padding; None when requests are not padded (PIECEWISE, NONE)."""


def padded_size(n: int, capture_sizes: list[int]) -> int:
    """The smallest capture size >= n, or n itself above the largest one."""
    i = bisect.bisect_left(capture_sizes, n)
    return capture_sizes[i] if i < len(capture_sizes) else n


def dispatch(
    num_reqs: int,
    num_tokens: int,
    uniform_decode_len: int | None,
    capture_sizes: list[int],
    enforce_eager: bool,
) -> BatchDescriptor:
    """The descriptor of a batch of ``num_reqs`` requests and ``num_tokens`` tokens.

    ``uniform_decode_len``: the common query length when every request is decoding (None when
    the batch has a real prefill); ``capture_sizes`` sorted ascending.
    """
    if num_reqs <= 0 or num_tokens < num_reqs:
        raise ValueError(f"dispatch: {num_reqs} requests with {num_tokens} tokens")
    if enforce_eager or not capture_sizes or num_tokens > capture_sizes[-1]:
        return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)
    size = padded_size(num_tokens, capture_sizes)
    if uniform_decode_len == DECODE_QUERY_LEN:
        # num_tokens == num_reqs here, so the request count pads to the same size.
        return BatchDescriptor(CudaGraphMode.FULL, size, size)
    return BatchDescriptor(CudaGraphMode.PIECEWISE, size, None)
