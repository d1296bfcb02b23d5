"""Chapter 5's exercise checks (widgets.exercises.ch05): placeholders and bad values are
"not yet", each check accepts exactly its answer, and the trace runner records what the
engine did (chunks, stalls, preemptions, recomputed tokens)."""

from __future__ import annotations

import pytest

from nanoengine import SamplingParams
from widgets import tiny_engine
from widgets.exercises import ch05


@pytest.mark.parametrize("check", [ch05.check_token_budget, ch05.check_pool_size, ch05.check_policy])
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(check, value) -> None:
    result = check(value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


def test_exercise_5_1_accepts_exactly_the_smallest_budget() -> None:
    assert ch05.check_token_budget(43).right
    assert not ch05.check_token_budget(42).right
    assert not ch05.check_token_budget(44).right


def test_exercise_5_2_accepts_exactly_the_smallest_pool() -> None:
    # ceil((20+40-1)/16) + ceil((28+40-1)/16) + ceil((36+40-1)/16) + ceil((44+40-1)/16) = 4 + 5 + 5 + 6
    assert ch05.check_pool_size(20).right
    assert not ch05.check_pool_size(19).right
    assert not ch05.check_pool_size(21).right


def test_exercise_5_3_accepts_only_fcfs() -> None:
    assert ch05.check_policy("fcfs").right
    assert not ch05.check_policy("prefill_first").right
    assert not ch05.check_policy("static").right


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


def test_preemption_is_recorded_with_its_recompute() -> None:
    run = ch05.preemption_run(19)
    assert run.preemptions and run.recomputed_tokens > 0
    step, victim, blocks, computed = run.preemptions[0]
    assert victim == run.requests[-1].request_id  # the newest running request is evicted
    assert blocks > 0 and computed > 0
    assert all(r.num_output_tokens == ch05.PREEMPTION_OUTPUT for r in run.requests)
