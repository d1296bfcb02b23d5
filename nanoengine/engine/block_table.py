"""The block tables of the requests in flight, kept as one tensor and updated in place (chapters 4 and 10).

Attention reads a sequence's earlier K/V through its block table. Rebuilding the step's
(sequences, blocks) table from Python lists costs time in *all* the blocks of *all* the running
requests, although a decoding request gains one block only every ``block_size`` steps. So
``BlockTables`` keeps one persistent int32 tensor with a row per request in flight: each scheduled
request names the blocks it gained (``ScheduledRequest.new_block_ids``), its row receives exactly
those, and the step gathers its rows with one ``index_select``. vLLM v1 keeps its block tables the
same way (a persistent CPU tensor per worker, fed the new block ids in its scheduler output).

A row is told, never guesses: a new row is written whole, and entries past the blocks a request
still holds (speculative decoding gave back what only rejected drafts used) are cleared first.
Rows of requests no longer running are taken back only when a new request needs one, so nothing
has to tell this class that a request ended.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from nanoengine.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from nanoengine.engine.scheduler import ScheduledRequest


@dataclass
class _Row:
    """One request's row of the table."""

    index: int  # the row of ``BlockTables.table``
    owner: weakref.ref  # the request (weakly: a row never keeps a finished request alive)
    filled: int = 0  # entries written: the request's first ``filled`` block ids


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

    def rows(self, scheduled: Sequence[ScheduledRequest]) -> list[int]:
        """Each scheduled request's row index, its blocks written: the step's ``new_block_ids``
        appended after the ones it kept (a request seen for the first time: all of them)."""
        indices: list[int] = []
        for s in scheduled:
            request, new = s.request, s.new_block_ids
            ids = request.block_ids
            if len(ids) > self.max_blocks_per_seq:
                raise ValueError(f"request {request.request_id} holds {len(ids)} blocks, more than a row's "
                                 f"{self.max_blocks_per_seq} (max_model_len / block_size)")
            row = self._rows.get(request.request_id)
            if row is None:
                row = self._assign(request, indices)
            elif row.owner() is not request:  # the id belonged to a request that has ended: take its row over
                row.owner = weakref.ref(request)
                self._clear(row, 0)
            kept = 0 if row.filled == 0 else len(ids) - len(new)  # a new row is written whole
            if kept > row.filled:
                raise ValueError(f"request {request.request_id} holds {len(ids)} blocks but its row has "
                                 f"{row.filled} and the step names {len(new)} new ones: the scheduler must "
                                 f"name every block it allocates (ScheduledRequest.new_block_ids)")
            self._clear(row, kept)  # entries past the kept ones: blocks given back since
            if len(ids) > kept:
                self.table[row.index, kept:len(ids)] = torch.tensor(ids[kept:], dtype=torch.int32)
                row.filled = len(ids)
            indices.append(row.index)
        return indices

    def check_rows(self, requests: Sequence[Request]) -> None:
        """Raise ``AssertionError`` where a request's row does not hold its block ids (the invariant
        ``rows`` keeps: every block the scheduler allocated was named, every block given back cleared)."""
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.owner() is not request:
                continue  # not scheduled since it was admitted: the next ``rows`` writes it whole
            ids = request.block_ids
            held = self.table[row.index, :row.filled].tolist()
            if held[:len(ids)] != ids:
                raise AssertionError(f"block table row of {request.request_id} holds {held}, its blocks are {ids}")

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

    def _clear(self, row: _Row, keep: int = 0) -> None:
        """Entries past the first ``keep`` back to -1."""
        if row.filled > keep:
            self.table[row.index, keep:row.filled] = -1
            row.filled = keep

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
