"""Chapter 1's exercise checks judge what a run produced (widgets/exercises/ch01.py).

Each check is run on a tiny random engine (mechanics only, milliseconds per step) once with
the right setting, once with a wrong one and once before anything ran.
"""

from __future__ import annotations

import re

import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import StepFinished
from nanoengine.loader.weights import random_model
from widgets import tiny_engine
from widgets.exercises import ch01
from widgets.quiz import check_question


def _run_eight(max_num_seqs: int) -> list[StepFinished]:
    engine = tiny_engine(max_num_seqs=max_num_seqs)
    steps: list[StepFinished] = []
    engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    for i in range(ch01.NUM_REQUESTS):
        engine.add_request([101 + i, 102, 103], SamplingParams(temperature=0.0, max_tokens=ch01.OUTPUT_TOKENS,
                                                               ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize("seats, right, says", [
    (4, True, "12 engine steps, at most 4 sequences"),
    (8, False, "a smaller max_num_seqs also finishes"),   # all eight together: fast, but not the fewest seats
    (5, False, "a smaller max_num_seqs also finishes"),   # 12 steps too, one seat more than needed
    (3, False, "took 18 engine steps, more than 12"),     # three rounds
    (2, False, "took 24 engine steps, more than 12"),
])
def test_batched_decode_needs_the_fewest_seats_within_twelve_steps(seats, right, says) -> None:
    result = ch01.check_batched_decode(_run_eight(seats))
    assert result.right is right and says in " ".join(str(result).split())
    assert ("right." in str(result)) is right
    assert right or not re.search(r"\b4\b", str(result))  # a wrong answer's hint does not name the answer


def test_batched_decode_before_a_run() -> None:
    assert not ch01.check_batched_decode([]).right
    assert str(ch01.check_batched_decode([])).startswith("Exercise 1.1: not yet. Hint:")


def _report(dtype: torch.dtype, name: str):
    net = random_model("tiny-llama", dtype=dtype, vocab_size=256, max_position_embeddings=64)
    return LLMEngine.from_model(net, None, device="cpu", dtype=name, num_kv_blocks=16, block_size=4,
                                max_model_len=64).memory_report()


def test_half_bytes_is_judged_on_the_memory_report() -> None:
    n = sum(p.numel() for p in random_model("tiny-llama", vocab_size=256, max_position_embeddings=64).parameters())
    assert ch01.check_half_bytes(_report(torch.bfloat16, "bfloat16"), n).right
    wrong = ch01.check_half_bytes(_report(torch.float32, "float32"), n)
    assert not wrong.right and "4 per parameter" in str(wrong)
    assert not ch01.check_half_bytes(None, n).right


def test_kv_pool_must_hold_exactly_the_tokens_needed() -> None:
    def report(blocks: int):
        net = random_model("tiny-llama", vocab_size=256, max_position_embeddings=64)
        return LLMEngine.from_model(net, None, device="cpu", num_kv_blocks=blocks, block_size=4,
                                    max_model_len=64).memory_report()

    assert ch01.check_kv_pool(report(32), conversations=2, tokens_each=64).right
    short = ch01.check_kv_pool(report(20), conversations=2, tokens_each=64)
    assert not short.right and "need 128" in str(short)
    spare = ch01.check_kv_pool(report(40), conversations=2, tokens_each=64)
    assert not spare.right and "32 more than needed" in str(spare)
    assert not ch01.check_kv_pool(None, 2, 64).right


def test_top_probability_follows_the_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert ch01.top_probability(logits, 1.0) == pytest.approx(torch.softmax(logits, -1)[0].item())
    assert ch01.top_probability(logits, 0.5) > ch01.top_probability(logits, 1.0) > ch01.top_probability(logits, 2.0)


# a pass like the chapter's first: the top token holds about 77% of the probability at temperature 1
FIRST_PASS = torch.tensor([4.0, 2.2, 1.5, 1.0, 0.5] + [-3.0] * 20)


@pytest.mark.parametrize("temperature, right", [
    (0.3, True), (0.4, True),
    (1.0, False),   # the model's own distribution: the top token keeps only its own share
    (2.0, False),   # hotter flattens the distribution, it does not sharpen it
    (0.0, False),   # greedy: no draw at all
    (0, False), (-0.5, False), ("0.3", False), (True, False), (..., False),
])
def test_temperature_must_sample_yet_keep_the_top_token(temperature, right) -> None:
    assert ch01.top_probability(FIRST_PASS, 1.0) < ch01.TOP_SHARE
    result = ch01.check_temperature(temperature, FIRST_PASS)
    assert result.right is right and result.exercise == "1.3"
    if not right and temperature not in (..., "0.3", True) and temperature != -0.5:
        assert "0.3" not in str(result) and "0.4" not in str(result)  # the hint does not name an answer


@pytest.mark.parametrize("step, crossover, expect", [
    ({1: 1.0, 2: 1.0, 4: 1.02, 8: 1.1, 16: 1.3, 32: 1.9, 64: 3.5}, 18,
     ["almost in proportion", "they level off", "is not true here"]),
    ({1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0, 32: 30.0, 64: 60.0}, 2,
     ["well short of the batch's growth", "they level off", "is not true here"]),
    ({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.05, 32: 1.1, 64: 1.2}, 300,
     ["almost in proportion", "have not levelled off", "true here"]),
    ({1: 1.0, 2: 2.1, 4: 4.0}, 1, ["already pays for its batch's arithmetic", "they level off", "not true here"]),
])
def test_batching_reading_says_what_the_step_times_say(step, crossover, expect) -> None:
    lines = ch01.batching_reading(step, crossover)
    assert len(lines) == 3
    for line, words in zip(lines, expect):
        assert words in line, (line, words)
    # on each side of a threshold: tokens/s growth of 1.24x levels off, 1.26x does not
    assert "level off" in ch01.batching_reading({1: 1.0, 32: 1.0, 64: 2 / 1.24}, 1)[1]
    assert "not levelled" in ch01.batching_reading({1: 1.0, 32: 1.0, 64: 2 / 1.26}, 1)[1]
    assert "true here" in ch01.batching_reading({1: 1.0, 2: 1.0, 64: 1.49}, 1)[2]
    assert "not true here" in ch01.batching_reading({1: 1.0, 2: 1.0, 64: 1.51}, 1)[2]
    with pytest.raises(ValueError):
        ch01.batching_reading({2: 1.0, 4: 1.0, 8: 1.0}, 4)


def test_bound_reading_says_what_the_floors_say() -> None:
    memory = ch01.bound_reading(arithmetic_floor=0.001, bandwidth_floor=0.0135, step=0.03)
    assert "memory-bound" in memory[0] and "2.2x the bandwidth floor" in memory[1]
    assert "close" in ch01.bound_reading(0.008, 0.01, 0.03)[0]            # ratio 1.25: below MEMORY_BOUND
    assert "memory-bound" in ch01.bound_reading(0.0049, 0.01, 0.03)[0]    # ratio 2.04: just above it
    assert "close" in ch01.bound_reading(0.0051, 0.01, 0.03)[0]           # ratio 1.96: just below it
    assert "compute-bound" in ch01.bound_reading(0.02, 0.01, 0.03)[0]
    assert "disturbed" in ch01.bound_reading(0.001, 0.02, 0.015)[1]


def test_step_settings_name_batch_context_dtype_threads_and_mode() -> None:
    engine = tiny_engine()
    text = ch01.step_settings(engine, 4, (5, 20))
    threads = torch.get_num_threads()
    assert text == (f"batch 4, context 5-20 tokens, float32, {threads} thread{'s' * (threads != 1)}, "
                    f"{engine.forward_mode}")
    assert "context 7 tokens" in ch01.step_settings(engine, 1, (7, 7))
    engine.add_request([101, 102, 103], SamplingParams(max_tokens=4))
    engine.step()
    assert ch01.running_context(engine) == (4, 4)


def test_live_questions_are_valid_and_computed() -> None:
    net = random_model("tiny-llama")
    q = ch01.layer_parameters_question(net, layer=1)
    check_question(q, "layer parameters")
    assert q.options[q.answer].text == f"{sum(p.numel() for p in net.model.layers[1].parameters()):,}"

    class Words:  # a stand-in tokenizer: one token per character pair
        def encode(self, text, add_special_tokens=False):
            return [hash(text[i:i + 2]) for i in range(0, len(text), 2)]

    q = ch01.token_count_question(Words(), "a short sentence")
    check_question(q, "token count")
    assert q.options[q.answer].text == str(len(Words().encode("a short sentence")))


@pytest.mark.parametrize("exercise", ["1.1", "1.2", "1.3", "1.4"])
def test_every_exercise_is_listed_in_the_module_docstring(exercise: str) -> None:
    assert exercise in ch01.__doc__
