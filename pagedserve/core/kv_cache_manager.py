"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation.

One KV-cache group (every layer of the Llama family uses full attention with one block size),
so a request's block table is one list; ``get_block_ids`` still returns a tuple of lists, one
per group, the shape the runner expects.

Invariant: a block is registered under its hash only if all its tokens are computed, or are
scheduled in a step that will run. Blocks cached for a step that is then cancelled (a request
preempted in the same ``schedule()`` call that scheduled it) are uncached when freed.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.hashing import update_block_hashes
from pagedserve.core.request import Request
from pagedserve.math_utils import cdiv


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        """request id -> its block table (append-only while the request holds blocks)."""
        self._num_cached_blocks: dict[str, int] = {}
        """request id -> how many leading blocks of its table are registered in the hash map."""
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (cumulative), counted once per admission."""
        self.prefix_cache_hits = 0
        """Tokens found in the prefix cache (cumulative), counted once per admission."""

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Returns (blocks, num_cached_tokens). The last token is never a hit, even when the whole
        prompt is cached: the model must run at least one token to produce logits. A request
        that does not read the cache (``Request.reads_prefix_cache``) has no hits.
        """
        if not self.enable_caching or not request.reads_prefix_cache:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens; None when it does not fit.

        ``new_computed_blocks`` (prefix hits from ``get_computed_blocks``, only at admission)
        cover ``num_new_computed_tokens`` tokens after ``request.num_computed_tokens``.
        Returns the newly allocated blocks (hits excluded), possibly empty.
        """
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id)
        if held is not None and not new_computed_blocks and num_new_computed_tokens == 0:
            return self._grow(request, held, num_new_tokens)
        computed_blocks = new_computed_blocks or []
        self._check_allocation(request, num_new_tokens, num_new_computed_tokens, computed_blocks)
        num_held = 0 if held is None else len(held)
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - num_held - len(computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) > self.block_pool.num_free_blocks - num_revived:
            return None

        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if held is None:  # admission: first blocks of a new or resumed request
            held = self.req_to_blocks[req_id] = list(computed_blocks)
            self._num_cached_blocks[req_id] = len(computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        held.extend(new_blocks)
        self.cache_blocks(request, num_tokens_after)
        return new_blocks

    def _grow(
        self, request: Request, held: list[KVCacheBlock], num_new_tokens: int
    ) -> list[KVCacheBlock] | None:
        """``allocate_slots`` for a request that already holds blocks and brings no prefix hits:
        the path of every running request, every step (a decode usually needs no new block)."""
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        if num_new_tokens <= 0 or num_tokens_after > self.max_model_len:
            self._check_allocation(request, num_new_tokens, 0, [])  # raises the ValueError
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - len(held)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            if num_new_blocks > self.block_pool.num_free_blocks:
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            held.extend(new_blocks)
        self.cache_blocks(request, num_tokens_after)
        return new_blocks

    def _check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        computed_blocks: list[KVCacheBlock],
    ) -> None:
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens: must be positive, got {num_new_tokens}")
        if num_new_computed_tokens != len(computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens: {num_new_computed_tokens} does not match "
                f"{len(computed_blocks)} new computed blocks of {self.block_size} tokens"
            )
        if computed_blocks and request.request_id in self.req_to_blocks:
            raise ValueError(
                f"new_computed_blocks: request {request.request_id!r} already holds blocks; "
                "prefix hits are only taken at admission"
            )
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if end > self.max_model_len:
            raise ValueError(
                f"num_new_tokens: request {request.request_id!r} would reach {end} tokens, "
                f"beyond max_model_len={self.max_model_len}"
            )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within its first ``num_computed_tokens`` tokens
        (capped at the tokens known so far) in the prefix cache."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self._num_cached_blocks.get(req_id)
        if num_cached is None:
            return  # holds no blocks
        num_full_blocks = min(num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if num_full_blocks <= num_cached:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id], block_hashes, num_cached, num_full_blocks
        )
        self._num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix is evicted last."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        num_cached = self._num_cached_blocks.pop(req_id, 0)
        # Blocks cached for tokens that will never be computed (see the module docstring).
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
            if block.ref_cnt == 1:
                self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(blocks))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks in the request's table (0 while it holds none: waiting or preempted)."""
        blocks = self.req_to_blocks.get(request_id)
        return 0 if blocks is None else len(blocks)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([block.block_id for block in self.req_to_blocks.get(request_id, [])],)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
