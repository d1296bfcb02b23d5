"""v07 - the block manager with a prefix cache: shared blocks, hashes, ref counts (card 11).

Many requests start with the same tokens (a system prompt, a few-shot header, the
previous turns of a chat). Their KV for those tokens is identical, so it can be computed
once and shared. v07 adds that to v05's paged pool:

- **block hashes, chained.** When a block is full, it gets
  ``hash = H(parent block's hash, this block's token ids)``. Chaining makes the hash
  name the *whole prefix* up to the end of the block, not just these ``block_size``
  tokens - two blocks with equal tokens after different prefixes have different KV,
  and different hashes. ``hash_to_block_id`` maps each hash to a block holding that KV.
  Only full blocks are hashed: a partial block is still being written.
- **lookup at admission.** ``allocate`` walks a new request's full blocks in order; while
  the hashes are found (and the stored token ids really match), the request reuses
  those blocks instead of taking fresh ones, and ``seq.num_cached_tokens`` grows. After
  the first miss every later block is a miss too: the prefill computes one contiguous
  suffix. The block holding the request's last token is never reused, because the
  model must compute at least that token to produce the next one.
- **reference counts.** A shared block has one reference per request using it.
  ``deallocate`` decrements; a block goes back to the free queue only at zero.
  Invariant: a block is in ``free_block_ids`` iff its ``ref_count`` is 0.
- **freed is not forgotten.** A freed block keeps its hash and KV until the free queue
  hands it out again (freed blocks go to the back, fresh ones come from the front, so
  the least recently freed is overwritten first). A later request with the same prefix
  can still hit it and take it back out of the free queue.

Hashing uses ``hashlib.blake2b`` (8-byte digest) to avoid a dependency; nano-vLLM uses
xxhash's xxh64. ``num_prefix_queries`` / ``num_prefix_hits`` count blocks looked up and
found, for traces.
"""

import hashlib
from array import array
from collections import deque

from sequence import Sequence


def compute_hash(token_ids: list[int], parent_hash: int) -> int:
    """Hash of one full block, chained to the hash of the block before it (-1 for none)."""
    # TODO(v07): Hash parent_hash (8 bytes, little-endian, signed) followed by the token
    # ids, e.g. with hashlib.blake2b(digest_size=8) over array('q', token_ids).tobytes();
    # return a non-negative int below 2**63, so it is never -1 and can itself be a parent.
    raise NotImplementedError("TODO(v07): write compute_hash (see NOTES.md)")


class Block:
    """One page of the pool and what the prefix cache knows about it."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # sequences whose block table contains this block
        self.hash = -1  # chained hash once the block is full; -1 = not cacheable (yet)
        self.token_ids: tuple[int, ...] = ()  # the tokens behind ``hash``, to rule out collisions


class BlockManager:
    """Hands out blocks, shares full blocks by prefix hash, counts references."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # take left, return right
        self.used_block_ids: set[int] = set()
        self.num_prefix_queries = 0  # full blocks looked up at admission
        self.num_prefix_hits = 0  # ... and found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self) -> Block:
        """A fresh block for new KV: the front of the free queue, its old hash evicted."""
        block = self.blocks[self.free_block_ids.popleft()]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]  # its KV is about to be overwritten
        block.hash, block.token_ids, block.ref_count = -1, (), 1
        self.used_block_ids.add(block.block_id)
        return block

    def _share_block(self, block_id: int) -> Block:
        """One more reference to a cached block; revive it if it was already freed."""
        # TODO(v07): One more reference to a cached block: if its ref_count is 0, take it
        # out of free_block_ids and into used_block_ids; then increment ref_count and return
        # it.
        raise NotImplementedError("TODO(v07): write BlockManager._share_block (see NOTES.md)")

    def _register(self, block: Block, token_ids: list[int], parent_hash: int) -> int:
        """Publish a full block's hash so later requests can find it."""
        block.hash = compute_hash(token_ids, parent_hash)
        block.token_ids = tuple(token_ids)
        self.hash_to_block_id[block.hash] = block.block_id
        return block.hash

    def can_allocate(self, seq: Sequence) -> bool:
        # Conservative: as if nothing hits. Hits on freed blocks also use free blocks.
        return self.num_free_blocks >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Fill the block table of a sequence about to be prefilled, reusing cached prefix blocks."""
        # TODO(v07): Walk the sequence's blocks in order, chaining parent_hash through every
        # full block. A full block that does not hold the last token, while nothing has
        # missed yet, is looked up (count num_prefix_queries): a hit needs hash_to_block_id
        # to know compute_hash(tokens, parent_hash) AND that block's token_ids to match.
        # Hit: _share_block it, count num_prefix_hits, add block_size to
        # seq.num_cached_tokens. Miss (and every block after it): _take_free_block, and
        # _register it if it is full.
        raise NotImplementedError("TODO(v07): write BlockManager.allocate (see NOTES.md)")

    def deallocate(self, seq: Sequence) -> None:
        """Drop a sequence's references; blocks reaching zero return to the free queue."""
        # TODO(v07): Walk the table in reverse and decrement each block's ref_count; at zero
        # move it from used_block_ids to the BACK of free_block_ids, keeping its hash. Clear
        # the table and set seq.num_cached_tokens back to 0.
        raise NotImplementedError("TODO(v07): write BlockManager.deallocate (see NOTES.md)")

    def can_append(self, seq: Sequence) -> bool:
        """Is there room for the KV of the sequence's last token (written by the next decode)?"""
        needed = seq.num_blocks - len(seq.block_table)  # 1 if the last token starts a new block
        return self.num_free_blocks >= needed

    def may_append(self, seq: Sequence) -> None:
        """Before a decode: add a block if needed; hash the last block if this token fills it."""
        # TODO(v07): As in v05 take a fresh block when one is needed (_take_free_block).
        # Then, if this token fills its block (len(seq) % block_size == 0), _register that
        # block with the hash of the block before it (-1 for the first).
        raise NotImplementedError("TODO(v07): write BlockManager.may_append (see NOTES.md)")
