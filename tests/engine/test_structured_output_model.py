"""Structured output with the real model (chapter 14): every output valid, greedy and sampled,
with and without speculation, each checked by a validator that is not the grammar library
(``jsonschema``, Python's ``re``, a small recursive parser for the grammar).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "city": {"type": "string", "maxLength": 20}}}
REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars", "tags"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                         "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
ARITHMETIC = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/'

CASES = [
    ("json", StructuredOutputsParams(json=PERSON), "Describe a person as JSON with name, age and city."),
    ("json", StructuredOutputsParams(json=REVIEW), "Review of a pizza place as JSON: sentiment, stars, tags."),
    ("regex", StructuredOutputsParams(regex=DATE), "When did the first moon landing happen? Answer with a date."),
    ("regex", StructuredOutputsParams(regex=PHONE), "Write a US phone number."),
    ("choice", StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
     "Is this review positive or negative? 'The food was cold and the waiter rude.'"),
    ("grammar", StructuredOutputsParams(grammar=ARITHMETIC), "Write an arithmetic expression that equals 10."),
]


def valid(params: StructuredOutputsParams, text: str) -> bool:
    if params.json is not None:
        jsonschema.validate(json.loads(text), params.json)
        return True
    if params.regex is not None:
        return re.fullmatch(params.regex, text) is not None
    if params.choice is not None:
        return text in params.choice
    return parses_arithmetic(text)


def parses_arithmetic(text: str) -> bool:
    """``expr := term (('+'|'-') term)*``, ``term := number | '(' expr ')'``, whitespace-free."""
    position = 0

    def term() -> bool:
        nonlocal position
        if text[position:position + 1] == "(":
            position += 1
            if not expr() or text[position:position + 1] != ")":
                return False
            position += 1
            return True
        digits = re.match(r"[0-9]{1,3}", text[position:])
        if digits is None:
            return False
        position += digits.end()
        return True

    def expr() -> bool:
        nonlocal position
        if not term():
            return False
        while text[position:position + 1] in ("+", "-") and position < len(text):
            position += 1
            if not term():
                return False
        return True

    return expr() and position == len(text)


@pytest.fixture(scope="module")
def speculating_llm():
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    yield llm
    llm.engine.shutdown()


def generate(llm: LLM, temperature: float) -> list:
    prompts = [[{"role": "user", "content": question}] for _, _, question in CASES]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs=constraint)
              for i, (_, constraint, _) in enumerate(CASES)]
    return [out.outputs[0] for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_output_of_the_real_model_is_valid(default_llm, temperature):
    for (kind, constraint, _), completion in zip(CASES, generate(default_llm, temperature)):
        assert completion.finish_reason == "stop", (kind, completion.text)
        assert valid(constraint, completion.text), (kind, completion.text)
        if constraint.json is not None:  # the properties come in the order the schema lists them
            assert list(json.loads(completion.text)) == list(constraint.json["properties"])


def test_with_speculation_greedy_is_identical_and_sampled_is_valid(default_llm, speculating_llm):
    plain = generate(default_llm, 0.0)
    speculated = generate(speculating_llm, 0.0)
    assert [c.token_ids for c in speculated] == [c.token_ids for c in plain]
    assert speculating_llm.engine.spec_decode_stats.num_draft_tokens > 0
    for (kind, constraint, _), completion in zip(CASES, generate(speculating_llm, 0.7)):
        assert completion.finish_reason == "stop" and valid(constraint, completion.text), (kind, completion.text)


def test_the_validator_refuses_what_it_should():
    assert parses_arithmetic("(1+2)-30") and not parses_arithmetic("1+") and not parses_arithmetic("(1")
    assert not valid(CASES[2][1], "1969-13-01") and valid(CASES[2][1], "1969-07-20")
    with pytest.raises(jsonschema.ValidationError):
        valid(CASES[0][1], '{"name": "A", "age": 200, "city": "B"}')
