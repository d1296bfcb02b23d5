"""The block tables of the requests in flight, kept as one tensor and updated in place (chapters 4 and 10).

Attention reads a sequence's earlier K/V through its block table, so every step hands the
kernels a (sequences, blocks) table. Rebuilding it from Python lists each step costs time
proportional to *all* the blocks of *all* the running requests (256 requests of 2,048
tokens: 32,768 entries copied, padded and converted every step), although from one step
to the next almost nothing changes: a decoding request gains one block every
``block_size`` steps.

``BlockTables`` keeps one persistent int32 tensor with a row per request in flight. A step
looks up each scheduled request's row, copies only the blocks it gained since it was last
seen, and gathers the rows it needs with one ``index_select``. vLLM v1 keeps its block
tables the same way (a persistent CPU tensor per worker, rows appended to, then copied to
the GPU).

A row knows which list it mirrors (``Request.block_ids``): the block manager only ever
appends to that list, and replaces it with a new one when it frees or forks. A new list
(a preempted request admitted again, a forked sibling) means the row is written afresh.
Rows of requests that are no longer running are taken back only when a new request
needs one and none is free, so nothing has to tell this class that a request ended; a
row refers to its request weakly, so it never keeps a finished request alive (it keeps
at most its last block list, until the row is reused).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from nanoengine.engine.request import Request


class BlockTables:
    """Rows of one persistent (rows, max_blocks_per_seq) int32 tensor, one per request in flight."""

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        if max_blocks_per_seq < 1 or capacity < 1:
            raise ValueError(f"max_blocks_per_seq and capacity must be >= 1, got {max_blocks_per_seq} and {capacity}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = torch.full((capacity, max_blocks_per_seq), -1, dtype=torch.int32)
        self._row_of: dict[str, int] = {}  # request id -> its row
        # Weak references: a row never keeps a finished request alive.
        self._owner: list[weakref.ref | None] = [None] * capacity
        self._owner_id: list[str | None] = [None] * capacity
        self._source: list[list[int] | None] = [None] * capacity  # the block_ids list a row mirrors
        self._filled = [0] * capacity  # entries of the row copied so far
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def rows(self, requests: Sequence["Request"]) -> list[int]:
        """Each request's row, brought up to date with its block table (only new blocks are copied)."""
        rows: list[int] = []
        for request in requests:
            row = self._row_of.get(request.request_id)
            if row is None or self._owner[row] is None or self._owner[row]() is not request:
                row = self._assign(request, rows)
            ids, filled = request.block_ids, self._filled[row]
            if self._source[row] is not ids or len(ids) < filled:  # a new list: write the row afresh
                self._source[row] = ids
                if filled:
                    self.table[row, :filled] = -1
                filled = self._filled[row] = 0
            if len(ids) > self.max_blocks_per_seq:
                raise ValueError(f"request {request.request_id} holds {len(ids)} blocks, more than a row's "
                                 f"{self.max_blocks_per_seq} (max_model_len / block_size)")
            if len(ids) > filled:
                self.table[row, filled:len(ids)] = torch.tensor(ids[filled:], dtype=torch.int32)
                self._filled[row] = len(ids)
            rows.append(row)
        return rows

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The given rows' first ``width`` entries, as a new (len(rows), width) tensor."""
        index = torch.tensor(rows, dtype=torch.long)
        return self.table[:, :width].index_select(0, index)

    def _assign(self, request: "Request", in_use: list[int]) -> int:
        if not self._free:
            self._reclaim(set(in_use))
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._row_of[request.request_id] = row
        self._owner[row], self._owner_id[row] = weakref.ref(request), request.request_id
        self._source[row] = None  # written afresh by the caller
        return row

    def _reclaim(self, in_use: set[int]) -> None:
        """Free the rows of requests that are not running (finished, waiting again, a probe)."""
        from nanoengine.engine.request import RequestStatus

        for row, ref in enumerate(self._owner):
            if ref is None or row in in_use:
                continue
            owner = ref()
            if owner is None or owner.status != RequestStatus.RUNNING:
                if self._row_of.get(self._owner_id[row]) == row:
                    del self._row_of[self._owner_id[row]]
                self._owner[row] = self._owner_id[row] = self._source[row] = None
                self._free.append(row)

    def _grow(self) -> None:
        old = self.capacity
        self.table = torch.cat((self.table, torch.full_like(self.table, -1)))
        self._owner += [None] * old
        self._owner_id += [None] * old
        self._source += [None] * old
        self._filled += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
