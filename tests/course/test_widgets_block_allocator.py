"""Tests for widgets.block_allocator: the paged grid and the contiguous comparison.

Driven through the view's own controls (values set, buttons clicked), on a tiny random
model; assertions are on the live engine and on what the view shows.
"""

from __future__ import annotations

import re
import time

import pytest

from nanoengine import SamplingParams
from widgets import single_thread, tiny_engine
from widgets.block_allocator import (BlockAllocatorController, BlockAllocatorView, ContiguousAllocator,
                                     render_grid)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():  # tiny matmuls: thread wake-ups cost more than the work
        yield


def make_view(**engine_kwargs) -> BlockAllocatorView:
    options = dict(num_kv_blocks=64, block_size=4, max_model_len=64)
    options.update(engine_kwargs)
    return BlockAllocatorView(tiny_engine(**options))


def add(view: BlockAllocatorView, prompt_len: int, max_tokens: int, shared: bool = False) -> None:
    view.prompt_len.value, view.max_tokens.value, view.shared.value = prompt_len, max_tokens, shared
    view.add_button.click()


def cells_by_state(view: BlockAllocatorView, state: str) -> list[str]:
    return re.findall(rf'class="ne-block ne-{state}" data-block="(\d+)"', view.grid.value)


# ----------------------------------------------------------------------------------------
# The contiguous allocator on its own
# ----------------------------------------------------------------------------------------


def test_contiguous_allocator_first_fit_holes_and_head_of_line_blocking() -> None:
    alloc = ContiguousAllocator(100)
    alloc.request("a", 40)
    alloc.request("b", 30)
    alloc.request("c", 20)
    assert [(r.start, r.size) for r in alloc.regions.values()] == [(0, 40), (40, 30), (70, 20)]
    alloc.release("b")
    assert alloc.holes() == [(40, 30), (90, 10)]
    alloc.request("d", 35)  # fits no hole although 40 slots are free: external fragmentation
    alloc.request("e", 5)  # would fit, but waits behind d (first come, first served)
    assert list(alloc.waiting) == ["d", "e"]
    alloc.release("a")  # merges into a 70-slot hole at 0
    assert alloc.regions["d"].start == 0 and alloc.regions["e"].start == 35
    with pytest.raises(ValueError, match="can never fit"):
        alloc.request("huge", 101)


# ----------------------------------------------------------------------------------------
# The view on a live engine
# ----------------------------------------------------------------------------------------


def test_add_step_finish_abort_through_the_controls() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 10, 6)
    add(view, 5, 3)
    assert view.request_picker.options == ("0", "1")
    assert "added request 1" in view.message.value
    assert not cells_by_state(view, "used")  # queued, nothing allocated before a step

    view.step_button.click()
    engine.check_invariants()
    snap = engine.snapshot()
    held = {r.request_id: r.block_ids for r in snap.running}
    assert held == {"0": held["0"], "1": held["1"]} and len(held["0"]) == 3 and len(held["1"]) == 2
    used = cells_by_state(view, "used")
    assert sorted(map(int, used)) == sorted(held["0"] + held["1"])
    assert f'data-block="{held["0"][0]}" data-owner="0" data-fill="4"' in view.grid.value
    assert re.search(r"<b>5</b> used · <b>59</b> free", view.counts.value)

    view.request_picker.value = "1"
    view.finish_button.click()
    assert "request 1 finished after" in view.message.value
    assert "1" not in engine.requests and view.request_picker.options == ("0",)

    view.request_picker.value = "0"
    view.abort_button.click()
    assert "aborted" in view.message.value and not engine.has_unfinished_requests()
    assert not cells_by_state(view, "used")
    assert "released blocks" in view.event_log.value
    engine.check_invariants()


def test_shared_prefix_blocks_have_ref_count_two_and_stay_cached_after_finish() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 20, 4, shared=True)  # the default shared prefix is 4 blocks (16 tokens)
    view.step_button.click()  # computes the first prompt: its full blocks enter the prefix cache
    add(view, 20, 4, shared=True)
    view.step_button.click()
    running = {r.request_id: r for r in engine.snapshot().running}
    first, second = running["0"].block_ids, running["1"].block_ids
    assert first[:4] == second[:4] and first[4] != second[4]
    assert running["1"].num_cached_tokens == 16
    for block_id in first[:4]:
        assert f'data-block="{block_id}" data-owner="0,1" data-fill="4" data-ref="2"' in view.grid.value
    assert "<b>4</b> shared" in view.counts.value
    assert "reuses cached blocks" in view.event_log.value

    for rid in ("0", "1"):
        view.request_picker.value = rid
        view.finish_button.click()
    assert len(cells_by_state(view, "cached")) >= 4  # free, but still holding prefix-cache hashes
    assert view.controller.counts()["cached_free"] == engine.snapshot().num_cached_blocks
    engine.check_invariants()


