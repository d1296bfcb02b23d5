"""The persistent block tables (``engine/block_table.py``): rows updated in place from each step's new block ids."""

from __future__ import annotations

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.engine.block_table import BlockTables
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.engine.scheduler import ScheduledRequest


def running(request_id: str, block_ids: list[int]) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams())
    request.block_ids, request.status = block_ids, RequestStatus.RUNNING
    return request


def step(*requests: Request, new: dict[Request, tuple[int, ...]] | None = None) -> list[ScheduledRequest]:
    """The requests scheduled for one token each, ``new`` naming the blocks some gained for it."""
    new = new or {}
    return [ScheduledRequest.make(r, 1, new_block_ids=new.get(r, ())) for r in requests]


def test_a_step_writes_only_the_blocks_it_names_as_new(monkeypatch):
    tables = BlockTables(max_blocks_per_seq=8, capacity=4)
    a, b = running("a", [5, 1]), running("b", [3])
    rows = tables.rows(step(a, b))  # first seen: written whole
    assert tables.gather(rows, 2).tolist() == [[5, 1], [3, -1]]
    copied = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, **kw: copied.append(list(data)) or real_tensor(data, **kw))
    a.block_ids.append(9)  # the block manager appends in place
    assert tables.rows(step(a, b, new={a: (9,)})) == rows  # same rows, step after step
    assert copied == [[9]]  # only the new block was written
    monkeypatch.undo()
    assert tables.gather(rows, 3).tolist() == [[5, 1, 9], [3, -1, -1]]


def test_a_readmitted_request_rewrites_its_row_and_clears_its_tail():
    tables = BlockTables(max_blocks_per_seq=8, capacity=2)
    a = running("a", [4, 6, 7])
    row = tables.rows(step(a))[0]
    a.block_ids = [2]  # freed (preempted) and admitted again: every block is new
    assert tables.rows(step(a, new={a: (2,)})) == [row]
    assert tables.table[row].tolist() == [2] + [-1] * 7


def test_a_block_allocated_but_not_named_is_refused():
    tables = BlockTables(max_blocks_per_seq=8, capacity=2)
    a = running("a", [4])
    tables.rows(step(a))
    a.block_ids.append(5)
    with pytest.raises(ValueError, match="holds 2 blocks but its row has 1 and the step names 0 new ones"):
        tables.rows(step(a))


def test_rows_of_requests_that_stopped_running_are_reused_and_the_table_grows_when_needed():
    tables = BlockTables(max_blocks_per_seq=4, capacity=2)
    a, b = running("a", [1]), running("b", [2])
    first = tables.rows(step(a, b))
    a.status = RequestStatus.FINISHED_LENGTH
    c = running("c", [3, 4])
    assert tables.rows(step(b, c)) == [first[1], first[0]]  # c took a's row
    assert tables.gather([first[0]], 4).tolist() == [[3, 4, -1, -1]]
    d, e = running("d", [5]), running("e", [6])
    rows = tables.rows(step(b, c, d, e))  # nobody to reclaim: the table doubles
    assert tables.capacity == 4 and len(set(rows)) == 4
    assert tables.gather(rows, 2).tolist() == [[2, -1], [3, 4], [5, -1], [6, -1]]


def test_a_reused_request_id_gets_its_own_row():
    tables = BlockTables(max_blocks_per_seq=4, capacity=2)
    old = running("x", [1, 2])
    tables.rows(step(old))
    old.status = RequestStatus.FINISHED_STOPPED
    new = running("x", [7])
    row = tables.rows(step(new, new={new: (7,)}))[0]
    assert tables.gather([row], 2).tolist() == [[7, -1]]


def test_a_table_longer_than_a_row_is_refused():
    tables = BlockTables(max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="holds 3 blocks, more than a row's 2"):
        tables.rows(step(running("a", [1, 2, 3])))


@pytest.mark.slow
def test_a_row_never_keeps_a_finished_request_alive():
    import gc
    import weakref

    tables = BlockTables(max_blocks_per_seq=4, capacity=1)
    gone = running("gone", [1])
    tables.rows(step(gone))
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
    assert tables.rows(step(running("next", [2]))) == [0]  # its row is free again


def test_rejected_drafts_given_back_then_new_slots_reach_the_row():
    """Speculative decoding frees the blocks only rejected drafts used; the next verify may take
    new ones at the same places. The row must name the new blocks, not the ones given back."""
    from nanoengine.engine.block_manager import BlockManager, gained_blocks

    manager, tables = BlockManager(num_blocks=16, block_size=4), BlockTables(max_blocks_per_seq=8, capacity=2)
    request = Request("a", list(range(7)), SamplingParams())
    request.status = RequestStatus.RUNNING
    assert manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    assert manager.allocate_slots(request, 5)  # one token and four drafts: positions 7-11, a third block
    row = tables.rows(step(request))[0]  # first seen: written whole
    given_back = request.block_ids[2]
    manager.release_slots_after(request, 8)  # all four drafts rejected: the list shrinks in place
    tables.check_rows([request])
    held = len(request.block_ids)
    assert manager.allocate_slots(request, 5)  # the next verify needs a third block again: another one
    assert request.block_ids[2] != given_back
    assert tables.rows(step(request, new={request: gained_blocks(request, held)})) == [row]
    assert tables.table[row, :3].tolist() == request.block_ids
    tables.check_rows([request])


def test_check_rows_catches_a_row_that_does_not_hold_the_requests_blocks():
    tables = BlockTables(max_blocks_per_seq=8, capacity=2)
    a = running("a", [4, 6, 7])
    tables.rows(step(a))
    a.block_ids[1:] = [9, 3]  # blocks swapped behind the table's back
    with pytest.raises(AssertionError, match=r"holds \[4, 6, 7\], its blocks are \[4, 9, 3\]"):
        tables.check_rows([a])
