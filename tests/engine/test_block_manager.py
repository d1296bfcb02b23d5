"""Deterministic unit tests of the block manager: allocation, sharing, LRU eviction."""

from __future__ import annotations

import pytest

from nanoengine.engine.block_manager import BlockManager, InvariantError, hash_block
from nanoengine.engine.request import Request
from nanoengine.events import BlockEvicted, BlocksForked, BlockStored, EventBus, PrefixCacheHit
from nanoengine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _admit(bm: BlockManager, req: Request) -> int:
    hits, cached = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return cached


def test_blocks_are_allocated_on_demand_and_returned():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = _req("a", list(range(10)))
    assert bm.allocate_slots(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5  # ceil(10 / 4)
    r.num_computed_tokens = 10
    assert bm.allocate_slots(r, 1) and len(r.block_ids) == 3  # token 11 still fits block 3
    r.num_computed_tokens = 11
    assert bm.allocate_slots(r, 2) and len(r.block_ids) == 4  # tokens 12-13 need a 4th block
    bm.check_invariants([r])
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []
    bm.check_invariants([])


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = _req("a", list(range(12)))
    before = bm.snapshot()
    assert not bm.allocate_slots(r, 12)
    assert bm.snapshot() == before and r.block_ids == []


def test_shared_prefix_is_reused_with_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    assert _admit(bm, a) == 0
    b = _req("b", list(range(8)) + [99, 98, 97])
    assert _admit(bm, b) == 8  # two full shared blocks
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.blocks[i].ref_count for i in a.block_ids[:2]] == [2, 2]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids[:2]] == [1, 1]
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2  # freed blocks keep their hashes


def test_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=16, block_size=4)
    _admit(bm, _req("a", list(range(8))))
    hits, cached = bm.get_computed_blocks(_req("b", list(range(8))))
    assert cached == 4 and len(hits) == 1  # 8 tokens = 2 full blocks, but token 8 must be computed


def test_chained_hash_distinguishes_equal_blocks_with_different_prefixes():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [3, 4]), [1, 2])
    bm = BlockManager(num_blocks=16, block_size=2)
    _admit(bm, _req("a", [3, 4, 1, 2, 5]))
    hits, cached = bm.get_computed_blocks(_req("b", [1, 2, 1, 2, 5]))
    assert cached == 0  # block [1, 2] exists, but after another prefix


