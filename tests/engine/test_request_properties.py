"""Generated hostile requests through ``LLM``: every answer is a result or a clear refusal.

hypothesis draws prompts (odd Unicode, empty, long, token ids at their type's edges) and
sampling settings (``hostile_values``: every field ordinary, at its edges or of the wrong
type), greedy and sampled, on an engine with and without speculative decoding. For each:

* building ``SamplingParams`` and generating either refuses with a ``ValueError`` or
  ``TypeError`` whose message names the field (or the prompt), or returns a result that
  finished by "stop" or "length", never "error" (a fault the checks let through);
* afterwards no request is left, every KV block is free, the invariants hold, and a
  plain request gives the same tokens as before.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostile_values import ORDINARY_SAMPLING, TEXT, VOCAB, fuzz_settings, sampling_fields, token_ids
from nanoengine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

CONFIG = dict(device="cpu", max_model_len=64, num_kv_blocks=48, block_size=8, max_num_seqs=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PLAIN = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ORDINARY_TEXT = st.text(min_size=1, max_size=30)
ORDINARY_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
PROMPTS = st.one_of(ORDINARY_TEXT, ORDINARY_IDS, ORDINARY_TEXT, ORDINARY_IDS,  # ordinary twice as often
                    TEXT, token_ids(), st.just([5] * 64), st.just([5] * 65), st.sampled_from([None, 7, b"hi"]))
NAMES = (*ORDINARY_SAMPLING, "prompt", "token ids", "messages")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "speculative"])
def llm(request, build_tiny_llm):
    llm = build_tiny_llm({**CONFIG, **({"speculative_config": NGRAM} if request.param else {})})
    llm.expected_plain = llm.generate("Hello", PLAIN)[0].token_ids
    return llm


def _refused_clearly(exc: Exception) -> None:
    message = str(exc)
    assert any(name in message for name in NAMES), f"the refusal names no field: {message!r}"
    assert len(message) < 1000, f"a refusal of {len(message)} characters"


def _check_unharmed(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    engine.check_invariants()


@pytest.mark.slow
def test_every_generated_request_gets_a_result_or_a_clear_refusal(llm):
    answers = collections.Counter()

    @fuzz_settings(60)
    @given(prompt=PROMPTS, fields=sampling_fields(), chat=st.booleans())
    def one_request(prompt, fields, chat):
        try:
            params = SamplingParams(**fields)
            outs = llm.chat([{"role": "user", "content": prompt}], params) if chat else llm.generate(prompt, params)
        except (ValueError, TypeError) as exc:
            _refused_clearly(exc)
            answers["refused"] += 1
        else:
            for completion in (c for out in outs for c in out.outputs):
                assert completion.finish_reason in ("stop", "length"), (completion.finish_reason, completion.error)
            answers["result"] += 1
        _check_unharmed(llm)

    one_request()
    # The requests must have reached the engine as well as its refusals, or passing would mean little.
    assert answers["result"] >= 3 and answers["refused"] >= 3, answers
    assert llm.generate("Hello", PLAIN)[0].token_ids == llm.expected_plain  # and it serves as before
