"""Parallel sampling, ``SamplingParams(n=...)`` (chapters 4 and 8): one prompt, n completions.

The prompt is computed once; its full KV blocks are then shared by the n sequences
(reference count n), and each sequence recomputes the prompt's partly filled last block
instead of sharing it (see ``BlockManager.fork``).
"""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import BlocksForked
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
    e.step()  # the prompt in one step: the first completion samples, the three others fork
    snap = e.snapshot()
    assert [r.request_id for r in snap.running] == ["0_0", "1_0", "2_0", "3_0"]
    shared = snap.running[0].block_ids[:2]
    assert all(r.block_ids[:2] == shared for r in snap.running)
    assert [snap.blocks[b].ref_count for b in shared] == [4, 4]
    # The partial third block stays the first completion's; the others compute their own.
    assert snap.blocks[snap.running[0].block_ids[2]].ref_count == 1
    assert [r.num_computed_tokens for r in snap.running] == [40, 32, 32, 32]
    forks = [ev for ev in e.events.history if isinstance(ev, BlocksForked)]
    assert [(ev.request_id, ev.parent_id, ev.block_ids) for ev in forks] == \
        [(f"{i}_0", "0_0", tuple(shared)) for i in (1, 2, 3)]
    e.step()
    third_blocks = {r.block_ids[2] for r in e.snapshot().running}
    assert len(third_blocks) == 4  # each completion writes its own token into its own block
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
    assert sum(1 + r.num_forks for r in e.snapshot().running) <= seats


def test_abort_ends_every_completion_before_and_after_the_fork():
    e = engine()
    before = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5))
    out = e.abort(before)  # still waiting: the siblings have not forked yet
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    after = e.add_request(PROMPT, SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    e.step()
    out = e.abort(after)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and all(len(c.token_ids) == 1 for c in out.outputs)
    assert not e.has_unfinished_requests() and not e.requests
    assert e.snapshot().num_free_blocks == 64
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