def test_lru_evicts_least_recently_freed_and_emits_events():
    events = EventBus()
    seen = []
    events.subscribe(seen.append)
    bm = BlockManager(num_blocks=4, block_size=2, events=events)
    a = _req("a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] cached, [5] partial
    _admit(bm, a)
    bm.free(a)
    assert sum(isinstance(e, BlockStored) for e in seen) == 2
    # freed tail first: the free queue ends with a's blocks in reverse order
    b = _req("b", [9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: evicts both cached ones
    _admit(bm, b)
    evicted = [e for e in seen if isinstance(e, BlockEvicted)]
    assert len(evicted) == 2 and bm.num_cached_blocks == 3  # b's own 3 full blocks
    bm.check_invariants([b])


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    r = _req("a", [1, 2, 3])
    bm.allocate_slots(r, 3)
    bm.blocks[r.block_ids[0]].ref_count = 2
    with pytest.raises(InvariantError, match="ref_count"):
        bm.check_invariants([r])


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    _admit(bm, _req("a", [1, 2, 3, 4, 5]))
    assert bm.get_computed_blocks(_req("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert bm.num_cached_blocks == 0


def test_block_digest_is_sha256_over_the_parent_digest_and_the_tokens():
    import hashlib
    from array import array

    from nanoengine.engine.block_manager import ROOT_DIGEST

    first = hash_block(None, [1, 2, 3])
    assert first == hashlib.sha256(ROOT_DIGEST + array("q", [1, 2, 3]).tobytes()).digest()
    assert hash_block(first, [4]) == hashlib.sha256(first + array("q", [4]).tobytes()).digest()
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1]) and len(first) == 32


def test_snapshot_shows_digests_parents_and_the_lru_order():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(bm, a)
    snap = {b.block_id: b for b in bm.snapshot()}
    first, second = a.block_ids[:2]
    assert snap[first].block_hash == hash_block(None, [1, 2]) and snap[first].parent_hash is None
    assert snap[second].parent_hash == snap[first].block_hash
    assert snap[first].short_hash == snap[first].block_hash.hex()[:8]
    assert all(snap[b].lru_position is None for b in a.block_ids)  # in use: not in the free queue
    held = list(a.block_ids)
    bm.free(a)
    order = sorted((b for b in bm.snapshot() if b.is_free), key=lambda b: b.lru_position)
    assert [b.lru_position for b in order] == list(range(6))
    assert [b.block_id for b in order] == list(bm.free_queue)
    place = {b.block_id: b.lru_position for b in order}
    # Freed tail first: the request's last block is handed out before its prefix.
    assert place[held[-1]] < place[held[1]] < place[held[0]]


def test_a_requests_block_digests_are_computed_once_across_admission_attempts_and_preemption():
    """Hashing is the prefix cache's main host cost: each full block is hashed once per request."""
    from nanoengine.engine.block_manager import BlockManager, hash_block
    from nanoengine.engine.request import Request
    from nanoengine.sampling_params import SamplingParams

    calls = []

    def counting_hash(parent, tokens):
        calls.append(tuple(tokens))
        return hash_block(parent, tokens)

    bm = BlockManager(num_blocks=4, block_size=4, hash_fn=counting_hash)
    request = Request("r", list(range(17)), SamplingParams(max_tokens=2))
    for _ in range(3):  # three admission attempts while the pool is too small for it
        bm.get_computed_blocks(request)
        assert not bm.can_allocate(request, 17)
    assert len(calls) == 4  # its 4 full blocks, once
    big = BlockManager(num_blocks=8, block_size=4, hash_fn=counting_hash)
    assert big.allocate_slots(request, 17)
    request.num_computed_tokens = 17  # its prefill ran
    big.cache_full_blocks(request)
    assert len(big.cached_blocks) == 4
    big.free(request)  # preempted: its blocks go back, its digests stay
    big.get_computed_blocks(request)
    assert len(calls) == 4


def test_blocks_handed_over_with_forked_from_are_shared_like_hits_and_announced_as_a_fork():
    """Parallel sampling with the cache off: the scheduler passes another request's blocks; the block
    manager shares them by reference count, as it shares prefix-cache hits, and says whose they were."""
    events = EventBus()
    events.keep_history()
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, events=events)
    first = _req("0_x", list(range(10)))
    assert _admit(bm, first) == 0
    sibling = _req("1_x", list(range(10)))
    assert bm.get_computed_blocks(sibling) == ([], 0)  # no cache: the block manager finds nothing itself
    shared = first.block_ids[:2]
    assert bm.allocate_slots(sibling, 2, shared, forked_from="0_x")
    assert sibling.block_ids[:2] == shared and sibling.block_ids[2] not in first.block_ids
    assert [bm.blocks[b].ref_count for b in first.block_ids] == [2, 2, 1]
    assert [type(ev).__name__ for ev in events.history if getattr(ev, "request_id", None) == "1_x"] == \
        ["BlocksForked", "BlocksAllocated"]
    fork = next(ev for ev in events.history if isinstance(ev, BlocksForked))
    assert (fork.parent_id, fork.block_ids) == ("0_x", tuple(shared))
    assert not any(isinstance(ev, PrefixCacheHit) for ev in events.history)
    bm.check_invariants([first, sibling])
    bm.free(first)  # the sibling keeps the shared blocks
    assert [bm.blocks[b].ref_count for b in shared] == [1, 1] and bm.num_free_blocks == 5
    bm.free(sibling)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_the_same_blocks_without_forked_from_are_a_prefix_cache_hit():
    events = EventBus()
    events.keep_history()
    bm = BlockManager(num_blocks=8, block_size=4, events=events)
    first = _req("a", list(range(10)))
    _admit(bm, first)
    second = _req("b", list(range(10)))
    assert _admit(bm, second) == 8
    hits = [ev for ev in events.history if isinstance(ev, PrefixCacheHit)]
    assert [(ev.request_id, ev.num_cached_tokens, ev.block_ids) for ev in hits] == \
        [("b", 8, tuple(first.block_ids[:2]))]
    assert not any(isinstance(ev, BlocksForked) for ev in events.history)
