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
  token budget, where ``wants_budget_graph``): PIECEWISE, unpadded. Nothing pads into an exact
  size: above the ladder a step's GEMMs are compute-bound, so padding costs its share of GPU
  time, while the steps of a prompt burst fill the budget exactly.
- Anything else, or with ``enforce_eager``: NONE (eager, no padding).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

from pagedserve.config import EngineConfig
from pagedserve.model.shape import ModelShape

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


# Linear-layer FLOPs per decoder layer of a full-budget step up to which the budget-step graph
# is captured by default. Between the two shapes measured on the H200: Qwen3-0.6B at 8,192
# tokens does 0.26 TFLOP per layer (~0.3 ms of GPU work, less than its hosts took to launch one
# layer's kernels: 0.27-0.6 ms) and was host-bound; Llama-3-8B does 3.6 TFLOP (~4.5 ms) and was
# not. Below it the graph's activations are small too (they grow with the same widths).
HOST_BOUND_LAYER_FLOPS = 0.5e12


def wants_budget_graph(config: EngineConfig, shape: ModelShape | None) -> bool:
    """``budget_step_graph`` as set, or, unset, whether a full-budget step of ``shape`` is
    small enough to be host-bound (no shape yet: not decided, no graph). Under tensor
    parallelism each rank's host launches every kernel for its share of the FLOPs."""
    asked = config.compilation.budget_step_graph
    if asked is not None:
        return asked
    if shape is None:
        return False
    budget = config.scheduler.max_num_batched_tokens
    rank_flops = 2 * budget * shape.layer_matmul_params / config.parallel.tensor_parallel_size
    return rank_flops <= HOST_BOUND_LAYER_FLOPS


def capture_ladders(config: EngineConfig, shape: ModelShape | None = None) -> CaptureLadders:
    """The configured ladders, and the token budget as an exact PIECEWISE size where
    ``wants_budget_graph`` and the ladder stops below the budget."""
    compilation = config.compilation
    full, piecewise = compilation.full_capture_sizes, compilation.piecewise_capture_sizes
    budget = config.scheduler.max_num_batched_tokens
    above_ladder = not piecewise or budget > piecewise[-1]
    exact = [budget] if above_ladder and wants_budget_graph(config, shape) else []
    return CaptureLadders(full, piecewise, exact)
