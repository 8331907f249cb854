"""KVCacheManager, block-exact (in the style of vLLM's tests/v1/core/test_prefix_caching.py):
which block ids a request gets, prefix hits, eviction order, reference counts."""

from __future__ import annotations

import pytest

from pagedserve.core.hashing import hash_block_tokens
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from tests.core.core_helpers import check_kv_invariants, make_request

BS = 4
COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks: 0000 1111 2222


def admit(kv: KVCacheManager, req: Request):
    """What the scheduler does for a waiting request whose whole prompt fits in the step."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    new_blocks = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    if new_blocks is not None:
        req.num_computed_tokens = req.num_tokens
    return hits, num_hit_tokens, new_blocks


def decode(kv: KVCacheManager, req: Request, token: int):
    """Append a sampled token and schedule it (one decode step)."""
    req.append_output_token_ids([token])
    new_blocks = kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    return new_blocks


def block_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_prefill_hits_and_eviction_order():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    pool = kv.block_pool

    # Full miss: 3 full blocks + 3 tokens.
    req0 = make_request("0", COMMON + [3] * 3)
    hits, n, new = admit(kv, req0)
    assert (hits, n) == ([], 0)
    assert block_ids(new) == [1, 2, 3, 4]
    parent = None
    for block_id in (1, 2, 3):  # full blocks carry the hash chain
        parent = hash_block_tokens(parent, COMMON[(block_id - 1) * BS : block_id * BS])
        assert pool.blocks[block_id].block_hash == parent
        assert pool.blocks[block_id].ref_cnt == 1
    assert pool.blocks[4].block_hash is None  # the partial block is not cached

    # Hit on the common prefix while req0 still holds it.
    req1 = make_request("1", COMMON + [3] * 2)
    hits, n, new = admit(kv, req1)
    assert block_ids(hits) == [1, 2, 3] and n == 12
    assert block_ids(new) == [5]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert pool.num_free_blocks == 5
    check_kv_invariants(kv)

    # Freed tail first: unused blocks, then req0's tail, then req1's tail and the prefix.
    kv.free(req0)
    kv.free(req1)
    assert block_ids(pool.free_block_queue) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert kv.usage == 0.0

    # Hit while the prefix blocks sit in the free queue: touching revives them.
    req2 = make_request("2", COMMON + [3] * 3)
    hits, n, new = admit(kv, req2)
    assert block_ids(hits) == [1, 2, 3] and block_ids(new) == [6]
    assert block_ids(pool.free_block_queue) == [7, 8, 9, 10, 4, 5]
    kv.free(req2)

    # A miss that needs every block evicts in free-queue order and drops the hashes.
    req3 = make_request("3", [99] * (10 * BS))
    hits, n, new = admit(kv, req3)
    assert n == 0 and block_ids(new) == [7, 8, 9, 10, 4, 5, 6, 3, 2, 1]
    assert pool.num_free_blocks == 0
    probe = make_request("4", COMMON + [5])
    assert kv.get_computed_blocks(probe) == ([], 0)
    check_kv_invariants(kv)


@pytest.mark.parametrize("prompt_len, expected_hit_blocks", [(12, 2), (13, 3), (11, 2), (4, 0)])
def test_last_prompt_token_is_always_recomputed(prompt_len, expected_hit_blocks):
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    admit(kv, make_request("0", COMMON + [7]))  # caches all three common blocks
    prompt = (COMMON + [7])[:prompt_len]
    hits, n = kv.get_computed_blocks(make_request("1", prompt))
    assert len(hits) == expected_hit_blocks and n == expected_hit_blocks * BS
    assert n < prompt_len


def test_shared_blocks_ref_counts_and_usage():
    kv = KVCacheManager(num_blocks=9, block_size=BS, max_model_len=64)  # 8 usable blocks
    req0, req1 = make_request("0", COMMON + [5]), make_request("1", COMMON + [6, 6])
    admit(kv, req0)
    admit(kv, req1)
    assert kv.get_block_ids("0") == ([1, 2, 3, 4],)
    assert kv.get_block_ids("1") == ([1, 2, 3, 5],)
    assert kv.usage == 5 / 8
    kv.free(req0)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [1, 1, 1, 0, 1]
    assert kv.usage == 4 / 8
    kv.free(req1)
    assert kv.usage == 0.0
    assert kv.get_block_ids("1") == ([],)
    check_kv_invariants(kv)


def test_generated_tokens_are_cached_once_scheduled():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    req = make_request("0", [1, 2, 3, 4, 5, 6])
    admit(kv, req)
    assert decode(kv, req, 7) == []  # fits in block 2
    assert kv.block_pool.blocks[2].block_hash is None
    assert decode(kv, req, 8) == []  # block 2 is full (5 6 7 8) once token 8 is scheduled
    assert kv.block_pool.blocks[2].block_hash is not None
    assert block_ids(decode(kv, req, 9)) == [3]

    # A continuation of the whole history (n > 1, multi-turn) hits the generated block too.
    follow_up = make_request("1", req.all_token_ids + [10])
    hits, n = kv.get_computed_blocks(follow_up)
    assert block_ids(hits) == [1, 2] and n == 8


def test_allocation_fails_without_side_effects_when_pool_is_short():
    kv = KVCacheManager(num_blocks=5, block_size=BS, max_model_len=64)  # 4 usable blocks
    req0 = make_request("0", COMMON[:8] + [9])
    admit(kv, req0)
    kv.free(req0)
    assert block_ids(kv.block_pool.free_block_queue) == [4, 3, 2, 1]

    # 17 tokens = 5 blocks: 2 hits + 3 new, but reviving the hits leaves only 2 free.
    too_big = make_request("1", COMMON[:8] + [9] * 9)
    hits, n, new = admit(kv, too_big)
    assert new is None and block_ids(hits) == [1, 2]
    assert block_ids(kv.block_pool.free_block_queue) == [4, 3, 2, 1]
    assert kv.get_block_ids("1") == ([],)
    assert kv.prefix_cache_queries == 9  # only the admitted request counted

    fits = make_request("2", COMMON[:8] + [9] * 4)
    hits, n, new = admit(kv, fits)
    assert block_ids(hits) == [1, 2] and block_ids(new) == [4]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9 + 12, 8)
    check_kv_invariants(kv)


def test_blocks_cached_for_a_cancelled_step_are_uncached_on_free():
    """A request preempted in the same schedule() that scheduled it never computes those
    tokens; its blocks must not stay in the prefix cache."""
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    req = make_request("0", COMMON + [7])
    assert kv.allocate_slots(req, 13) is not None  # scheduled, num_computed_tokens still 0
    assert kv.block_pool.num_cached_blocks() == 3
    kv.free(req)
    assert kv.block_pool.num_cached_blocks() == 0
    assert kv.get_computed_blocks(make_request("1", COMMON + [7])) == ([], 0)


def test_a_request_with_prompt_logprobs_reads_no_hits_but_fills_the_cache():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    admit(kv, make_request("0", COMMON + [3]))
    # Its prompt logprobs need the whole prompt's forward pass: no hit, fresh blocks.
    req1 = make_request("1", COMMON + [3], prompt_logprobs=0)
    hits, n, new = admit(kv, req1)
    assert (hits, n) == ([], 0) and block_ids(new) == [5, 6, 7, 8]
    kv.free(req1)
    # A later request without prompt logprobs still hits the first request's blocks.
    hits, n, _ = admit(kv, make_request("2", COMMON + [3]))
    assert block_ids(hits) == [1, 2, 3] and n == 12
    check_kv_invariants(kv)


def test_cache_salt_separates_equal_prompts():
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64)
    admit(kv, make_request("0", COMMON + [3], cache_salt="a"))
    # Another salt, or none: the same tokens hash differently from the first block on.
    for rid, salt, first_new in (("1", "b", 5), ("2", None, 9)):
        hits, n, new = admit(kv, make_request(rid, COMMON + [3], cache_salt=salt))
        assert (hits, n) == ([], 0) and block_ids(new)[0] == first_new
    hits, n, _ = admit(kv, make_request("3", COMMON + [3], cache_salt="a"))
    assert block_ids(hits) == [1, 2, 3] and n == 12
    check_kv_invariants(kv)


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64, enable_caching=False)
    req0, req1 = make_request("0", COMMON + [1]), make_request("1", COMMON + [1])
    admit(kv, req0)
    hits, n, new = admit(kv, req1)
    assert (hits, n) == ([], 0) and block_ids(new) == [5, 6, 7, 8]
    assert kv.block_pool.num_cached_blocks() == 0 and req1.block_hashes == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    req = make_request("0", COMMON + [1])
    admit(kv, req)
    assert kv.reset_prefix_cache() is False
    kv.free(req)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("1", COMMON + [1])) == ([], 0)


def test_bad_allocation_arguments():
    kv = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=16)
    req = make_request("0", COMMON + [1])
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(req, 0)
    with pytest.raises(ValueError, match="max_model_len=16"):
        kv.allocate_slots(req, 17)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(req, 1, 4, [])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=11, block_size=0, max_model_len=16)