def test_memory_figures_come_from_the_kv_tensor() -> None:
    view = make_view()
    c = view.controller
    engine = c.engine
    assert c.bytes_per_block * c.num_blocks == engine.runner.kv_cache_bytes
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 8 x 4 bytes x 4 tokens per block
    assert c.bytes_per_block == 2 * 2 * 2 * 8 * 4 * 4
    assert "1.00 KiB per block" in view.counts.value and "64.00 KiB" in view.counts.value


def test_contiguous_max_len_reservation_wastes_what_paging_does_not() -> None:
    view = make_view()  # 64 blocks x 4 tokens = 256 slots = four 64-token reservations
    c = view.controller
    for _ in range(5):
        add(view, 8, 8)
    view.step_button.click()
    view.step_button.click()
    engine = c.engine
    snap = engine.snapshot()
    assert len(snap.running) == 5  # paging runs all five
    contiguous, paged = c.contiguous_report(), c.paged_report()
    assert contiguous.num_placed == 4 and contiguous.num_waiting == 1  # max_model_len reservations
    assert "4" in view.contiguous.value.split("ne-contiguous-waiting")[1][:10]

    computed = {r.request_id: r.num_computed_tokens for r in snap.running}
    placed = [rid for rid in c.contiguous.regions]
    assert contiguous.stored_tokens == sum(computed[rid] for rid in placed)
    assert contiguous.reserved_tokens == sum(16 - computed[rid] for rid in placed)
    assert contiguous.internal_tokens == 4 * (64 - 16)
    assert paged.stored_tokens == sum(computed.values())
    assert paged.internal_tokens == sum(-(-n // 4) * 4 - n for n in computed.values())
    assert paged.internal_tokens < 4 * len(computed)  # under one block per request
    assert paged.external_tokens == 0 and paged.reserved_tokens == 0
    assert contiguous.waste_fraction > 0.6 and paged.waste_fraction < contiguous.waste_fraction / 3
    table = view.report.value
    waste = re.search(r"ne-waste-contiguous'>([\d.]+)%", table).group(1)
    assert float(waste) == pytest.approx(100 * contiguous.waste_fraction, abs=0.05)


def test_external_fragmentation_when_reserving_per_request() -> None:
    view = make_view(max_model_len=128)  # 256 slots
    c = view.controller
    view.reserve.value = "request"
    add(view, 50, 50)  # 100 slots at 0
    add(view, 30, 30)  # 60 slots at 100
    add(view, 45, 45)  # 90 slots at 160; 6 slots left at the end
    view.step_button.click()
    view.request_picker.value = "1"
    view.abort_button.click()  # leaves a 60-slot hole between two reservations
    add(view, 40, 24)  # needs 64 contiguous slots: 66 are free, but in pieces of 60 and 6
    view.step_button.click()
    assert list(c.contiguous.waiting) == ["3"]
    assert "3" in {r.request_id for r in c.engine.snapshot().running}  # paging admits it
    report = c.contiguous_report()
    assert report.free_tokens == 66 and report.external_tokens == 66
    assert 'title="external fragmentation' in view.contiguous.value


def test_bad_input_shows_a_message_and_leaves_the_engine_unchanged() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 8, 4)
    view.step_button.click()
    before = engine.snapshot()
    cases = [
        (dict(prompt_len=65, max_tokens=1), "max_model_len is 64"),
        (dict(prompt_len=60, max_tokens=10), "exceeds max_model_len"),
        (dict(prompt_len=0, max_tokens=4), "prompt length must be"),
        (dict(prompt_len=8, max_tokens=0), "max tokens must be"),
    ]
    for values, expected in cases:
        add(view, values["prompt_len"], values["max_tokens"])
        assert "ne-msg-error" in view.message.value and expected in view.message.value, values
        assert engine.snapshot() == before
    view.request_picker.options = ()
    view.finish_button.click()
    assert "no request selected" in view.message.value
    with pytest.raises(ValueError, match="no unfinished request"):
        view.controller.abort("nope")
    assert engine.snapshot() == before


def test_step_with_nothing_to_do_is_a_message() -> None:
    view = make_view()
    before = view.controller.engine.snapshot()
    view.step_button.click()
    assert "nothing to step" in view.message.value
    assert view.controller.engine.snapshot() == before


def test_requests_added_by_other_code_are_tracked_and_close_unsubscribes() -> None:
    view = make_view()
    engine = view.controller.engine
    engine.add_request(list(range(100, 110)), None, request_id="outside")
    view.refresh()
    assert "outside" in view.controller.live_requests and "outside" in view.controller.contiguous.regions
    view.controller.close()
    n = len(view.controller.log)
    engine.step()
    assert len(view.controller.log) == n


@pytest.mark.slow
def test_a_thousand_block_grid_redraws_fast() -> None:
    engine = tiny_engine(num_kv_blocks=1000, block_size=16, max_model_len=256, max_num_seqs=64,
                         max_num_batched_tokens=4096)
    c = BlockAllocatorController(engine)
    for _ in range(64):
        c.add_request(180, 8)
    while engine.snapshot().waiting:
        c.step()
    assert len(engine.snapshot().running) == 64 and engine.snapshot().num_free_blocks <= 1000 - 64 * 12
    snapshots, snapshot = [], engine.snapshot
    engine.snapshot = lambda: snapshots.append(1) or snapshot()
    html = render_grid(c)
    assert html.count('class="ne-block ') == 1000 and len(snapshots) == 1  # one snapshot, not one per block
    # Linear in the blocks: a ratio of two timings, not seconds (a busy machine makes any such limit flaky).
    cells = c.cells()

    def fastest(cells) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            render_grid(c, cells)
            times.append(time.perf_counter() - start)
        return min(times)

    ten_times_the_blocks = fastest(cells) / fastest(cells[:100])
    assert ten_times_the_blocks < 40, f"1000 blocks took {ten_times_the_blocks:.0f}x as long as 100"


def test_switching_the_reserve_policy_rebuilds_the_contiguous_side_from_live_requests() -> None:
    """The issue's case: 'reserve prompt + max tokens' showed 0 reservations, 0 stored and
    100% waste, and stayed empty through later steps."""
    view = make_view()  # 64 blocks x 4 tokens = 256 slots; max_model_len 64
    c = view.controller
    for _ in range(3):
        add(view, 8, 8)
    view.step_button.click()
    assert [r.size for r in c.contiguous.regions.values()] == [64, 64, 64]

    view.reserve.value = "request"
    assert "rebuilt for the 3 unfinished request(s)" in view.message.value
    assert [(r.request_id, r.start, r.size) for r in c.contiguous.regions.values()] == [
        ("0", 0, 16), ("1", 16, 16), ("2", 32, 16)]
    report = c.contiguous_report()
    assert report.num_placed == 3 and report.num_waiting == 0
    assert report.stored_tokens == c.paged_report().stored_tokens == 24
    assert report.reserved_tokens == 3 * (16 - 8) and report.internal_tokens == 0
    assert report.waste_fraction == pytest.approx(24 / 48)
    assert "reserving prompt + max tokens" in view.headline.value
    assert re.search(r"ne-headline-placed-contiguous\">3 / 0<", view.headline.value)

    view.step_button.click()  # and it keeps following the engine
    report = c.contiguous_report()
    assert report.num_placed == 3 and report.stored_tokens == 27
    view.reserve.value = "max_model_len"
    assert [r.size for r in c.contiguous.regions.values()] == [64, 64, 64]
    assert c.contiguous_report().stored_tokens == 27


def test_the_view_redraws_after_steps_run_by_other_code() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 8, 2)
    assert not cells_by_state(view, "used") and not view.step_button.disabled
    engine.step()  # a notebook cell, not the Step button
    assert len(cells_by_state(view, "used")) == 2
    assert re.search(r"ne-headline-placed-paged\">1 / 0<", view.headline.value)
    engine.add_request(list(range(100, 106)), SamplingParams(max_tokens=3, ignore_eos=True),
                       request_id="outside")  # queued by other code
    assert "outside" in view.request_picker.options and "outside" in view.controller.contiguous.regions
    while engine.has_unfinished_requests():
        engine.step()
    assert not cells_by_state(view, "used") and view.controller.contiguous.regions == {}
    assert view.step_button.disabled and view.finish_button.disabled  # nothing left to step or end


