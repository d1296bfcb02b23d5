"""v05 checks - the paged KV cache, preemption, and refusing what can never fit (card 9).

v05 does three things - paging, preemption, refusing a request that can never fit - and
the lab comes in three parts, in the order they can be checked: A - paging in the block
manager and the model; B - refusing at ``add`` time; C - the scheduler with pages:
allocate at admission, a block per decode, and preemption when the pool runs dry.
"""

import math

import pytest

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end


def _check_exclusive_ownership(engine) -> None:
    bm = engine.block_manager
    owned = [b for seq in engine.scheduler.running for b in seq.block_table]
    assert len(owned) == len(set(owned)), f"a block is owned twice: {owned}"
    assert set(owned).isdisjoint(bm.free_block_ids), "a block is both owned and free"
    assert set(owned) | set(bm.free_block_ids) == set(range(bm.num_blocks)), "a block went missing"
    assert all(not seq.block_table for seq in engine.scheduler.waiting), "a waiting request holds blocks"


def test_a_block_manager_hands_out_and_takes_back_blocks(lab) -> None:
    """Part A: allocate takes ceil(tokens / block_size) blocks from the front; deallocate returns them.

    Hint: memory comes in fixed-size pages: a request owns just enough pages for its tokens,
    gets one more only when its last page is full, and gives all of them back when it ends. The
    order of the free list decides which ids are reused first, and the transcript depends on it.
    """
    mods = lab.load("block_manager", "sequence")
    BlockManager, Sequence = mods.block_manager.BlockManager, mods.sequence.Sequence
    bm = BlockManager(num_blocks=5, block_size=4)
    seq = Sequence(0, [1] * 5, max_tokens=8, block_size=4)
    assert seq.num_blocks == 2
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert seq.block_table == [0, 1] and list(bm.free_block_ids) == [2, 3, 4] and bm.used_block_ids == {0, 1}
    for token in (2, 3, 4):  # 6, 7, 8 tokens: still two blocks
        seq.append_token(token)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert seq.block_table == [0, 1]
    seq.append_token(5)  # the 9th token starts block 3
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [0, 1, 2]
    big = Sequence(1, [1] * 13, max_tokens=1, block_size=4)
    assert not bm.can_allocate(big), "13 tokens need 4 blocks; only 2 are free"
    other = Sequence(2, [1] * 8, max_tokens=1, block_size=4)
    bm.allocate(other)
    for token in (6, 7, 8, 9):  # seq reaches 13 tokens: needs a 4th block, none is free
        seq.append_token(token)
    assert not bm.can_append(seq)
    bm.deallocate(seq)
    assert seq.block_table == [] and list(bm.free_block_ids) == [2, 1, 0]
    assert bm.used_block_ids == {3, 4} and bm.num_free_blocks == 3


def test_a_slots_follow_the_block_table(lab) -> None:
    """Part A: a token at position p lives at block_table[p // block_size] * block_size + p % block_size.

    Hint: a token's place in the pool is found through its request's page table: which page
    holds its position, then where in that page.
    """
    mods = lab.load("toy_model", "sequence")
    model = mods.toy_model.ToyModel(num_blocks=4, block_size=4)
    seq = mods.sequence.Sequence(0, [1] * 6, max_tokens=1, block_size=4)
    seq.block_table = [3, 0]
    assert [model.slot(seq, p) for p in range(6)] == [12, 13, 14, 15, 0, 1]


