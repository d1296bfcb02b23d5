"""Chapter 1's exercise checks judge what a run produced (widgets/exercises/ch01.py).

Each check is run on a tiny random engine (mechanics only, milliseconds per step) once with
the right setting, once with a wrong one and once before anything ran.
"""

from __future__ import annotations

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
        engine.add_request([101 + i, 102, 103], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return steps


def test_batched_decode_needs_all_eight_sequences_in_one_step() -> None:
    right = ch01.check_batched_decode(_run_eight(8))
    assert right.right and str(right).startswith("Exercise 1.1: right.")
    wrong = ch01.check_batched_decode(_run_eight(3))
    assert not wrong.right and "widest decode step ran 3 of the 8" in str(wrong)
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


def _samples(temperature: float, n: int = 5):
    engine = tiny_engine()
    engine.add_request([101, 102, 103], SamplingParams(n=n, seed=0, temperature=temperature, max_tokens=4,
                                                       ignore_eos=True), request_id="r")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_sampling_needs_completions_that_differ() -> None:
    assert ch01.check_sampling(_samples(1.0)).right
    assert not ch01.check_sampling(_samples(0.0)).right
    assert not ch01.check_sampling(_samples(1.0, n=1)).right
    assert not ch01.check_sampling(None).right


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
