"""CUDA-graph dispatch: which graph (if any) serves a batch, and how far it is padded (stop 2).

The runner asks before it builds any input, because the answer sets the padded token count
(and, for FULL graphs, the padded request count) of every buffer view of the step.

Each mode pads on its own ladder of capture sizes (``CaptureLadders``): FULL on a dense one (a
decode step is short, padding it costs a larger share), PIECEWISE on a sparse one (each size is
one graph per compiled piece, and a mixed batch's GEMMs are weight-read bound, so padding it
costs little).

- A uniform decode batch (every request runs exactly 1 token) within the FULL ladder: FULL,
  the graph of the whole forward, padded to the next FULL size in tokens *and* requests.
- Anything else within the PIECEWISE ladder: PIECEWISE, the compiled pieces between attention
  ops, padded to the next PIECEWISE size in tokens only.
- Above the PIECEWISE ladder, a step of exactly an *exact* size (``CaptureLadders.exact``: the
  token budget with ``budget_step_graph``): PIECEWISE, unpadded. Nothing pads into an exact
  size: above the ladder a step's GEMMs are compute-bound, so padding costs its share of GPU
  time, while the steps of a prompt burst fill the budget exactly.
- Anything else, or with ``enforce_eager``: NONE (eager, no padding).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class CaptureLadders:
    """The capture sizes of each graph mode, each sorted ascending (``CompilationConfig``'s
    ``full_capture_sizes`` and ``piecewise_capture_sizes``)."""

    full: list[int]
    piecewise: list[int]
    exact: list[int] = field(default_factory=list)
    """PIECEWISE sizes above the ladder that only a step of exactly that many tokens replays."""

    def __post_init__(self) -> None:
        for name in ("full", "piecewise", "exact"):
            sizes = getattr(self, name)
            if sizes != sorted(set(sizes)):
                raise ValueError(f"CaptureLadders.{name}: not ascending and distinct: {sizes}")
        if self.exact and self.piecewise and self.exact[0] <= self.piecewise[-1]:
            raise ValueError(f"CaptureLadders.exact: {self.exact} must lie above the PIECEWISE "
                             f"ladder (up to {self.piecewise[-1]})")

    def ladder(self, mode: CudaGraphMode) -> list[int]:
        """The sizes ``mode`` pads on (NONE: the PIECEWISE ladder, the one every batch that is
        not a FULL decode is measured against)."""
        return self.full if mode is CudaGraphMode.FULL else self.piecewise

    def max_padded_tokens(self, max_num_tokens: int) -> int:
        """The most tokens any batch of at most ``max_num_tokens`` pads to, on either ladder:
        what token buffers must hold."""
        return max(padded_size(max_num_tokens, self.full),
                   padded_size(max_num_tokens, self.piecewise))

    def max_padded_reqs(self, max_num_reqs: int) -> int:
        """The most requests any batch of at most ``max_num_reqs`` pads to: only FULL pads
        requests (to its token size, one token per request)."""
        return padded_size(max_num_reqs, self.full)


def dispatch(
    num_reqs: int,
    num_tokens: int,
    uniform_decode_len: int | None,
    ladders: CaptureLadders,
    enforce_eager: bool,
) -> BatchDescriptor:
    """The descriptor of a batch of ``num_reqs`` requests and ``num_tokens`` tokens.

    ``uniform_decode_len``: the common query length when every request is decoding (None when
    the batch has a real prefill). A uniform decode batch above the FULL ladder falls to
    PIECEWISE if its ladder reaches further (only with explicit sizes; the defaults end at the
    same size).
    """
    if num_reqs <= 0 or num_tokens < num_reqs:
        raise ValueError(f"dispatch: {num_reqs} requests with {num_tokens} tokens")
    if enforce_eager:
        return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)
    full, piecewise = ladders.full, ladders.piecewise
    if uniform_decode_len == DECODE_QUERY_LEN and full and num_tokens <= full[-1]:
        # num_tokens == num_reqs here, so the request count pads to the same size.
        size = padded_size(num_tokens, full)
        return BatchDescriptor(CudaGraphMode.FULL, size, size)
    if piecewise and num_tokens <= piecewise[-1]:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, padded_size(num_tokens, piecewise), None)
    if num_tokens in ladders.exact:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, num_tokens, None)
    return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)
