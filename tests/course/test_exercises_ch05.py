"""Chapter 5's exercise checks (widgets.exercises.ch05): placeholders and bad values are
"not yet", each check accepts exactly its answer, and the trace runner records what the
engine did (chunks, stalls, preemptions, recomputed tokens)."""

from __future__ import annotations

import re

import pytest

from nanoengine import SamplingParams
from widgets import tiny_engine
from widgets.exercises import ch05


@pytest.mark.parametrize("check", [ch05.check_token_budget, ch05.check_pool_size, ch05.check_skipped_decodes])
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(check, value) -> None:
    result = check(value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


@pytest.mark.slow
def test_exercise_5_1_accepts_exactly_the_smallest_budget() -> None:
    assert ch05.check_token_budget(43).right
    assert not ch05.check_token_budget(42).right  # 3 x 39 = 117 < 120: one token short
    assert not ch05.check_token_budget(40).right  # 120 / 3, forgetting the three decodes
    too_big = ch05.check_token_budget(44)
    assert not too_big.right and "43" not in str(too_big)  # says what is wrong, not the answer


@pytest.mark.slow
def test_exercise_5_2_accepts_exactly_the_smallest_pool() -> None:
    # ceil((20+40-1)/16) + ceil((28+40-1)/16) + ceil((36+40-1)/16) + ceil((44+40-1)/16) = 4 + 5 + 5 + 6
    assert ch05.check_pool_size(20).right
    assert not ch05.check_pool_size(19).right  # forgetting that a partly filled block is a whole block
    assert not ch05.check_pool_size(18).right  # (20+28+36+44+4*40) / 16 = 18: tokens, not blocks
    too_big = ch05.check_pool_size(21)
    assert not too_big.right and "20" not in str(too_big).split("took")[0]  # the hint does not name the answer


@pytest.mark.slow
def test_exercise_5_3_accepts_the_skipped_decodes_the_engine_counted() -> None:
    # ceil(120 / 36) = 4 prefill-only steps, 3 running requests lose a token in each
    assert ch05.check_skipped_decodes(12).right
    for wrong in (0, 9, 10, 4):  # decodes ride along; 120 // 36 steps; 120 / 36 x 3; steps, not decodes
        result = ch05.check_skipped_decodes(wrong)
        assert not result.right and not re.search(r"\b12\b", str(result))
    assert ch05.newcomer_run(ch05.SKIP_BUDGET, "prefill_first").num_stalls == 12


def test_run_trace_records_chunks_and_decodes_within_the_budget() -> None:
    run = ch05.newcomer_run(32)
    assert all(s.num_tokens <= 32 for s in run.steps)
    newcomer = run.requests[-1]
    chunks = [n for s in run.steps for rid, n, prefill in s.chunks if rid == newcomer.request_id and prefill]
    assert sum(chunks) == ch05.NEWCOMER_LEN and max(chunks) == 32 - 3
    assert run.num_stalls == 0 and run.output_tokens == 3 * 40 + 8
    assert 0 < run.slot_utilisation <= 1


def test_static_policy_idles_slots_that_continuous_batching_fills() -> None:
    trace = [(0, [100 + i] * 6, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
             for i, n in enumerate([2, 12, 2, 2, 12, 2])]
    runs = {}
    for policy in ("fcfs", "static"):
        engine = tiny_engine(num_kv_blocks=64, block_size=16, max_model_len=64, max_num_seqs=3,
                             scheduling_policy=policy)
        runs[policy] = ch05.run_trace(engine, trace)
    assert runs["fcfs"].output_tokens == runs["static"].output_tokens == 32
    assert runs["fcfs"].num_steps < runs["static"].num_steps
    assert runs["fcfs"].slot_utilisation > runs["static"].slot_utilisation


def test_times_computed_counts_every_recomputation() -> None:
    run = ch05.preemption_run(12, max_num_batched_tokens=32)
    assert run.preemptions and len(run.progress_at_preemption) == len(run.preemptions)
    histogram = dict(run.times_computed)
    # each extra computation of a position is one recomputed token
    assert sum((times - 1) * n for times, n in histogram.items()) == run.recomputed_tokens
    assert max(histogram) > 2  # this small pool makes some tokens go round three times or more
    assert run.tokens_computed_more_than_once == {t: n for t, n in histogram.items() if t > 1}
    for (step, victim, blocks, computed), running in zip(run.preemptions, run.progress_at_preemption):
        assert dict(running)[victim] == computed  # the victim's progress is among the running requests'


def test_preemption_is_recorded_with_its_recompute() -> None:
    run = ch05.preemption_run(19)
    assert run.preemptions and run.recomputed_tokens > 0
    step, victim, blocks, computed = run.preemptions[0]
    assert victim == run.requests[-1].request_id  # the newest running request is evicted
    assert blocks > 0 and computed > 0
    assert all(r.num_output_tokens == ch05.PREEMPTION_OUTPUT for r in run.requests)
