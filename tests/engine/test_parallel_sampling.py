"""Parallel sampling, ``SamplingParams(n=...)`` (chapters 4 and 8): one prompt, n completions.

The first completion computes the prompt; its full KV blocks are then shared by the n
sequences (reference count n), and each sibling recomputes the prompt's partly filled
last block instead of sharing it (see ``BlockManager.fork``). The siblings are ordinary
requests queued once the prompt is computed (``parallel_sampling.ParentRequest``).
"""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import BlocksForked, RequestScheduled
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


def test_n_completions_share_the_prompt_blocks_then_recompute_the_partial_one():
    e = engine()
    e.events.keep_history()
    rid = e.add_request(PROMPT, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True))
    assert rid == "0"
    e.step()  # the prompt in one step, by the first completion, which samples its first token
    snap = e.snapshot()
    assert [r.request_id for r in snap.running] == ["0_0"] and snap.running[0].num_output_tokens == 1
    # The siblings are queued only now, holding nothing yet.
    assert [(r.request_id, r.block_ids) for r in snap.waiting] == [(f"{i}_0", ()) for i in (1, 2, 3)]
    assert not any(isinstance(ev, BlocksForked) for ev in e.events.history)
    e.step()  # the siblings are admitted: they fork the two full blocks and compute the partial one
    snap = e.snapshot()
    assert [r.request_id for r in snap.running] == ["0_0", "1_0", "2_0", "3_0"] and not snap.waiting
    shared = snap.running[0].block_ids[:2]
    assert all(r.block_ids[:2] == shared for r in snap.running)
    assert [snap.blocks[b].ref_count for b in shared] == [4, 4]
    assert [r.num_computed_tokens for r in snap.running] == [41, 40, 40, 40]
    assert [r.num_output_tokens for r in snap.running] == [2, 1, 1, 1]
    third_blocks = {r.block_ids[2] for r in snap.running}
    assert len(third_blocks) == 4  # each completion writes its own tokens into its own block
    forks = [ev for ev in e.events.history if isinstance(ev, BlocksForked)]
    assert [(ev.request_id, ev.parent_id, ev.block_ids) for ev in forks] == \
        [(f"{i}_0", "0_0", tuple(shared)) for i in (1, 2, 3)]
    # Only the prompt's last 8 tokens were computed again, once per sibling.
    scheduled = [ev for ev in e.events.history if isinstance(ev, RequestScheduled) and ev.step == 1]
    assert sorted((ev.request_id, ev.num_tokens) for ev in scheduled) == \
        [("0_0", 1)] + [(f"{i}_0", 8) for i in (1, 2, 3)]
    out = run(e)[rid]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({c.token_ids for c in out.outputs}) > 1, "seeded completions should differ"
    assert e.snapshot().num_free_blocks == 64  # everything given back


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


def test_abort_ends_every_completion_before_and_after_the_fork():
    e = engine()
    before = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    out = e.abort(before)  # still waiting: the siblings are held back in their parent
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    after = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    e.step()
    e.step()  # the siblings have forked and sampled their first tokens
    out = e.abort(after)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [2, 1, 1]
    assert not e.has_unfinished_requests() and not e.requests
    assert e.snapshot().num_free_blocks == 64
    e.check_invariants()


def test_without_the_prefix_cache_the_siblings_still_fork_the_prompt():
    e = engine(enable_prefix_caching=False)
    e.events.keep_history()
    e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    e.step()
    e.step()
    snap = e.snapshot()
    shared = snap.running[0].block_ids[:2]
    assert [snap.blocks[b].ref_count for b in shared] == [3, 3]
    assert sum(isinstance(ev, BlocksForked) for ev in e.events.history) == 2
    out = run(e)["0"]
    assert len({c.token_ids for c in out.outputs}) == 1  # greedy: the same KV gives the same tokens


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
    """The first completion frees its blocks at once (max_tokens=1): the offer lapses, the siblings compute."""
    for caching in (True, False):
        e = engine(enable_prefix_caching=caching)
        e.add_request(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=1))
        out = run(e)["0"]
        assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
        assert len({c.token_ids for c in out.outputs}) == 1
        assert not e.block_manager.prefix_offers and e.snapshot().num_free_blocks == 64


def test_abort_before_the_siblings_are_queued_leaves_nothing_behind():
    e = engine(max_num_batched_tokens=16)  # the 40-token prompt takes three steps
    rid = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    e.step()
    assert len(e.snapshot().waiting) == 0 and len(e.snapshot().running) == 1  # siblings held back
    out = e.abort(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not e.parents.holding and not e.block_manager.prefix_offers
    while e.has_unfinished_requests():
        e.step()
    assert not e.requests and e.snapshot().num_free_blocks == 64
    e.check_invariants()


def test_abort_of_queued_siblings_withdraws_their_offers():
    e = engine()
    rid = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    e.step()  # the siblings are queued now, each with an offer of the prompt's blocks
    assert set(e.block_manager.prefix_offers) == {"1_0", "2_0"}
    e.abort(rid)
    assert not e.block_manager.prefix_offers and not e.scheduler.waiting
    assert e.snapshot().num_free_blocks == 64


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
