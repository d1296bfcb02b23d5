"""Chapter 4's exercise checks (widgets.exercises.ch04): placeholders and bad values are
"not yet", the checks judge what the engine did, and the helpers measure what they say."""

from __future__ import annotations

import pytest

from widgets.exercises import ch04


@pytest.mark.parametrize("check", [ch04.check_block_size, ch04.check_pool_size, ch04.check_parallel_sampling])
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(check, value) -> None:
    result = check(value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


def test_the_trace_is_seeded_and_sorted_by_arrival() -> None:
    trace = ch04.chapter_trace()
    assert trace == ch04.chapter_trace() and len(trace) == 16
    assert [t[0] for t in trace] == sorted(t[0] for t in trace)
    assert all(16 <= p < 200 and 8 <= m < 160 for _, p, m in trace)


@pytest.mark.slow
def test_replay_counts_recomputed_tokens_only_after_preemption() -> None:
    short = [(0, 20, 4), (1, 30, 4)]
    roomy = ch04.replay_trace(16, 64, trace=short)
    assert roomy.num_preemptions == 0 and roomy.recomputed_tokens == 0 and roomy.num_finished == 2
    tight = ch04.replay_trace(16, 32, trace=[(0, 200, 150), (0, 200, 150), (0, 200, 150)])
    assert tight.num_preemptions > 0 and tight.recomputed_tokens > 0 and tight.num_finished == 3


def test_parallel_sampling_shares_the_prompts_full_blocks() -> None:
    entries, distinct = ch04.sampling_savings(3, prompt_len=40, block_size=16)
    # 40 tokens: 2 full blocks shared by 3 completions, and a partial block each (the siblings,
    # admitted a step after the first completion, compute their own)
    assert entries - distinct == 2 * 2


def test_exercise_4_3_accepts_exactly_the_smallest_n() -> None:
    assert ch04.check_parallel_sampling(7).right
    assert not ch04.check_parallel_sampling(6).right
    assert not ch04.check_parallel_sampling(8).right
