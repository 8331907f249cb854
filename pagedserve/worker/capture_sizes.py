"""The capture ladders of the runner's CUDA graphs, and which graph serves a batch.

Each graph mode pads on its own ladder of capture sizes (``CaptureLadders``); ``describe_batch``
gives a batch its mode and padded sizes (the rules: ``worker/cudagraph.py``'s module docstring,
"Dispatch"); ``full_sizes`` and ``piecewise_sizes`` are the sizes a start-up can capture.
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

    @property
    def query_len(self) -> int:
        """Tokens per request of a FULL graph: 1, or 1 + k when it verifies k drafts each."""
        return 1 if self.num_reqs is None else self.num_tokens // self.num_reqs


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
    verify: list[int] = field(default_factory=list)
    """FULL sizes (tokens) of verify batches: ``verify_query_len`` tokens per request."""
    verify_query_len: int = 0
    """1 + k with speculative decoding (k drafts per request), else 0: no verify graphs."""

    def __post_init__(self) -> None:
        for name in ("full", "piecewise", "exact", "verify"):
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


# Linear-layer FLOPs per decoder layer of a full-budget step up to which the budget-step graph
# is captured by default: between Qwen3-0.6B at 8,192 tokens (0.26 TFLOP per layer, a step
# bound by the host launching its kernels) and Llama-3-8B (3.6 TFLOP, bound by the GPU). Below
# it the graph's activations are small too (they grow with the same widths).
HOST_BOUND_LAYER_FLOPS = 0.5e12


def wants_budget_graph(config: EngineConfig, shape: ModelShape | None) -> bool:
    """``budget_step_graph`` as set, or, unset, whether a full-budget step of ``shape`` is
    small enough to be host-bound (no shape: not decided, no graph). Under tensor
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
    return CaptureLadders(full, piecewise, exact, *verify_ladder(config, full))


def verify_ladder(config: EngineConfig, full: list[int]) -> tuple[list[int], int]:
    """FULL sizes of batches where every request verifies k drafts (query length 1 + k): the
    FULL ladder's request counts up to ``disable_by_batch_size`` (no drafts above it) times
    1 + k, within the token budget; ([], 0) without speculative decoding."""
    spec = config.scheduler.speculative_config
    if spec is None:
        return [], 0
    query_len = 1 + spec.num_speculative_tokens
    budget = config.scheduler.max_num_batched_tokens
    sizes = [r * query_len for r in full
             if r <= spec.disable_by_batch_size and r * query_len <= budget]
    return sizes, query_len


def padded_buffer_sizes(config: EngineConfig) -> tuple[int, int]:
    """(tokens, requests) the persistent input buffers must hold: the most any step pads to.

    The model's shape plays no part, so the runner sizes its buffers before the model loads:
    the shape only decides the exact sizes, and an exact size is the token budget itself, which
    no ladder pads below."""
    ladders = capture_ladders(config)
    return (ladders.max_padded_tokens(config.scheduler.max_num_batched_tokens),
            ladders.max_padded_reqs(config.scheduler.max_num_seqs))


def describe_batch(
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
    q, verify = ladders.verify_query_len, ladders.verify
    if uniform_decode_len == q and verify and num_tokens <= verify[-1]:
        size = padded_size(num_tokens, verify)  # a multiple of q: requests pad alike
        return BatchDescriptor(CudaGraphMode.FULL, size, size // q)
    if piecewise and num_tokens <= piecewise[-1]:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, padded_size(num_tokens, piecewise), None)
    if num_tokens in ladders.exact:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, num_tokens, None)
    return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)


def full_sizes(capture_sizes: list[int], max_num_reqs: int, max_num_batched_tokens: int,
               usable_blocks: int) -> list[int]:
    """FULL capture sizes (of the FULL ladder), largest first: ``size`` one-token requests
    need ``size`` request slots, tokens and blocks."""
    limit = min(max_num_reqs, max_num_batched_tokens, usable_blocks)
    return sorted((s for s in capture_sizes if s <= limit), reverse=True)


def piecewise_sizes(capture_sizes: list[int], max_num_batched_tokens: int, max_num_reqs: int,
                    max_model_len: int, usable_blocks: int, block_size: int) -> list[int]:
    """PIECEWISE capture sizes (of the PIECEWISE ladder and its exact sizes), largest first: a
    size's prompts (``prompt_lens``) must fit the token budget, the request slots and the
    blocks, as a real step's must. Size 1 is left out: a one-token step is a decode (FULL)
    unless it is a one-token prefill."""
    most_tokens = max_num_reqs * _longest_prompt(max_model_len, block_size)
    limit = min(max_num_batched_tokens, most_tokens, usable_blocks * block_size)
    return sorted((s for s in capture_sizes if 2 <= s <= limit), reverse=True)


def prompt_lens(size: int, max_model_len: int, block_size: int) -> list[int]:
    """Prompts of at most ``max_model_len`` tokens (whole blocks but the last) that make
    ``size`` tokens: a PIECEWISE graph depends on the step's token count only (attention, where
    the requests show, runs between the pieces), so a size above the context still has one."""
    longest = _longest_prompt(max_model_len, block_size)
    return [longest] * (size // longest) + ([size % longest] if size % longest else [])


def _longest_prompt(max_model_len: int, block_size: int) -> int:
    """The context rounded down to whole blocks (the context itself if under one block)."""
    return max_model_len // block_size * block_size or max_model_len
