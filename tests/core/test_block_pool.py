"""BlockPool, its free queue, and the block hash chain."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedserve.core.hashing import NONE_HASH, hash_block_tokens, update_block_hashes
from tests.core.core_helpers import make_request


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert ids(queue) == [0, 1, 3]
    queue.append(blocks[2])
    assert queue.popleft() is blocks[0]
    assert ids(queue) == [1, 3, 2] and queue.num_free_blocks == 3
    with pytest.raises(ValueError, match="already in the queue"):
        queue.append(blocks[1])
    with pytest.raises(ValueError, match="not in the queue"):
        queue.remove(blocks[0])
    for _ in range(3):
        queue.popleft()
    with pytest.raises(ValueError, match="no free block"):
        queue.popleft()


def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="cannot take 1 blocks"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_free_appends_in_given_order_and_detects_double_free():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue) == [4, 5, 3, 2, 1]
    assert pool.usage == 0.0
    with pytest.raises(ValueError, match="double free of block 3"):
        pool.free_blocks([a[2]])


def test_touch_revives_cached_free_block_and_eviction_drops_hash():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks(blocks, [111, 222], 0, 2)
    assert pool.get_cached_block(222) is blocks[1]
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue) == [3, 2, 1]
    assert pool.get_cached_block(111) is blocks[0]  # free but still cached

    pool.touch([blocks[0]])  # a prefix hit revives block 1: leaves the free queue
    assert blocks[0].ref_cnt == 1 and ids(pool.free_block_queue) == [3, 2]
    pool.touch([blocks[0]])  # a second holder
    assert blocks[0].ref_cnt == 2 and pool.num_free_blocks == 2

    (b3, b2) = pool.get_new_blocks(2)  # block 2 is evicted: its hash goes
    assert (b3.block_id, b2.block_id) == (3, 2)
    assert b2.block_hash is None and pool.get_cached_block(222) is None
    assert pool.get_cached_block(111) is blocks[0]


def test_duplicate_hashes_are_kept_per_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7], 0, 1)
    pool.cache_full_blocks([b], [7], 0, 1)
    assert pool.num_cached_blocks() == 2
    pool.uncache(a)
    assert pool.get_cached_block(7) is b
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_blocks([b], [8], 0, 1)


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [5], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(5) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(5) is None and blocks[0].block_hash is None


def test_block_hash_is_sha256_chain_over_little_endian_tokens():
    h1 = hash_block_tokens(None, [1, 2, 3])
    expected = hashlib.sha256(NONE_HASH.to_bytes(32, "big") + struct.pack("<3q", 1, 2, 3))
    assert h1 == int.from_bytes(expected.digest(), "big")
    h2 = hash_block_tokens(h1, [4, 5, 6])
    assert h2 != hash_block_tokens(None, [4, 5, 6])  # the parent is part of the hash
    assert hash_block_tokens(h1, [4, 5, 6], ("lora", 1)) != h2
    assert hash_block_tokens(h1, [4, 5, 6], ("lora", 1)) == hash_block_tokens(
        h1, [4, 5, 6], ("lora", 1)
    )
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [2**64])


def test_update_block_hashes_covers_full_blocks_incrementally():
    req = make_request("0", list(range(10)))
    hashes = update_block_hashes(req, 4)
    assert hashes == [
        hash_block_tokens(None, [0, 1, 2, 3]),
        hash_block_tokens(hashes[0], [4, 5, 6, 7]),
    ]
    req.append_output_token_ids([10, 11])
    first_two = list(hashes)
    assert update_block_hashes(req, 4)[:2] == first_two
    assert req.block_hashes[2] == hash_block_tokens(first_two[1], [8, 9, 10, 11])
