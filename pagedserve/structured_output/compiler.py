"""Grammars compiled off the step loop: a thread pool around xgrammar's ``GrammarCompiler``,
with every compiled grammar cached by its key (kind, spec text)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedserve.structured_output.grammar import ANY_WHITESPACE, structural_tag_spec
from pagedserve.structured_output.params import StructuredOutputsParams

_CACHE_ENTRIES = 512
_COMPILE_THREADS = 2


@dataclass
class CompileStats:
    """Cumulative; read by the scheduler's stats (and ``/metrics``)."""

    num_compiled: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0


class GrammarCompilerPool:
    """``submit`` returns the future compiled grammar of a spec; equal specs share one.

    The tokenizer is loaded (and xgrammar's ``TokenizerInfo`` built) on a pool thread by the
    first compile, so neither the engine's start-up nor its step loop waits for it. The
    vocabulary size is the model's (its padded LM-head width), so masks match the logits. A
    grammar ends on the model's EOS ids or the tokenizer's EOS.
    """

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int]
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self.stats = CompileStats()

    def submit(self, params: StructuredOutputsParams) -> Future[Any]:
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return future
        self.stats.cache_misses += 1
        future = self._pool.submit(self._compile, params.kind, params.source)
        self._cache[key] = future
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, source: str) -> Any:
        compiler = self._get_compiler()
        start = time.perf_counter()
        if kind in ("json", "json_object"):
            compiled = compiler.compile_json_schema(source, any_whitespace=ANY_WHITESPACE)
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(structural_tag_spec(source))
        else:  # choice (as EBNF) and grammar
            compiled = compiler.compile_grammar(source)
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = self._load_tokenizer()
                stop_ids = set(self._stop_token_ids)
                if getattr(tokenizer, "eos_token_id", None) is not None:
                    stop_ids.add(int(tokenizer.eos_token_id))
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=sorted(stop_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
            return self._compiler
