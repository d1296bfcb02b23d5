"""Parallel sampling, ``SamplingParams(n=...)`` (chapters 4 and 8): one prompt, n completions.

The first completion computes the prompt; its full KV blocks are then shared by the n
sequences (reference count n), and each sibling recomputes the prompt's partly filled
last block instead of sharing it. The siblings are ordinary requests queued once the
prompt is computed (``parallel_sampling.ParentRequest``). They find its blocks in the
prefix cache; with the cache off, the scheduler forks them (``Request.fork_source``).
"""

from __future__ import annotations

import collections

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine.request import Request
from nanoengine.events import BlocksForked, PrefixCacheHit, RequestPreempted, RequestScheduled
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one


def engine(**config) -> LLMEngine:
    options = dict(device="cpu", block_size=16, num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, **{**options, **config})


def run(e: LLMEngine, check=None) -> dict:
    finals = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finals[out.request_id] = out
        e.check_invariants()
        if check is not None:
            check(e)
    return finals


def events_of(e: LLMEngine, kind: type) -> list:
    return [ev for ev in e.events.history if isinstance(ev, kind)]


def test_n_completions_share_the_prompt_blocks_through_the_prefix_cache_then_recompute_the_partial_one():
    e = engine()
    e.events.keep_history()
    rid = e.add_request(PROMPT, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True))
    assert rid == "0"
    e.step()  # the prompt in one step, by the first completion, which samples its first token
    snap = e.snapshot()
    assert [r.request_id for r in snap.running] == ["0_0"] and snap.running[0].num_output_tokens == 1
    # The siblings are queued only now, holding nothing yet, and marked for no fork: the cache will do.
    assert [(r.request_id, r.block_ids) for r in snap.waiting] == [(f"{i}_0", ()) for i in (1, 2, 3)]
    assert all(e.requests[f"{i}_0"].fork_source is None for i in (1, 2, 3))
    assert not events_of(e, PrefixCacheHit)
    e.step()  # the siblings are admitted: the cache holds the two full blocks, they compute the partial one
    snap = e.snapshot()
    assert [r.request_id for r in snap.running] == ["0_0", "1_0", "2_0", "3_0"] and not snap.waiting
    shared = snap.running[0].block_ids[:2]
    assert all(r.block_ids[:2] == shared for r in snap.running)
    assert [snap.blocks[b].ref_count for b in shared] == [4, 4]
    assert [r.num_computed_tokens for r in snap.running] == [41, 40, 40, 40]
    assert [r.num_output_tokens for r in snap.running] == [2, 1, 1, 1]
    third_blocks = {r.block_ids[2] for r in snap.running}
    assert len(third_blocks) == 4  # each completion writes its own tokens into its own block
    hits = events_of(e, PrefixCacheHit)
    assert [(ev.step, ev.request_id, ev.num_cached_tokens, ev.block_ids) for ev in hits] == \
        [(1, f"{i}_0", 32, tuple(shared)) for i in (1, 2, 3)]
    assert not events_of(e, BlocksForked)
    # The prompt was computed once: only its last 8 tokens again, once per sibling.
    scheduled = events_of(e, RequestScheduled)
    assert [(ev.step, ev.request_id, ev.num_tokens) for ev in scheduled if ev.step < 2] == \
        [(0, "0_0", 40), (1, "0_0", 1)] + [(1, f"{i}_0", 8) for i in (1, 2, 3)]
    out = run(e)[rid]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({c.token_ids for c in out.outputs}) > 1, "seeded completions should differ"
    assert e.snapshot().num_free_blocks == 64  # everything given back


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_that_fills_its_last_block_shares_all_but_that_block(caching):
    """32 tokens, two full blocks: the sibling needs the last token's logits, so it recomputes the second block."""
    e = engine(enable_prefix_caching=caching)
    e.events.keep_history()
    e.add_request(PROMPT[:32], SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    e.step()
    e.step()
    first, sibling = e.requests["0_0"], e.requests["1_0"]
    assert sibling.block_ids[0] == first.block_ids[0] and sibling.block_ids[1] != first.block_ids[1]
    shares = events_of(e, PrefixCacheHit if caching else BlocksForked)
    assert [(ev.request_id, ev.block_ids) for ev in shares] == [("1_0", (first.block_ids[0],))]
    assert not events_of(e, BlocksForked if caching else PrefixCacheHit)
    assert [(ev.request_id, ev.num_tokens) for ev in events_of(e, RequestScheduled) if ev.step == 1] == \
        [("0_0", 1), ("1_0", 16)]
    out = run(e)["0"]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: the same KV gives the same tokens


@pytest.mark.parametrize("prompt_len", [40, 32])  # a partial last block, and none
def test_greedy_completions_equal_the_single_greedy_completion(prompt_len):
    """Recomputing the partial block (or nothing) must give each sibling exactly the KV it would have had."""
    prompt = PROMPT[:prompt_len]
    single = engine()
    single.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    expected = run(single)["0"].token_ids
    e = engine()
    e.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    out = run(e)["0"]
    assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_seeded_completions_do_not_depend_on_the_batch():
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    alone = engine()
    alone.add_request(PROMPT, params)
    expected = [c.token_ids for c in run(alone)["0"].outputs]
    busy = engine()
    for i in range(3):
        busy.add_request(list(range(200 + i, 230 + i)), SamplingParams(temperature=1.0, max_tokens=5))
    rid = busy.add_request(PROMPT, params)
    assert [c.token_ids for c in run(busy)[rid].outputs] == expected
    # Completion i is seeded seed + i: the same as a single request with that seed.
    single = engine()
    single.add_request(PROMPT, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True))
    assert run(single)["0"].token_ids == expected[1]


