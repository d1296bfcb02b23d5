"""The block manager: a paged KV pool with prefix caching (chapters 4 and 7).

The KV cache is one big tensor cut into fixed-size *blocks* of ``block_size`` tokens.
A request does not reserve memory for its maximum length; it holds a *block table*, a
list of physical block ids, and gets one more block only when its tokens fill the last
one. That is the virtual-memory idea behind PagedAttention.

Prefix caching: when a block is full, its content is named by a *chained digest*,
``SHA-256(parent_digest || tokens_of_this_block)``, so equal digests mean equal prefixes,
not just equal blocks. A new request whose leading blocks hash the same reuses those
physical blocks (their reference count goes up) and skips computing them.

Why a cryptographic digest: a 64-bit hash such as Python's ``hash`` can be made to collide
on purpose, and a collision would serve one request another's KV. vLLM's CVE-2025-25183 was
that: from Python 3.12 ``hash(None)``, the start of its chain, is a known constant (vLLM now
chains SHA-256 by default). Two more checks make a hit safe even if digests did collide:
the block's stored token ids must equal the request's, and the block must have been
computed after the very block matched just before it in the chain (each cached block
records the *cache serial* of its parent, a number no other cached block ever gets).

Parallel sampling (chapter 8) needs nothing of its own here: siblings share the prompt's
blocks as prefix-cache hits or, with the cache off, as blocks the scheduler hands over
(``allocate_slots``'s ``forked_from``). This class never holds a request between calls.

Freed blocks go to the back of an LRU free queue but keep their hash, so a later request
can still hit them; a block is only forgotten when the queue hands it out again for new
tokens (an *eviction*). Invariants, checked by ``check_invariants``:

* a block is in the free queue if and only if its reference count is 0;
* a block's reference count equals the number of block tables that hold it;
* the hash table maps each hash only to a block that holds exactly those tokens;
* free blocks + used blocks = all blocks.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from nanoengine.engine.profiler import NO_PROFILER, StepProfiler
from nanoengine.events import (BlockEvicted, BlocksAllocated, BlocksForked, BlocksFreed, BlockStored,
                               EventBus, PrefixCacheHit)

if TYPE_CHECKING:
    from nanoengine.engine.request import Request


ROOT_DIGEST = hashlib.sha256(b"nanoengine prefix cache").digest()  # the "parent" of a first block


def hash_block(parent_hash: bytes | None, token_ids: Iterable[int]) -> bytes:
    """The chained digest of one full block: SHA-256 over the parent's digest and the tokens.

    It depends on every token before the block too, through ``parent_hash`` (None for a
    sequence's first block). Token ids are packed as 64-bit integers, so no two different
    token lists give the same bytes.
    """
    data = (parent_hash or ROOT_DIGEST) + array("q", token_ids).tobytes()
    return hashlib.sha256(data).digest()


BlockHashFn = Callable[[bytes | None, Iterable[int]], bytes]


class Block:
    """One physical KV block: who uses it and, once full and cached, what it holds."""

    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids", "serial", "parent_serial")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        """Forget what the block holds: it is not (or no longer) in the prefix cache."""
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.serial: int | None = None  # unique per caching: names this exact KV content
        self.parent_serial: int | None = None  # the serial of the block this one was computed after


@dataclass(frozen=True)
class BlockSnapshot:
    """A read-only view of one block (for the allocator widget and tests)."""

    block_id: int
    ref_count: int
    is_free: bool
    is_cached: bool  # holds a digest in the prefix cache (free or not)
    block_hash: bytes | None = None  # its chained digest while cached
    parent_hash: bytes | None = None  # the digest of the block before it (None: a first block)
    lru_position: int | None = None  # place in the free queue, 0 = the next one handed out

    @property
    def short_hash(self) -> str:
        """The first 8 hex digits of the digest ("" when not cached), for display."""
        return self.block_hash.hex()[:8] if self.block_hash is not None else ""


def gained_blocks(request: "Request", held: int) -> tuple[int, ...]:
    """The blocks ``request`` gained since it held ``held`` of them: allocation only appends to
    ``block_ids``, so they are its last ones (what a scheduled request's ``new_block_ids`` names)."""
    return tuple(request.block_ids[held:])


class InvariantError(AssertionError):
    """The block manager's bookkeeping is inconsistent (a bug, never user error)."""


class BlockManager:
    """Hands out KV blocks to requests, shares cached prefixes, frees and evicts."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: EventBus | None = None, hash_fn: BlockHashFn | None = None,
                 profiler: StepProfiler = NO_PROFILER) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events or EventBus()
        self.step = 0  # stamped on events; the scheduler keeps it current
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU free queue: allocate from the front, return freed blocks to the back.
        # An OrderedDict gives O(1) removal from the middle (a prefix hit on a free block).
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block digest -> block id
        # Tests inject a deliberately weak hash here to show that collisions stay harmless.
        self.hash_fn: BlockHashFn = hash_fn or hash_block
        self._serials = itertools.count()
        self.num_evictions = 0
        self.profiler = profiler  # every public action below is its "block_manager" phase

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: "Request") -> tuple[list[int], int]:
        """Leading full blocks of ``request`` already in the prefix cache, verified.

        Returns (block ids, number of tokens they hold). At least the last token is
        always left to compute, since its logits are needed to sample the next one.
        """
        with self.profiler.phase("block_manager"):
            if not self.enable_prefix_caching:
                return [], 0
            tokens = request.all_token_ids
            max_full_blocks = (len(tokens) - 1) // self.block_size
            digests = self.token_digests(request, max_full_blocks)
            hits: list[int] = []
            parent: bytes | None = None
            parent_serial: int | None = None
            for i in range(max_full_blocks):
                chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                block_hash = digests[i]
                block_id = self.cached_blocks.get(block_hash)
                if block_id is None:
                    break
                block = self.blocks[block_id]
                # Verify, do not trust the digest: same tokens, computed after the block just matched.
                if block.token_ids != chunk or block.parent_hash != parent or block.parent_serial != parent_serial:
                    break
                hits.append(block_id)
                parent, parent_serial = block_hash, block.serial
            return hits, len(hits) * self.block_size

    def token_digests(self, request: "Request", num_blocks: int) -> list[bytes]:
        """The chained digests of ``request``'s first ``num_blocks`` full blocks of tokens: the list kept on
        the request (read, do not edit), since a waiting request asks at every admission attempt."""
        digests, tokens, size = request.token_block_digests, request.all_token_ids, self.block_size
        for i in range(len(digests), num_blocks):
            digests.append(self.hash_fn(digests[i - 1] if i else None, tuple(tokens[i * size:(i + 1) * size])))
        return digests

    def can_allocate(self, request: "Request", num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Whether ``allocate_slots`` would succeed, without changing anything."""
        return self._num_new_blocks(request, num_new_tokens, computed_blocks) <= \
            self.num_free_blocks - sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)

    def allocate_slots(self, request: "Request", num_new_tokens: int,
                       computed_blocks: list[int] = (), forked_from: str | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``; False, changing nothing, when the
        pool cannot provide the blocks.

        ``computed_blocks`` (at admission) already hold the request's leading tokens and are shared, not
        computed: each one's reference count goes up by one. They are the prefix-cache hits
        ``get_computed_blocks`` found (a ``PrefixCacheHit``) or, with ``forked_from`` (the request they
        come from), a parallel-sampling sibling's prompt with the cache off (a ``BlocksForked``). Either
        way the caller vouches that they hold those tokens.
        """
        with self.profiler.phase("block_manager"):
            if not self.can_allocate(request, num_new_tokens, computed_blocks):
                return False
            num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks)
            for block_id in computed_blocks:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_queue[block_id]
                block.ref_count += 1
                request.block_ids.append(block_id)
            if computed_blocks and forked_from is not None:
                if self.events.wants(BlocksForked):
                    self.events.emit(BlocksForked(self.step, request.request_id, forked_from, tuple(computed_blocks)))
            elif computed_blocks and self.events.wants(PrefixCacheHit):
                self.events.emit(PrefixCacheHit(self.step, request.request_id,
                                                len(computed_blocks) * self.block_size, tuple(computed_blocks)))
            new_ids = []
            for _ in range(num_new_blocks):
                block_id, _ = self.free_queue.popitem(last=False)
                block = self.blocks[block_id]
                if block.block_hash is not None:
                    self._evict(block)
                block.ref_count = 1
                new_ids.append(block_id)
            request.block_ids.extend(new_ids)
            if new_ids and self.events.wants(BlocksAllocated):
                self.events.emit(BlocksAllocated(self.step, request.request_id, tuple(new_ids)))
            return True

    def cache_full_blocks(self, request: "Request") -> None:
        """Register the hashes of ``request``'s blocks that its computed tokens filled."""
        with self.profiler.phase("block_manager"):
            if not self.enable_prefix_caching:
                return
            hashes, serials = request.block_hashes, request.block_serials
            num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
            digests = self.token_digests(request, num_full)
            for i in range(len(hashes), num_full):
                parent = hashes[i - 1] if i else None
                parent_serial = serials[i - 1] if i else None
                chunk = tuple(request.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
                block_hash = digests[i]
                hashes.append(block_hash)
                block = self.blocks[request.block_ids[i]]
                if block.block_hash is not None:  # cached already: stored earlier, or a prefix hit
                    serials.append(block.serial)
                elif i and not self._serial_is_cached(parent, parent_serial):
                    serials.append(None)  # the content it was computed after is not cached: unreachable
                elif block_hash in self.cached_blocks:  # the digest is taken, by an identical block or a collision
                    twin = self.blocks[self.cached_blocks[block_hash]]
                    same = twin.token_ids == chunk and twin.parent_serial == parent_serial
                    serials.append(twin.serial if same else None)
                else:
                    block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, chunk
                    block.serial, block.parent_serial = next(self._serials), parent_serial
                    self.cached_blocks[block_hash] = block.block_id
                    serials.append(block.serial)
                    if self.events.wants(BlockStored):
                        self.events.emit(BlockStored(self.step, block.block_id, block_hash, parent))

    def free(self, request: "Request") -> None:
        """Drop ``request``'s hold on its blocks; blocks nobody holds become free.

        Blocks are released tail first, so the LRU queue evicts a request's last blocks
        before its prefix, which other requests are more likely to share.
        """
        with self.profiler.phase("block_manager"):
            freed = []
            for block_id in reversed(request.block_ids):
                block = self.blocks[block_id]
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.free_queue[block_id] = None
                    freed.append(block_id)
            request.block_ids = []
            request.block_hashes = []
            request.block_serials = []
            if freed and self.events.wants(BlocksFreed):
                self.events.emit(BlocksFreed(self.step, request.request_id, tuple(freed)))

    def release_slots_after(self, request: "Request", num_tokens: int) -> None:
        """Free ``request``'s blocks past the first ``num_tokens`` tokens, last first as in ``free``: they
        hold only rejected drafts' KV (speculative decoding), so none is shared or cached."""
        with self.profiler.phase("block_manager"):
            keep = self.blocks_needed(num_tokens)
            surplus = request.block_ids[keep:]
            if not surplus:
                return
            for block_id in reversed(surplus):
                block = self.blocks[block_id]
                if block.ref_count != 1 or block.block_hash is not None:
                    raise InvariantError(f"block {block_id} of {request.request_id} past its tokens is shared "
                                         f"or cached (ref_count {block.ref_count})")
                block.ref_count = 0
                self.free_queue[block_id] = None
            del request.block_ids[keep:]  # the runner's row drops them when next told (``BlockTables.rows``)
            if self.events.wants(BlocksFreed):
                self.events.emit(BlocksFreed(self.step, request.request_id, tuple(reversed(surplus))))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of a free block; returns how many were dropped."""
        with self.profiler.phase("block_manager"):
            cached = [self.blocks[b] for b in self.free_queue if self.blocks[b].block_hash is not None]
            for block in cached:
                self._evict(block)
            return len(cached)

    def snapshot(self) -> tuple[BlockSnapshot, ...]:
        lru = {block_id: place for place, block_id in enumerate(self.free_queue)}
        return tuple(BlockSnapshot(b.block_id, b.ref_count, b.ref_count == 0, b.block_hash is not None,
                                   b.block_hash, b.parent_hash, lru.get(b.block_id))
                     for b in self.blocks)

    def check_invariants(self, requests: Iterable["Request"]) -> None:
        """Raise ``InvariantError`` if the bookkeeping is inconsistent; ``requests``: all holding blocks."""
        owners = collections.Counter()
        for request in requests:
            if len(set(request.block_ids)) != len(request.block_ids):
                raise InvariantError(f"{request.request_id} holds a block twice: {request.block_ids}")
            owners.update(request.block_ids)
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if in_free != (block.ref_count == 0):
                raise InvariantError(f"block {block.block_id}: ref_count {block.ref_count} but in free queue={in_free}")
            if block.ref_count != owners.get(block.block_id, 0):
                raise InvariantError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but {owners.get(block.block_id, 0)} owners")
            if block.block_hash is not None:
                if self.cached_blocks.get(block.block_hash) != block.block_id:
                    raise InvariantError(f"block {block.block_id} has a hash the table does not map to it")
                if self.hash_fn(block.parent_hash, block.token_ids) != block.block_hash \
                        or len(block.token_ids) != self.block_size:
                    raise InvariantError(f"block {block.block_id}'s hash does not match its tokens")
        for block_hash, block_id in self.cached_blocks.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise InvariantError(f"hash table entry points at block {block_id}, which holds another hash")
        if self.num_free_blocks + sum(1 for b in self.blocks if b.ref_count > 0) != self.num_blocks:
            raise InvariantError("free + used blocks != total blocks")

    def _num_new_blocks(self, request: "Request", num_new_tokens: int, computed_blocks) -> int:
        held = len(request.block_ids) + len(computed_blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(0, self.blocks_needed(num_computed + num_new_tokens) - held)

    def _serial_is_cached(self, block_hash: bytes | None, serial: int | None) -> bool:
        """Whether the block content named by (digest, serial) is still in the prefix cache."""
        block_id = self.cached_blocks.get(block_hash) if serial is not None else None
        return block_id is not None and self.blocks[block_id].serial == serial

    def _evict(self, block: Block) -> None:
        del self.cached_blocks[block.block_hash]
        if self.events.wants(BlockEvicted):
            self.events.emit(BlockEvicted(self.step, block.block_id, block.block_hash))
        self.num_evictions += 1
        block.reset()
