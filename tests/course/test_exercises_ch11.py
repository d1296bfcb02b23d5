"""Chapter 11's exercise checks (widgets.exercises.ch11): placeholders and bad values are
"not yet", the worked answers pass and plausible wrong answers fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nanobench.benchmark import static_computed_tokens
from widgets.exercises import ch11
from widgets.throughput_explorer import OnlineRun


def test_the_workload_is_seeded() -> None:
    prompts, lens = ch11.chapter_workload()
    assert (prompts, lens) == ch11.chapter_workload()
    assert len(prompts) == len(lens) == ch11.NUM_REQUESTS
    assert all(ch11.MIN_PROMPT <= len(p) <= ch11.MAX_PROMPT for p in prompts)
    assert all(ch11.MIN_OUTPUT <= n <= ch11.MAX_OUTPUT for n in lens)


# ------------------------------------------------------------------ 11.1
@pytest.mark.parametrize("value", [..., None, "79", 2.5, True, -1])
def test_static_tokens_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert not ch11.check_static_tokens(value).right


def test_static_tokens_right_and_plausible_wrong_answers() -> None:
    _, lens = ch11.chapter_workload()
    b = ch11.STATIC_BATCH
    batches = [lens[i:i + b] for i in range(0, len(lens), b)]
    right = sum(len(batch) * max(batch) for batch in batches)
    assert right == static_computed_tokens(lens, b) and right > sum(lens)
    assert ch11.check_static_tokens(right).right
    wrong = {sum(lens),  # the requested tokens
             len(lens) * max(lens),  # one batch of everything
             sum(b * max(batch) for batch in batches),  # the last, short batch padded to full size
             b * max(lens) * len(batches)}  # every batch run to the longest request overall
    for value in wrong - {right}:
        result = ch11.check_static_tokens(value)
        assert not result.right and str(right) not in str(result), value


# ------------------------------------------------------------------ 11.2
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_max_num_seqs_placeholders_and_bad_values_are_not_yet(value) -> None:
    result = ch11.check_max_num_seqs(value)
    assert not result.right and str(result).startswith("Exercise 11.2: not yet. Hint: ")


def test_steps_fall_to_the_longest_request_once_every_request_has_a_slot() -> None:
    _, lens = ch11.chapter_workload()
    assert ch11.steps_to_serve(1) == sum(lens)  # one at a time: one step per token
    assert ch11.steps_to_serve(ch11.NUM_REQUESTS) == max(lens)  # all at once: the longest decides
    assert ch11.steps_to_serve(len(ch11.SLOT_LENS), ch11.SLOT_LENS) == max(ch11.SLOT_LENS)


@pytest.mark.slow
def test_exercise_11_2_accepts_exactly_the_smallest_size() -> None:
    sizes = range(1, len(ch11.SLOT_LENS) + 3)
    steps = {b: ch11.steps_to_serve(b, ch11.SLOT_LENS) for b in sizes}
    fewest = min(steps.values())
    smallest = min(b for b, s in steps.items() if s == fewest)
    assert smallest < len(ch11.SLOT_LENS)  # the answer is not "one slot per request"
    assert ch11.check_max_num_seqs(smallest).right
    # plausible wrong answers: one slot per request, one too few, one per long request
    for wrong in {len(ch11.SLOT_LENS), smallest - 1, sum(n == max(ch11.SLOT_LENS) for n in ch11.SLOT_LENS)}:
        assert not ch11.check_max_num_seqs(wrong).right, wrong


# ------------------------------------------------------------------ 11.3
RUN = OnlineRun(8.0, 2.0, 60, tuple((t, 0.09) for t in (0.212, 0.180, 0.305, 0.251, 0.199, 0.4417, 0.233, 0.276)))


@pytest.mark.parametrize("value", [..., None, "442", 0, -5, True, 441.5])
def test_ttft_slo_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert not ch11.check_ttft_slo(RUN, value).right


def test_ttft_slo_right_and_plausible_wrong_answers() -> None:
    ttfts_ms = np.array([t for t, _ in RUN.latencies]) * 1e3
    right = ch11.needed_ms([t for t, _ in RUN.latencies])
    assert right == math.ceil(ttfts_ms.max()) == 442  # 90% of 8 requests is all 8
    assert ch11.check_ttft_slo(RUN, right).right and ch11.check_ttft_slo(RUN, float(right)).right
    wrong = [round(float(np.percentile(ttfts_ms, 99))), round(float(np.percentile(ttfts_ms, 90))),
             round(float(np.median(ttfts_ms))), right + 10]
    for value in wrong:
        result = ch11.check_ttft_slo(RUN, value)
        assert not result.right and str(right) not in str(result), value


def test_ttft_slo_with_more_requests_needs_the_kth_not_the_slowest() -> None:
    ttfts = [0.1 + 0.01 * i for i in range(20)]  # 90% of 20 is 18: the slowest two may miss
    run = OnlineRun(1.0, 1.0, 20, tuple((t, None) for t in ttfts))
    assert ch11.needed_ms(ttfts) == 270
    assert ch11.check_ttft_slo(run, 270).right
    assert not ch11.check_ttft_slo(run, 290).right and not ch11.check_ttft_slo(run, 269).right