def test_seeded_completions_are_the_same_whether_the_prompt_is_shared_by_cache_hit_or_by_fork():
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    outputs = []
    for caching in (True, False):
        e = engine(enable_prefix_caching=caching)
        e.add_request(PROMPT, params)
        outputs.append([c.token_ids for c in run(e)["0"].outputs])
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_preempted_completions_finish_with_the_same_tokens():
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    roomy = engine()
    roomy.add_request(PROMPT, params)
    expected = [c.token_ids for c in run(roomy)["0"].outputs]
    tight = engine(num_kv_blocks=10, max_model_len=96)  # 4 x 80 tokens do not fit in 160 slots
    tight.add_request(PROMPT, params)
    out = run(tight)["0"]
    assert tight.snapshot().num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == expected


def test_static_batch_counts_every_completion_as_a_seat():
    e = engine(max_num_seqs=4, scheduling_policy="static")
    first = e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=3, ignore_eos=True))
    second = e.add_request(PROMPT[:20], SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    finals = run(e, check=lambda eng: assert_at_most_seats(eng, 4))
    assert set(finals) == {first, second}


def assert_at_most_seats(e: LLMEngine, seats: int) -> None:
    assert len(e.snapshot().running) <= seats


def test_abort_ends_every_completion_before_and_after_the_siblings_are_admitted():
    e = engine()
    before = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    out = e.abort(before)  # still waiting: the siblings are held back in their parent
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    after = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    e.step()
    e.step()  # the siblings have shared the prompt's blocks and sampled their first tokens
    out = e.abort(after)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [2, 1, 1]
    assert not e.has_unfinished_requests() and not e.requests
    assert e.snapshot().num_free_blocks == 64
    e.check_invariants()


def test_without_the_prefix_cache_the_siblings_fork_the_prompt():
    e = engine(enable_prefix_caching=False)
    e.events.keep_history()
    e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    e.step()
    first = e.requests["0_0"]
    assert [e.requests[f"{i}_0"].fork_source for i in (1, 2)] == [(first, 2)] * 2  # the mark: two full blocks
    e.step()
    snap = e.snapshot()
    shared = snap.running[0].block_ids[:2]
    assert all(r.block_ids[:2] == shared for r in snap.running)
    assert [snap.blocks[b].ref_count for b in shared] == [3, 3]
    assert [(ev.step, ev.request_id, ev.parent_id, ev.block_ids) for ev in events_of(e, BlocksForked)] == \
        [(1, f"{i}_0", "0_0", tuple(shared)) for i in (1, 2)]
    assert not events_of(e, PrefixCacheHit) and e.block_manager.num_cached_blocks == 0
    assert [(ev.request_id, ev.num_tokens) for ev in events_of(e, RequestScheduled) if ev.step == 1] == \
        [("0_0", 1), ("1_0", 8), ("2_0", 8)]
    assert all(e.requests[f"{i}_0"].fork_source is None for i in (1, 2))  # used: the mark is gone
    out = run(e)["0"]
    assert len({c.token_ids for c in out.outputs}) == 1  # greedy: the same KV gives the same tokens
    assert e.snapshot().num_free_blocks == 64


def test_the_block_manager_holds_no_request():
    """Parallel sampling lives in the parent, the requests and the scheduler: the block manager keeps no request."""
    for caching in (True, False):
        e = engine(enable_prefix_caching=caching)
        e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
        e.step()  # siblings queued
        held = [value for value in vars(e.block_manager).values() if _holds_a_request(value)]
        assert not held


def _holds_a_request(value) -> bool:
    if isinstance(value, Request):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) else ()
    return any(_holds_a_request(v) for v in items)


