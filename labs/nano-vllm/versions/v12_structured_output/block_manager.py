"""v11 - the block manager with a prefix cache, and slots for drafts (cards 11, 16).

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

New in v11, for speculative decoding: a verify pass writes KV for the drafted tokens too,
so ``append_draft_slots`` gives a request blocks for them beforehand. After the pass
only the accepted drafts' KV is valid. ``release_slots_after`` frees the blocks that now
lie wholly past the request's tokens (only rejected drafts used them: fresh, unshared,
never hashed), and ``cache_full_blocks`` publishes the blocks that accepted drafts
filled. A block is hashed only once every one of its tokens is *computed*, so a rejected
draft's KV never enters the prefix cache; the stale slots left in a kept block lie past
the request's computed tokens and are overwritten before anything reads them.
"""

import hashlib
from array import array
from collections import deque

from sequence import Sequence


def compute_hash(token_ids: list[int], parent_hash: int) -> int:
    """Hash of one full block, chained to the hash of the block before it (-1 for none)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # in [0, 2**63): never -1, fits 8 signed bytes


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
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.remove(block_id)  # O(n) here; vLLM uses a linked list
            self.used_block_ids.add(block_id)
        block.ref_count += 1
        return block

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
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        parent_hash = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            is_full = len(token_ids) == self.block_size
            block_id = -1
            if is_full and not cache_miss and (i + 1) * self.block_size < len(seq):
                self.num_prefix_queries += 1
                block_id = self.hash_to_block_id.get(compute_hash(token_ids, parent_hash), -1)
                if block_id != -1 and self.blocks[block_id].token_ids != tuple(token_ids):
                    block_id = -1  # a hash collision, not a hit
            if block_id == -1:
                cache_miss = True
                block = self._take_free_block()
                if is_full:
                    parent_hash = self._register(block, token_ids, parent_hash)
            else:
                self.num_prefix_hits += 1
                seq.num_cached_tokens += self.block_size
                block = self._share_block(block_id)
                parent_hash = block.hash
            seq.block_table.append(block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Drop a sequence's references; blocks reaching zero return to the free queue."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)  # keeps its hash: may still be hit
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Is there room for the KV of the sequence's last token (written by the next decode)?"""
        needed = seq.num_blocks - len(seq.block_table)  # 1 if the last token starts a new block
        return self.num_free_blocks >= needed

    def may_append(self, seq: Sequence) -> None:
        """Before a decode: add a block if needed; hash the last block if this token fills it."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)
        if len(seq) % self.block_size == 0:
            i = seq.num_blocks - 1
            parent_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
            self._register(self.blocks[seq.block_table[i]], seq.block(i), parent_hash)

    def can_append_drafts(self, seq: Sequence, num_drafts: int) -> bool:
        """Room for the KV of ``num_drafts`` drafted tokens after the sequence's own tokens?"""
        needed = -(-(len(seq) + num_drafts) // self.block_size) - len(seq.block_table)
        return self.num_free_blocks >= needed

    def append_draft_slots(self, seq: Sequence, num_drafts: int) -> None:
        """Before a verify pass: fresh blocks until the table covers the drafts' slots too."""
        while len(seq.block_table) * self.block_size < len(seq) + num_drafts:
            seq.block_table.append(self._take_free_block().block_id)

    def release_slots_after(self, seq: Sequence, num_tokens: int) -> None:
        """After a verify pass: free the blocks past the first ``num_tokens`` tokens.

        Only rejected drafts wrote into them, so each has one reference and no hash. They
        go back to the free queue, last first (as ``deallocate`` returns them), and leave
        the block table, which then holds ``ceil(num_tokens / block_size)`` blocks.
        """
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash == -1, f"block {block_id} is shared or cached"
            block.ref_count = 0
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)
        del seq.block_table[keep:]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash every block whose tokens are all computed and that has no hash yet, in order.

        A verify pass can fill a block with accepted drafts; publish it like any full block,
        chained to the block before it. Blocks holding uncomputed positions stay unhashed.
        """
        parent_hash = -1
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                self._register(block, seq.block(i), parent_hash)
            parent_hash = block.hash
