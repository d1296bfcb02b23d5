"""v05 - the block manager: the KV cache as a pool of fixed-size pages (card 9).

Up to v04 each request's cache was its own growing list. On a GPU that is a problem:
memory for a request's KV must be reserved up front, but nobody knows how many tokens a
request will generate, so engines reserved the maximum length and wasted most of it
(the vLLM paper measured 60-80% of KV memory lost to such fragmentation).

Paged KV borrows the idea of virtual memory. The cache is one big pool of ``num_blocks``
blocks of ``block_size`` token slots each. A request owns a list of block ids, its
``block_table``; its blocks need not be contiguous, and it gets a new block only when the
last one is full. At most ``block_size - 1`` slots per request are ever wasted.

API (the check/action pairs of nano-vLLM's ``engine/block_manager.py``):

- ``can_allocate(seq)`` / ``allocate(seq)``: blocks for every token of a request being
  prefilled;
- ``can_append(seq)`` / ``may_append(seq)``: before a decode, one more block if the token
  about to be written starts a new block;
- ``deallocate(seq)``: a finished (or preempted) request returns all its blocks.

Invariant: every block id is either in ``free_block_ids`` or in exactly one sequence's
block table (v07 relaxes "exactly one" to reference counting).
"""

from collections import deque

from sequence import Sequence


class BlockManager:
    """Hands out block ids from a free queue and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # take from the left
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        self.used_block_ids.add(block_id)
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        # TODO(v05): Are at least seq.num_blocks blocks free?
        raise NotImplementedError("TODO(v05): write BlockManager.can_allocate (see NOTES.md)")

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence about to be prefilled one block per ``block_size`` tokens."""
        # TODO(v05): Append seq.num_blocks blocks to seq.block_table, each taken from the
        # FRONT of free_block_ids and recorded in used_block_ids (_allocate_block does one).
        raise NotImplementedError("TODO(v05): write BlockManager.allocate (see NOTES.md)")

    def deallocate(self, seq: Sequence) -> None:
        """Return all of a sequence's blocks to the free queue."""
        # TODO(v05): Walk seq.block_table in REVERSE, moving each block from used_block_ids
        # to the BACK of free_block_ids; then clear the table.
        raise NotImplementedError("TODO(v05): write BlockManager.deallocate (see NOTES.md)")

    def can_append(self, seq: Sequence) -> bool:
        """Is there room for the KV of the sequence's last token (written by the next decode)?"""
        # TODO(v05): Before a decode: if the sequence needs one more block than its table
        # holds (seq.num_blocks > len(seq.block_table)), is one free?
        raise NotImplementedError("TODO(v05): write BlockManager.can_append (see NOTES.md)")

    def may_append(self, seq: Sequence) -> None:
        """Add a block if the token about to be written starts a new one."""
        # TODO(v05): If seq.num_blocks > len(seq.block_table), take one more block for it.
        raise NotImplementedError("TODO(v05): write BlockManager.may_append (see NOTES.md)")