@pytest.mark.parametrize("caching", [True, False])
def test_a_first_completion_preempted_before_its_siblings_are_admitted_shares_nothing_stale(caching):
    """4 blocks: request "0" (16 tokens) and the 40-token first completion fill them; "0" then needs a
    block and preempts the first completion while its siblings wait. Whatever a sibling shares later
    must be blocks that hold the prompt's KV at that moment."""
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True)
    roomy = engine(enable_prefix_caching=caching)
    roomy.add_request(PROMPT, params)
    expected = [c.token_ids for c in run(roomy)["0"].outputs]
    e = engine(enable_prefix_caching=caching, num_kv_blocks=4, max_model_len=64)
    e.events.keep_history()
    forks = []  # (sibling, source, whether the source held exactly these blocks, computed, at that moment)

    def on_fork(ev):  # an observer's exception would only be a warning: record, assert later
        source = e.requests[ev.parent_id]
        held = tuple(source.block_ids[:len(ev.block_ids)]) == ev.block_ids \
            and source.num_computed_tokens >= len(ev.block_ids) * 16
        forks.append((ev.request_id, ev.parent_id, held))

    e.events.subscribe(lambda ev: on_fork(ev) if isinstance(ev, BlocksForked) else None)
    e.add_request(list(range(200, 216)), SamplingParams(max_tokens=4, ignore_eos=True))
    rid = e.add_request(PROMPT, params)
    out = run(e)[rid]
    assert [c.token_ids for c in out.outputs] == expected
    preempted = events_of(e, RequestPreempted)
    assert [(ev.step, ev.request_id) for ev in preempted] == [(1, "0_1")]
    sibling_steps = [ev.step for ev in events_of(e, RequestScheduled) if ev.request_id in ("1_1", "2_1")]
    assert min(sibling_steps) > 1  # no sibling was admitted before the first completion lost its blocks
    computed = {ev.request_id: ev.num_tokens for ev in events_of(e, RequestScheduled) if ev.num_computed_tokens == 0
                and ev.request_id in ("1_1", "2_1")}
    if caching:  # its prompt blocks stayed cached: every sibling hits them, nobody forks
        assert not forks
        assert [(ev.request_id, ev.num_cached_tokens) for ev in events_of(e, PrefixCacheHit)
                if ev.request_id in ("1_1", "2_1")] == [("1_1", 32), ("2_1", 32)]
        assert not computed
    else:  # "1_1" forks the prompt the first completion computed again; "2_1" comes after it finished
        assert forks == [("1_1", "0_1", True)]
        assert computed == {"2_1": 40}
    assert e.snapshot().num_free_blocks == 4


def test_siblings_wait_for_a_free_seat_like_any_request():
    e = engine(max_num_seqs=3)
    rid = e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    others = [e.add_request(list(range(300 + i, 320 + i)), SamplingParams(max_tokens=6, ignore_eos=True))
              for i in range(2)]
    e.step()  # the first completion and the two other requests fill the three seats
    assert len(e.snapshot().running) == 3
    finals = run(e, check=lambda eng: assert_at_most_seats(eng, 3))
    assert set(finals) == {rid, *others} and len(finals[rid].outputs) == 3


def test_a_first_completion_done_at_its_first_token_leaves_the_siblings_whole():
    """The first completion frees its blocks at once (max_tokens=1): its cached blocks still serve
    the siblings; without the cache, there is nothing left to fork, so they compute the prompt."""
    for caching in (True, False):
        e = engine(enable_prefix_caching=caching)
        e.events.keep_history()
        e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=1))
        out = run(e)["0"]
        assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
        assert len({c.token_ids for c in out.outputs}) == 1
        assert not events_of(e, BlocksForked)
        hits = [(ev.request_id, ev.num_cached_tokens) for ev in events_of(e, PrefixCacheHit)]
        assert hits == ([("1_0", 32), ("2_0", 32)] if caching else [])
        scheduled = [(ev.request_id, ev.num_tokens) for ev in events_of(e, RequestScheduled) if ev.step == 1]
        assert scheduled == [("1_0", 8 if caching else 40), ("2_0", 8 if caching else 40)]
        assert e.snapshot().num_free_blocks == 64


