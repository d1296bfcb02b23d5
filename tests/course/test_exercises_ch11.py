"""Chapter 11's exercise checks (widgets.exercises.ch11): placeholders and bad values are
"not yet", and the checks judge what the engine did (timed runs, steps, tokens)."""

from __future__ import annotations

import pytest

from widgets.exercises import ch11


@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_max_num_seqs_placeholders_and_bad_values_are_not_yet(value) -> None:
    result = ch11.check_max_num_seqs(value)
    assert not result.right and str(result).startswith("Exercise 11.2: not yet. Hint: ")


@pytest.mark.parametrize("warmup, repeats", [(..., 5), (1, ...), (None, None), ("1", 5), (1, 2.5), (True, 5),
                                             (-1, 5), (1, 4), (1, 100), (0, 5)])
def test_measurement_placeholders_bad_values_and_no_warmup_are_not_yet(warmup, repeats) -> None:
    result = ch11.check_measurement(warmup, repeats)
    assert not result.right and str(result).startswith("Exercise 11.1: not yet. Hint: ")


def test_measurement_with_a_warmup_and_enough_repeats_is_right() -> None:
    assert ch11.check_measurement(1, 5).right
    assert ch11.check_measurement(2, 7).right


def test_the_workload_is_seeded() -> None:
    prompts, lens = ch11.chapter_workload()
    assert (prompts, lens) == ch11.chapter_workload()
    assert len(prompts) == len(lens) == ch11.NUM_REQUESTS
    assert all(ch11.MIN_PROMPT <= len(p) <= ch11.MAX_PROMPT for p in prompts)
    assert all(ch11.MIN_OUTPUT <= n <= ch11.MAX_OUTPUT for n in lens)


def test_steps_fall_to_the_longest_request_once_every_request_has_a_slot() -> None:
    _, lens = ch11.chapter_workload()
    assert ch11.steps_to_serve(1) == sum(lens)  # one at a time: one step per token
    assert ch11.steps_to_serve(ch11.NUM_REQUESTS) == max(lens)  # all at once: the longest decides
    assert ch11.steps_to_serve(ch11.NUM_REQUESTS + 4) == max(lens)


def test_exercise_11_2_accepts_exactly_the_smallest_size() -> None:
    sizes = range(1, ch11.NUM_REQUESTS + 3)
    steps = {b: ch11.steps_to_serve(b) for b in sizes}
    fewest = min(steps.values())
    smallest = min(b for b, s in steps.items() if s == fewest)
    assert ch11.check_max_num_seqs(smallest).right
    assert all(not ch11.check_max_num_seqs(b).right for b in sizes if b != smallest)


class _FakeOutput:
    def __init__(self, n: int) -> None:
        self.token_ids = list(range(n))


class _FakeLLM:
    """Stops early unless EOS is ignored, as a chat model does."""

    def apply_chat_template(self, messages) -> str:
        return messages[0]["content"]

    def generate(self, prompts, params, use_tqdm=False):
        return [_FakeOutput(params.max_tokens if params.ignore_eos else 3) for _ in prompts]


def test_counted_tokens_judges_the_token_counts() -> None:
    assert ch11.check_counted_tokens(_FakeLLM(), True).right
    assert not ch11.check_counted_tokens(_FakeLLM(), False).right
    for value in (..., None, 1, "True"):
        assert not ch11.check_counted_tokens(_FakeLLM(), value).right