def test_b_a_request_that_can_never_fit_is_refused_at_add_time(lab) -> None:
    """Part B: add_request raises ValueError when prompt + max_tokens needs more blocks than the pool has.

    Hint: count the pages a request could need at its longest (prompt plus every token it may
    generate). If the whole pool is smaller, no amount of waiting or evicting helps: refuse it
    when it is added, with a message. One that fits exactly is fine.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=2, block_size=4)
    with pytest.raises(ValueError):
        engine.add_request([1] * 7, max_tokens=5)  # 12 tokens need 3 blocks
    engine.add_request([1] * 4, max_tokens=4)  # 8 tokens: exactly 2 blocks
    small_budget = lab.load("llm_engine").llm_engine.LLMEngine(max_num_batched_tokens=4)
    with pytest.raises(ValueError):
        small_budget.add_request([1] * 5, max_tokens=1)
    assert [list(s.token_ids) for s in engine.scheduler.waiting] == [[1] * 4]



def test_c_block_tables_stay_consistent_in_a_roomy_pool(lab) -> None:
    """Part C: in a roomy pool, each request holds ceil(tokens / block_size) blocks, none shared; all return.

    Hint: pages are taken when a request is admitted and before each decode that starts a new
    page; finished requests already return theirs. No eviction is needed for this check.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=32, block_size=4, max_num_seqs=4)
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in PROMPTS]
    outputs = {}
    for out in run_to_end(engine):
        for seq_id, table in out.block_tables.items():
            assert len(table) == math.ceil(out.context_lens[seq_id] / 4), (seq_id, table)
        _check_exclusive_ownership(engine)
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert engine.block_manager.num_free_blocks == 32 and not engine.block_manager.used_block_ids
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS]


def test_c_a_tight_pool_preempts_and_recomputes_exactly(lab) -> None:
    """Part C: when the pool runs dry a request is preempted, recomputed later, and its tokens do not change.

    Hint: when a decode needs a page and none is free, waiting cannot help (nobody else frees
    anything during this step): someone must be evicted, their pages freed, and the evicted
    request recomputed from its tokens when it is readmitted.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=6, block_size=4, max_num_seqs=4)
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in PROMPTS]
    preempted = 0
    outputs = {}
    while not engine.is_finished():
        out = engine.step()
        preempted += len(out.preempted_seq_ids)
        flat = [b for t in out.block_tables.values() for b in t]
        assert len(flat) == len(set(flat)), f"block owned twice in one step: {out.block_tables}"
        for seq_id, table in out.block_tables.items():
            assert len(table) == math.ceil(out.context_lens[seq_id] / 4)
        _check_exclusive_ownership(engine)
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert preempted > 0, "the small pool should force at least one preemption"
    assert engine.block_manager.num_free_blocks == 6 and not engine.block_manager.used_block_ids
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS]  # recompute is exact


def test_c_the_victim_is_the_newest_running_request(lab) -> None:
    """Part C: preemption evicts the NEWEST running request(s) and puts them at the front of waiting.

    Hint: evict by priority: under first-come-first-served the request admitted last has the
    lowest priority, so it goes first; a request evicts itself only when it is the last one
    running.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=6, block_size=4, max_num_seqs=4)
    for p in PROMPTS:
        engine.add_request(p, MAX_TOKENS)
    crowded_preemptions = 0
    while not engine.is_finished():
        before = [s.seq_id for s in engine.scheduler.running]  # admission order, oldest first
        out = engine.step()
        if out.preempted_seq_ids:
            newest_first = tuple(reversed(before))[:len(out.preempted_seq_ids)]
            assert out.preempted_seq_ids == newest_first, (
                f"running (oldest first) was {before}; preempted {list(out.preempted_seq_ids)}, "
                f"but the newest are {list(newest_first)}")
            assert engine.scheduler.waiting[0].seq_id == out.preempted_seq_ids[-1], \
                "a preempted request goes to the FRONT of waiting"
            crowded_preemptions += len(before) >= 3
    assert crowded_preemptions > 0, "expected a preemption while at least three requests were running"



def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt: paging changes where KV lives, not the result.

    Hint: if only this check fails, a token's state is being written to or read from the wrong
    slot: follow one token's position through its page table.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v05_paged_kv/expected_output.txt (same block ids too).

    Hint: block ids depend on the order of the free list and on who is evicted; the first
    differing line shows which decision went another way.
    """
    check_transcript(lab)
