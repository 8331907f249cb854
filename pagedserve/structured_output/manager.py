"""The engine core's side of structured outputs: it registers each constrained request (its
grammar compiles on the pool), and for each step fills the packed bitmask of the
constrained requests the step runs (docs/architecture.md#structured-outputs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, cast

import numpy as np
import torch

from pagedserve.core.request import Request
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.structured_output.bitmask import GrammarBitmask, bitmask_width
from pagedserve.structured_output.compiler import CompileStats, GrammarCompilerPool
from pagedserve.structured_output.request import StructuredOutputRequest

_FILL_THREADS = 4


class StructuredOutputManager:
    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompilerPool(load_tokenizer, vocab_size, eos_token_ids)
        import xgrammar as xgr

        # Fills the rows of a step on several threads (the GIL released).
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_FILL_THREADS)

    @property
    def stats(self) -> CompileStats:
        return self.compiler.stats

    def register(self, request: Request) -> None:
        """Start compiling ``request``'s grammar (or find it in the cache); the scheduler keeps
        the request waiting until it is ready."""
        params = request.sampling_params.structured_outputs
        if params is not None:
            request.structured_output = StructuredOutputRequest(self.compiler.submit(params))

    def grammar_bitmask(
        self, plan: SchedulerOutput, requests: Mapping[str, Request]
    ) -> GrammarBitmask | None:
        """The masks of the plan's constrained, unfinished requests, from their matchers' state
        now (every token sampled before this step must have been appended: the core sees to
        it). None when the plan runs no constrained request."""
        constrained = []
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if (request is not None and request.structured_output is not None
                    and not request.is_finished):
                constrained.append(request)
        if not constrained:
            return None
        bitmask = torch.full((len(constrained), bitmask_width(self.vocab_size)), -1,
                             dtype=torch.int32)  # [R, cdiv(V, 32)]
        matchers, rows = [], []
        for row, request in enumerate(constrained):
            state = cast(StructuredOutputRequest, request.structured_output)
            if not state.is_terminated():  # a terminated grammar's row stays all-allowed
                matchers.append(state.matcher)
                rows.append(row)
        if matchers:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        array: np.ndarray = bitmask.numpy()
        return GrammarBitmask([r.request_id for r in constrained], array)

    @staticmethod
    def wait_for_any(requests: list[Request], timeout: float) -> None:
        """Block until one of ``requests``' grammars is ready or ``timeout`` seconds pass (the
        core calls it when nothing else can run, instead of spinning)."""
        futures = [r.structured_output.compiled for r in requests
                   if isinstance(r.structured_output, StructuredOutputRequest)]
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.compiler.shutdown()
