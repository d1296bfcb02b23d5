"""Property-based tests of the block manager (chapters 4 and 7), driven by hypothesis.

A ``RuleBasedStateMachine`` plays the scheduler's part on a bare ``BlockManager`` with
light ``Request`` objects: it admits requests (sharing prefix-cache hits), computes
chunks of tokens, appends sampled tokens, frees finished requests, preempts running ones
(recompute: free the blocks, keep the tokens) and resets the prefix cache, in any order
hypothesis likes, on pools from 1 to 12 blocks. Tiny vocabularies (three token values)
make identical blocks, prefix hits and evictions common.

Beside the manager's own ``check_invariants``, the test keeps a *shadow KV cache*: for
every slot it records what a real model would have written there, which is a function of
the whole token prefix up to that position (attention sees everything before it). From
that follow the properties that matter to a reader of the engine:

* every running request's computed positions hold exactly its own prefix (paging and
  sharing never mix two requests' KV);
* a token is only ever written into a block its request holds alone and that is not in
  the prefix cache (shared blocks are read-only);
* the hash table maps only to blocks whose KV holds the tokens the hash names;
* a prefix hit returns blocks whose stored tokens equal the request's tokens;
* ``allocate_slots`` returning False, ``can_allocate`` and ``get_computed_blocks`` change
  nothing; new blocks come from the front of the LRU free queue; ``free`` returns blocks
  tail first; the event stream agrees with the manager's state.
"""

from __future__ import annotations

import collections
import hashlib
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from nanoengine.engine.block_manager import BlockManager, hash_block
from nanoengine.engine.request import Request
from nanoengine.events import (BlockEvicted, BlocksAllocated, BlocksFreed, BlockStored, EventBus,
                               PrefixCacheHit)
from nanoengine.sampling_params import SamplingParams

TOKENS = st.integers(0, 2)
# CI runs a fixed, reproducible set of examples; NANOENGINE_FUZZ_RANDOM=1 explores new ones
# and NANOENGINE_FUZZ_SCALE=10 runs ten times as many.
DERANDOMIZE = not os.environ.get("NANOENGINE_FUZZ_RANDOM")
SCALE = int(os.environ.get("NANOENGINE_FUZZ_SCALE", "1"))
PARAMS = SamplingParams(temperature=0.0)


