"""BlockPool: the fixed set of KV-cache blocks, their reference counts, the free queue in
eviction order, and the map from block hash to cached block (prefix caching).

A block is in exactly one of three states:

* in use: ``ref_cnt > 0``, held by that many requests, not in the free queue;
* free and cached: ``ref_cnt == 0``, in the free queue, still in the hash map (a prefix hit can
  bring it back with ``touch``);
* free and empty: ``ref_cnt == 0``, in the free queue, no hash.

Allocation takes blocks from the head of the free queue and evicts their hash; freeing appends
to the tail, so the least recently freed block is reused first. Block 0 is the null block: it is
never handed out and never counted (a placeholder id for block-table padding).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedserve.core.hashing import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set while the block is full and registered in the pool's hash map."""
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, head = next to evict; every operation is O(1).

    A Python deque cannot remove from the middle in O(1), which ``touch`` needs when a prefix
    hit revives a cached free block.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("free block queue: no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"free block queue: block {block.block_id} is not in the queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"free block queue: block {block.block_id} is already in the queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order."""
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """``num_blocks`` blocks (block 0 reserved as the null block), shared by all requests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks: need at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        # hash -> {block_id: block}. Several blocks may share a hash: two requests that computed
        # the same block each keep their own (block tables are append-only, ids never change).
        # A lookup returns the first; evicting one block removes only its own entry.
        self._cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.num_free_blocks) / num_usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self._cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        The caller guarantees those blocks are full and their tokens computed, or scheduled in a
        step that will run; ``block_hashes[i]`` is the hash of ``blocks[i]``.
        """
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"block_hashes: {len(block_hashes)} hashes for {num_full_blocks} full blocks"
            )
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            block_hashes[num_cached_blocks:num_full_blocks],
            strict=True,
        ):
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop the block's hash (its content can no longer be reused)."""
        if block.block_hash is None:
            return
        same_hash = self._cached[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self._cached[block.block_hash]
        block.block_hash = None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks, {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.uncache(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order: a block whose count reaches 0
        goes to the tail of the free queue, keeping its hash until it is reused."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, because blocks
        in use may be hashed and running requests rely on them staying consistent."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for same_hash in self._cached.values():
            for block in same_hash.values():
                block.block_hash = None
        self._cached.clear()
        return True

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the hash map (in use or free)."""
        return sum(len(same_hash) for same_hash in self._cached.values())
