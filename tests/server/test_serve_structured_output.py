"""Structured output through the server (chapter 14): OpenAI's ``response_format`` and vLLM's
``structured_outputs`` on both endpoints, streamed and not; a constraint that does not compile
is a 400 with the library's reason, and the server serves on.

The tiny random Llama with SmolLM2's tokenizer writes nonsense, so whatever parses was made to
parse by the mask. JSON without optional whitespace, so each reply ends within a few dozen tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from nanoengine.entrypoints.openai.api_server import serve_in_background

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = dict(device="cpu", max_model_len=512, num_kv_blocks=256, block_size=16, max_num_seqs=8,
              structured_outputs_config={"disable_any_whitespace": True})
NAME = "tiny-structured"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
          "required": ["ok", "level"], "additionalProperties": False}
HI = [{"role": "user", "content": "Answer in JSON"}]


@pytest.fixture(scope="module")
def client(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_chat_json_schema_reply_follows_the_schema(client):
    reply = client.chat.completions.create(
        model=NAME, messages=HI, max_tokens=60, temperature=0.9, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_mode_on_the_completions_endpoint(client):
    reply = client.completions.create(model=NAME, prompt="A JSON object:", max_tokens=200, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    text = reply.choices[0].text
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may nest deeper than 200 tokens: what it wrote is still an object's beginning
        assert text.startswith("{")


def test_vllm_structured_outputs_field_streamed(client):
    stream = client.completions.create(model=NAME, prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                       stream=True, extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    pieces, finish = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) in ("red", "green") and finish == "stop"


def test_regex_with_logprobs_sends_forbidden_tokens_as_finite_numbers(client):
    reply = client.chat.completions.create(model=NAME, messages=HI, max_tokens=20, temperature=0, logprobs=True,
                                           top_logprobs=5, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", reply.choices[0].message.content)
    for token in reply.choices[0].logprobs.content:
        assert token.logprob > -9999.0  # the sampled token was allowed
        assert all(-9999.0 <= alt.logprob <= 0 for alt in token.top_logprobs)


@pytest.mark.parametrize("body, reason", [
    ({"structured_outputs": {"regex": "[0-9"}}, "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "nowhere"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}},
     "nothing"),
    ({"structured_outputs": {"choice": []}}, "1 to 1024 strings"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "exactly one"),
])
def test_a_constraint_that_does_not_compile_is_a_400_and_the_server_serves_on(client, body, reason):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=HI, max_tokens=5, extra_body=body)
    assert reason in info.value.body["message"]
    assert info.value.body["param"] == "structured_outputs"
    fine = client.chat.completions.create(model=NAME, messages=HI, max_tokens=8, temperature=0,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert fine.choices[0].message.content in ("yes", "no")