@pytest.mark.parametrize("caching", [True, False])
def test_abort_before_the_siblings_are_queued_leaves_nothing_behind(caching):
    e = engine(max_num_batched_tokens=16, enable_prefix_caching=caching)  # the 40-token prompt takes three steps
    rid = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    siblings = [e.requests[f"{i}_{rid}"] for i in (1, 2)]
    e.step()
    assert len(e.snapshot().waiting) == 0 and len(e.snapshot().running) == 1  # siblings held back
    out = e.abort(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not e.parents.holding and all(s.fork_source is None and not s.block_ids for s in siblings)
    while e.has_unfinished_requests():
        e.step()
    assert not e.requests and e.snapshot().num_free_blocks == 64
    assert all(b.ref_count == 0 for b in e.snapshot().blocks)
    e.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_abort_of_queued_siblings_leaves_no_refs(caching):
    e = engine(enable_prefix_caching=caching)
    rid = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    e.step()  # the siblings are queued now, marked for a fork only without the cache
    siblings = [e.requests[f"{i}_{rid}"] for i in (1, 2)]
    first = e.requests[f"0_{rid}"]
    assert [s.fork_source for s in siblings] == ([None] * 2 if caching else [(first, 2)] * 2)
    assert [e.snapshot().blocks[b].ref_count for b in first.block_ids] == [1, 1, 1]  # nothing taken yet
    e.abort(rid)
    assert not e.scheduler.waiting and not e.scheduler.running
    assert all(s.fork_source is None and not s.block_ids for s in siblings)
    assert e.snapshot().num_free_blocks == 64 and all(b.ref_count == 0 for b in e.snapshot().blocks)
    e.check_invariants()


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_bad_n_is_refused(n):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=n)


def test_more_completions_than_slots_is_refused_and_changes_nothing():
    e = engine(max_num_seqs=4)
    before = e.snapshot()
    with pytest.raises(ValueError, match="n=5 completions must run at once, but max_num_seqs is 4"):
        e.add_request(PROMPT, SamplingParams(n=5))
    assert e.snapshot() == before and not e.requests
    assert e.add_request(PROMPT, SamplingParams(n=4, max_tokens=1)) == "0"  # the id was not consumed


def test_completion_ids_cannot_clash_with_a_running_request():
    e = engine()
    e.add_request(PROMPT, SamplingParams(max_tokens=3), request_id="1_x")
    with pytest.raises(ValueError, match="already in use"):
        e.add_request(PROMPT, SamplingParams(n=2, max_tokens=3), request_id="x")


def test_stream_refuses_several_completions(build_tiny_llm):
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    with pytest.raises(ValueError, match="use generate"):
        next(llm.stream("Hello", SamplingParams(n=2)))
    outs = llm.generate(["Hello", "Bonjour"], SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=4))
    assert [len(o.outputs) for o in outs] == [2, 2] and all(o.finished for o in outs)


def test_each_completion_hashes_its_blocks_once_across_admission_attempts_and_preemption():
    """Block digests are kept on the request (``Request.token_block_digests``): a first completion
    preempted and readmitted, and a sibling that waits through failed admission attempts, hash
    each of their full blocks exactly once."""
    e = engine(num_kv_blocks=4, max_model_len=64)  # the preemption scenario above
    calls = []
    real_hash = e.block_manager.hash_fn

    def counting_hash(parent, tokens):
        calls.append(tuple(tokens))
        return real_hash(parent, tokens)

    e.block_manager.hash_fn = counting_hash
    attempts = collections.Counter()
    real_get = e.block_manager.get_computed_blocks

    def counting_get(request):
        attempts[request.request_id] += 1
        return real_get(request)

    e.block_manager.get_computed_blocks = counting_get
    e.add_request(list(range(200, 216)), SamplingParams(max_tokens=4, ignore_eos=True))
    rid = e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    completions = [e.requests[f"{i}_{rid}"] for i in range(3)]
    while e.has_unfinished_requests():  # no invariant checks here: they hash too, to verify the cache
        e.step()
    # The first completion asks again after its preemption until it fits; "2_1" waits for room.
    assert e.snapshot().num_preemptions == 1 and attempts["0_1"] > 2 and attempts["2_1"] > 1
    digests = [len(c.token_block_digests) for c in completions]
    assert digests == [2, 2, 2]  # 40 prompt + 4 output tokens: two full blocks each
    assert len(calls) == 1 + sum(digests)  # and the 16-token request "0" its one block