def test_n_completions_share_the_prompt_blocks_in_the_view() -> None:
    view = BlockAllocatorView(tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64))
    c = view.controller
    c.add_request(prompt_len=10, max_tokens=4, n=3)  # 2 full blocks of 4 tokens, 2 tokens in a third
    c.step()  # completion 0 computes the prompt; its siblings are queued
    c.step()  # the siblings are admitted sharing its 2 full blocks
    shared = [cell for cell in c.cells() if cell.ref_count > 1]
    assert len(shared) == 2 and all(cell.ref_count == 3 and len(cell.owners) == 3 for cell in shared)
    while c.engine.has_unfinished_requests():
        c.step()
    assert not [cell for cell in c.cells() if cell.ref_count]
    with pytest.raises(ValueError, match="completions"):
        c.add_request(prompt_len=10, max_tokens=4, n=0)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens, shared_after", [(6, 2), (2, 0)])
def test_chapter_7_recipe_shows_a_shared_block_with_its_preset_lengths(max_tokens, shared_after) -> None:
    """Chapter 7's "Try it": the pool and lengths of its cell; add, step, add, step.

    With 6 tokens out the first request is still decoding when the second is admitted, so two
    blocks are shared; with the old preset (2) it finished in that step and nothing was."""
    engine = tiny_engine(num_kv_blocks=8, block_size=4, max_model_len=32)
    view = BlockAllocatorView(engine, contiguous_reserve="request", shared_prefix_len=8)
    view.prompt_len.value, view.max_tokens.value = 10, max_tokens
    view.shared.value = True
    for _ in range(2):
        view.add_button.click()
        view.step_button.click()
    assert f"<b>{shared_after}</b> shared" in view.counts.value
    running = engine.snapshot().running
    if shared_after:
        assert len(running) == 2 and running[0].block_ids[:2] == running[1].block_ids[:2]
        assert sum(b.ref_count == 2 for b in engine.snapshot().blocks) == 2
