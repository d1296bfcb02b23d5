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

One map says which row is whose: request id -> ``_Row`` (its index in the tensor, its
request, the list it mirrors and how much of it is copied). A row knows which list it
mirrors (``Request.block_ids``): the block manager only ever appends to that list, and
replaces it with a new one when it frees or forks. A new list (a preempted request
admitted again, a forked sibling) means the row is written afresh. Rows of requests that
are no longer running are taken back only when a new request needs one and none is
free, so nothing has to tell this class that a request ended; a row refers to its
request weakly, so it never keeps a finished request alive (it keeps at most its last
block list, until the row is reused).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from nanoengine.engine.request import Request, RequestStatus


@dataclass
class _Row:
    """One request's row of the table."""

    index: int  # the row of ``BlockTables.table``
    owner: weakref.ref  # the request (weakly: a row never keeps a finished request alive)
    source: list[int] | None = None  # the ``block_ids`` list the row mirrors (None: write afresh)
    filled: int = 0  # entries of that list copied so far


class BlockTables:
    """Rows of one persistent (rows, max_blocks_per_seq) int32 tensor, one per request in flight."""

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        if max_blocks_per_seq < 1 or capacity < 1:
            raise ValueError(f"max_blocks_per_seq and capacity must be >= 1, got {max_blocks_per_seq} and {capacity}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = torch.full((capacity, max_blocks_per_seq), -1, dtype=torch.int32)
        self._rows: dict[str, _Row] = {}  # request id -> its row
        self._free = list(range(capacity - 1, -1, -1))  # unused row indices, the next one last

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def rows(self, requests: Sequence[Request]) -> list[int]:
        """Each request's row index, brought up to date with its block table (only new blocks are copied)."""
        indices: list[int] = []
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None:
                row = self._assign(request, indices)
            elif row.owner() is not request:  # the id belonged to a request that has ended: take its row over
                row.owner, row.source = weakref.ref(request), None
            ids = request.block_ids
            if row.source is not ids or len(ids) < row.filled:  # a new list: write the row afresh
                self._clear(row)
                row.source = ids
            if len(ids) > self.max_blocks_per_seq:
                raise ValueError(f"request {request.request_id} holds {len(ids)} blocks, more than a row's "
                                 f"{self.max_blocks_per_seq} (max_model_len / block_size)")
            if len(ids) > row.filled:
                self.table[row.index, row.filled:len(ids)] = torch.tensor(ids[row.filled:], dtype=torch.int32)
                row.filled = len(ids)
            indices.append(row.index)
        return indices

    def check_mirrors(self, requests: Sequence[Request]) -> None:
        """Raise ``AssertionError`` where a row no longer mirrors the list it was copied from.

        ``rows`` copies only what a list gained since last time, trusting that a list it has
        seen only grows at its end. A block manager that removed or replaced blocks inside a
        list it kept (instead of handing the request a new one) would leave the row pointing
        at blocks the request no longer holds, and attention would read another's KV.
        """
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.source is not request.block_ids:
                continue  # not copied yet, or a new list: the next ``rows`` writes it afresh
            seen = min(row.filled, len(request.block_ids))
            if self.table[row.index, :seen].tolist() != request.block_ids[:seen]:
                raise AssertionError(f"block table row of {request.request_id} holds "
                                     f"{self.table[row.index, :seen].tolist()}, its blocks are "
                                     f"{request.block_ids[:seen]}: a list was edited in place")

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The given rows' first ``width`` entries, as a new (len(rows), width) tensor."""
        index = torch.tensor(rows, dtype=torch.long)
        return self.table[:, :width].index_select(0, index)

    def _assign(self, request: Request, in_use: list[int]) -> _Row:
        if not self._free:
            self._reclaim(set(in_use))
        if not self._free:
            self._grow()
        row = self._rows[request.request_id] = _Row(self._free.pop(), weakref.ref(request))
        return row

    def _clear(self, row: _Row) -> None:
        if row.filled:
            self.table[row.index, :row.filled] = -1
        row.source, row.filled = None, 0

    def _reclaim(self, in_use: set[int]) -> None:
        """Free the rows of requests that are not running (finished, waiting again, a probe)."""
        for request_id, row in list(self._rows.items()):
            owner = row.owner()
            if row.index not in in_use and (owner is None or owner.status != RequestStatus.RUNNING):
                self._clear(row)
                del self._rows[request_id]
                self._free.append(row.index)

    def _grow(self) -> None:
        old = self.capacity
        self.table = torch.cat((self.table, torch.full_like(self.table, -1)))
        self._free = list(range(2 * old - 1, old - 1, -1))