class BlockManagerMachine(RuleBasedStateMachine):
    """The scheduler's use of the block manager, as random sequences of operations."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), prefix_caching=st.booleans(),
                prompts=st.lists(st.lists(TOKENS, min_size=1, max_size=14), min_size=1, max_size=4))
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool, prompts: list[list[int]]) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, EventBus())
        self.events: list = []
        self.bm.events.subscribe(self.events.append)
        self.live: list[Request] = []  # hold blocks (running)
        self.idle: list[Request] = []  # hold none (waiting or preempted)
        # Shadow KV: block id -> {offset: the token prefix whose KV sits in that slot}.
        self.kv: dict[int, dict[int, tuple[int, ...]]] = collections.defaultdict(dict)
        self.next_id = 0
        self.used_by_events: set[int] = set()
        self.cached_by_events: set[tuple[int, int]] = set()
        self.events_seen = 0
        for tokens in prompts:
            self.new_request(tokens)

    # ------------------------------------------------------------- helpers
    def state(self) -> tuple:
        """Everything an operation could change, for 'changed nothing' checks."""
        bm = self.bm
        return (tuple((b.ref_count, b.block_hash, b.parent_hash, b.token_ids) for b in bm.blocks),
                tuple(bm.free_queue), dict(bm.cached_blocks), bm.num_evictions, len(self.events),
                tuple((tuple(r.block_ids), tuple(r.block_hashes), r.num_computed_tokens)
                      for r in self.live + self.idle))

    def _check_pure(self, fn, *args):
        before = self.state()
        result = fn(*args)
        assert self.state() == before, f"{fn.__name__} changed the block manager"
        return result

    def _allocate(self, request: Request, num_new: int, computed: list[int]) -> bool:
        """allocate_slots, checked against can_allocate, the LRU order and 'False changes nothing'."""
        expected = self._check_pure(self.bm.can_allocate, request, num_new, computed)
        before = self.state()
        held_before = list(request.block_ids)
        lru_order = [b for b in self.bm.free_queue if b not in computed]
        needed = self.bm.blocks_needed(request.num_computed_tokens + len(computed) * self.bm.block_size
                                       + num_new) - len(held_before) - len(computed)
        evictions = self.bm.num_evictions
        ok = self.bm.allocate_slots(request, num_new, computed)
        assert ok == expected
        COVERAGE["eviction"] += self.bm.num_evictions > evictions
        if not ok:
            COVERAGE["allocation refused"] += 1
            assert self.state() == before, "allocate_slots returned False but changed state"
            assert needed > self.bm.num_free_blocks - sum(self.bm.blocks[b].ref_count == 0 for b in computed)
            return False
        new_ids = request.block_ids[len(held_before) + len(computed):]
        assert request.block_ids[:len(held_before)] == held_before
        assert request.block_ids[len(held_before):len(held_before) + len(computed)] == list(computed)
        assert new_ids == lru_order[:max(0, needed)], "new blocks must come from the LRU front"
        assert len(request.block_ids) >= self.bm.blocks_needed(
            request.num_computed_tokens + len(computed) * self.bm.block_size + num_new)
        return True

    def _compute(self, request: Request, num_new: int) -> None:
        """What the model does: write KV for the next ``num_new`` tokens, then cache full blocks."""
        bs = self.bm.block_size
        start = request.num_computed_tokens
        for pos in range(start, start + num_new):
            block = self.bm.blocks[request.block_ids[pos // bs]]
            assert block.ref_count == 1, f"writing into block {block.block_id} shared by {block.ref_count}"
            assert block.block_hash is None, f"writing into block {block.block_id}, which is in the prefix cache"
            self.kv[block.block_id][pos % bs] = tuple(request.all_token_ids[:pos + 1])
        request.num_computed_tokens += num_new
        self.bm.cache_full_blocks(request)
        if self.bm.enable_prefix_caching:
            assert len(request.block_hashes) == request.num_computed_tokens // bs
        else:
            assert not request.block_hashes and not self.bm.cached_blocks

    def _check_hit(self, request: Request, index: int, block_id: int) -> None:
        """A prefix hit holds the request's own tokens, computed after its own prefix."""
        bs = self.bm.block_size
        block = self.bm.blocks[block_id]
        assert block.token_ids == tuple(request.all_token_ids[index * bs:(index + 1) * bs])
        for offset in range(bs):
            assert self.kv[block_id][offset] == tuple(request.all_token_ids[:index * bs + offset + 1])

    # --------------------------------------------------------------- rules
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=14))
    def new_request(self, tokens: list[int]) -> None:
        self.idle.append(Request(f"r{self.next_id}", tokens, PARAMS))
        self.next_id += 1

    @precondition(lambda self: self.live or self.idle)
    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=6))
    def new_request_sharing_a_prefix(self, data, extra: list[int]) -> None:
        source = data.draw(st.sampled_from(self.live + self.idle))
        cut = data.draw(st.integers(1, source.num_tokens))
        self.new_request(source.all_token_ids[:cut] + extra)

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def admit(self, data) -> None:
        """Admission: look up the prefix cache, allocate for a (possibly chunked) prompt."""
        request = data.draw(st.sampled_from(self.idle))
        computed, num_cached = self._check_pure(self.bm.get_computed_blocks, request)
        bs = self.bm.block_size
        assert num_cached == len(computed) * bs < request.num_tokens, "the last token is always computed"
        assert len(set(computed)) == len(computed)
        for i, block_id in enumerate(computed):
            self._check_hit(request, i, block_id)
        COVERAGE["prefix hit"] += bool(computed)
        num_new = data.draw(st.integers(1, request.num_tokens - num_cached))
        if not self._allocate(request, num_new, computed):
            return
        request.num_computed_tokens = num_cached
        self._compute(request, num_new)
        self.idle.remove(request)
        self.live.append(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), sampled=TOKENS)
    def advance(self, data, sampled: int) -> None:
        """A running request's next chunk, or one decode token after sampling ``sampled``."""
        request = data.draw(st.sampled_from(self.live))
        if request.num_tokens_to_compute == 0:
            request.append_output_token(sampled)
        num_new = data.draw(st.integers(1, request.num_tokens_to_compute))
        if self._allocate(request, num_new, []):
            self._compute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        request = data.draw(st.sampled_from(self.live))
        self._free(request)
        self.live.remove(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """Recompute preemption: blocks go back, tokens stay, progress restarts."""
        request = data.draw(st.sampled_from(self.live))
        COVERAGE["preemption"] += 1
        self._free(request)
        request.num_computed_tokens = 0
        self.live.remove(request)
        self.idle.append(request)

    @precondition(lambda self: any(self.bm.blocks[b].block_hash is not None for b in self.bm.free_queue))
    @rule()
    def reset_prefix_cache(self) -> None:
        free_cached = {b for b in self.bm.free_queue if self.bm.blocks[b].block_hash is not None}
        used_cached = {b.block_id for b in self.bm.blocks if b.ref_count and b.block_hash is not None}
        assert self.bm.reset_prefix_cache() == len(free_cached)
        COVERAGE["reset dropped"] += bool(free_cached)
        assert all(self.bm.blocks[b].block_hash is None for b in self.bm.free_queue)
        assert {b.block_id for b in self.bm.blocks if b.block_hash is not None} == used_cached

    def _free(self, request: Request) -> None:
        table = list(request.block_ids)
        refs = {b: self.bm.blocks[b].ref_count for b in table}
        free_before = list(self.bm.free_queue)
        self.bm.free(request)
        assert request.block_ids == [] and request.block_hashes == []
        for b in table:
            assert self.bm.blocks[b].ref_count == refs[b] - 1
        released = [b for b in reversed(table) if refs[b] == 1]
        assert list(self.bm.free_queue) == free_before + released, "freed blocks join the LRU back, tail first"

    # ---------------------------------------------------------- invariants
    @invariant()
    def manager_invariants_hold(self) -> None:
        self.bm.check_invariants(self.live)
        assert all(not r.block_ids for r in self.idle)

    @invariant()
    def blocks_are_free_xor_owned_and_counted(self) -> None:
        owners = collections.Counter(b for r in self.live for b in r.block_ids)
        COVERAGE["shared block"] += any(n > 1 for n in owners.values())
        for block in self.bm.blocks:
            assert block.ref_count == owners[block.block_id]
            assert (block.block_id in self.bm.free_queue) != (owners[block.block_id] > 0)
        assert self.bm.num_free_blocks + len(owners) == self.bm.num_blocks
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks

    @invariant()
    def every_request_reads_its_own_kv(self) -> None:
        bs = self.bm.block_size
        for request in self.live:
            assert len(request.block_ids) >= self.bm.blocks_needed(request.num_computed_tokens)
            for pos in range(request.num_computed_tokens):
                slot = self.kv[request.block_ids[pos // bs]].get(pos % bs)
                assert slot == tuple(request.all_token_ids[:pos + 1]), \
                    f"{request.request_id} position {pos} reads KV of another prefix"

    @invariant()
    def hash_table_points_at_blocks_holding_those_tokens(self) -> None:
        bs = self.bm.block_size
        for block_hash, block_id in self.bm.cached_blocks.items():
            block = self.bm.blocks[block_id]
            assert block.block_hash == block_hash == self.bm.hash_fn(block.parent_hash, block.token_ids)
            assert len(block.token_ids) == bs
            slots = self.kv[block_id]
            assert [slots[o][-1] for o in range(bs)] == list(block.token_ids)
            prefix = slots[bs - 1]  # the whole prefix this block's KV was computed from
            parent = None
            for i in range(len(prefix) // bs):
                parent = self.bm.hash_fn(parent, prefix[i * bs:(i + 1) * bs])
            assert parent == block_hash, "the chained hash must name the block's whole prefix"

    @invariant()
    def events_agree_with_state(self) -> None:
        for event in self.events[self.events_seen:]:
            if isinstance(event, (BlocksAllocated, PrefixCacheHit)):
                self.used_by_events.update(event.block_ids)
            elif isinstance(event, BlocksFreed):
                self.used_by_events.difference_update(event.block_ids)
            elif isinstance(event, BlockStored):
                self.cached_by_events.add((event.block_hash, event.block_id))
            elif isinstance(event, BlockEvicted):
                self.cached_by_events.discard((event.block_hash, event.block_id))
        self.events_seen = len(self.events)
        assert self.used_by_events == {b.block_id for b in self.bm.blocks if b.ref_count > 0}
        assert self.cached_by_events == set(self.bm.cached_blocks.items())


COVERAGE: collections.Counter = collections.Counter()  # what the random runs exercised


@pytest.mark.slow
def test_block_manager_state_machine():
    COVERAGE.clear()
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=150 * SCALE, stateful_step_count=40, deadline=None, database=None, derandomize=DERANDOMIZE,
        suppress_health_check=[HealthCheck.too_slow]))
    # The runs must have reached the interesting paths, or passing would mean little.
    for what in ("prefix hit", "allocation refused", "eviction", "preemption", "shared block", "reset dropped"):
        assert COVERAGE[what] > 0, f"no example exercised: {what} ({dict(COVERAGE)})"


# ----------------------------------------------------------------------------------
# Hash collisions: with a deliberately weak hash (3 values) the manager must still never
# serve a block whose KV was computed for other tokens, in the block or anywhere before
# it (it compares token ids and checks that each hit was computed after the block matched
# before it). The base machine's invariants check whole prefixes, slot by slot.
class WeakHashMachine(BlockManagerMachine):
    """Same operations, with the block digest reduced to 3 values so collisions are common."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4),
                prompts=st.lists(st.lists(TOKENS, min_size=1, max_size=14), min_size=1, max_size=4))
    def setup(self, num_blocks: int, block_size: int, prompts: list[list[int]]) -> None:
        super().setup(num_blocks, block_size, True, prompts)
        self.bm.hash_fn = _weak_hash


def _weak_hash(parent, tokens):
    """One of three one-byte values: most different blocks collide."""
    return bytes([hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()[0] % 3])


@pytest.mark.slow
def test_weak_hash_collisions_never_serve_other_tokens():
    run_state_machine_as_test(WeakHashMachine, settings=settings(
        max_examples=60 * SCALE, stateful_step_count=40, deadline=None, database=None, derandomize=DERANDOMIZE,
        suppress_health_check=[HealthCheck.too_slow]))


def _colliding_root_hash(parent, tokens):
    """The real digest, except that the first blocks [0] and [1] collide."""
    tokens = tuple(tokens)
    if parent is None and tokens in ((0,), (1,)):
        return hash_block(None, [-1])
    return hash_block(parent, tokens)


def _compute(bm: BlockManager, request: Request, num_new: int) -> None:
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request)


def test_colliding_prefixes_are_never_served_each_others_kv():
    """Two different first blocks share a digest; a child block cached after one of them
    must not be served after the other (a digest names a prefix only if nothing collides)."""
    bm = BlockManager(num_blocks=8, block_size=1, hash_fn=_colliding_root_hash)
    a, x = Request("a", [0, 5, 7], PARAMS), Request("x", [0, 5, 7], PARAMS)
    assert bm.allocate_slots(a, 3) and bm.allocate_slots(x, 3)  # admitted in the same step
    _compute(bm, a, 1)  # a's chunk caches [0]
    _compute(bm, x, 3)  # x's [0] is a duplicate (not cached); x's [0, 5] and [0, 5, 7] are
    _compute(bm, a, 2)
    bm.free(a)  # x keeps running with its child blocks cached but not its root
    b = Request("b", [1, 9, 9, 9, 9], PARAMS)
    assert bm.allocate_slots(b, 5)  # takes every free block: a's cached [0] is evicted
    _compute(bm, b, 5)  # [1] now owns the digest [0] had
    bm.check_invariants([x, b])
    c = Request("c", [1, 5, 8], PARAMS)
    computed, _ = bm.get_computed_blocks(c)
    assert computed == b.block_ids[:1]  # b's [1], and not x's [0, 5], computed after [0]
    # The other way round: a request starting with [0] finds none of b's blocks.
    assert bm.get_computed_blocks(Request("d", [0, 9, 9], PARAMS))[0] == []
