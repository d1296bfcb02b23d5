"""Generated hostile requests through the server: a result or a 400, never a 5xx, never a dead engine.

hypothesis draws JSON bodies for both endpoints: every field a client may send, ordinary,
at its type's edges or of the wrong type (``hostile_values``), plus fields the server does
not know, streamed or not, against a server with and without speculative decoding. For
each body:

* the status is 200 or 400 (a 400 in OpenAI's error shape, its message naming what was
  wrong); a streamed 200 carries no error event and ends with ``data: [DONE]``;
* the server stays healthy (``/health`` 200).

Afterwards no request is left in the engine, every KV block is free, and a plain request
gives the tokens the same engine gives offline.
"""

from __future__ import annotations

import collections
import json
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostile_values import (EDGE_FLOATS, HOSTILE_SAMPLING, ORDINARY_SAMPLING, TEXT, VOCAB, WRONG_TYPES, fuzz_settings,
                            mostly_ordinary, token_ids)
from nanoengine import SamplingParams
from nanoengine.entrypoints.openai.api_server import serve_in_background

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

CONFIG = dict(device="cpu", max_model_len=64, num_kv_blocks=48, block_size=8, max_num_seqs=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NAME = "tiny-hostile"
TIMEOUT = 60

# The body's fields: the engine's sampling fields under their wire names, and the protocol's own.
ORDINARY_COMMON = {**{k: v for k, v in ORDINARY_SAMPLING.items() if k != "logprobs"},
                   "model": st.just(NAME), "stream": st.booleans(), "user": st.text(max_size=8)}
HOSTILE_COMMON = {**{k: v for k, v in HOSTILE_SAMPLING.items() if k != "logprobs"},
                  "model": st.one_of(TEXT, WRONG_TYPES), "stream": WRONG_TYPES,
                  "stream_options": st.one_of(st.just({"include_usage": True}), WRONG_TYPES),
                  "presence_penalty": st.one_of(EDGE_FLOATS, WRONG_TYPES),
                  "logit_bias": st.one_of(st.just({"5": 1.0}), WRONG_TYPES), "user": st.one_of(TEXT, WRONG_TYPES),
                  "unknown_field": st.just(1)}
PROMPT = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=20)}),
                    min_size=1, max_size=2)
COMPLETION = mostly_ordinary(
    {"prompt": PROMPT},
    {**ORDINARY_COMMON, "logprobs": ORDINARY_SAMPLING["logprobs"]},
    {**HOSTILE_COMMON, "logprobs": HOSTILE_SAMPLING["logprobs"], "echo": st.booleans(), "suffix": TEXT,
     "best_of": HOSTILE_SAMPLING["n"],
     "prompt": st.one_of(TEXT, token_ids(), st.lists(TEXT, max_size=3), st.lists(token_ids(4), max_size=3),
                         WRONG_TYPES)})
CHAT = mostly_ordinary(
    {"messages": MESSAGES},
    {**ORDINARY_COMMON, "logprobs": st.booleans(), "top_logprobs": ORDINARY_SAMPLING["logprobs"]},
    {**HOSTILE_COMMON, "logprobs": WRONG_TYPES, "top_logprobs": HOSTILE_SAMPLING["logprobs"],
     "max_completion_tokens": HOSTILE_SAMPLING["max_tokens"],
     "response_format": st.one_of(st.just({"type": "json_object"}), WRONG_TYPES), "tools": WRONG_TYPES,
     "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": TEXT, "content": st.one_of(TEXT, WRONG_TYPES)}),
                                    max_size=3), WRONG_TYPES)})


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "speculative"])
def server(request, build_tiny_llm):
    config = {**CONFIG, **({"speculative_config": NGRAM} if request.param else {})}
    with serve_in_background(build_tiny_llm(config).engine, NAME) as running:
        running.config = config
        yield running


def post(server, path: str, raw: bytes) -> tuple[int, str]:
    request = urllib.request.Request(server.url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _encode(body: dict) -> bytes:
    """The body as a client's JSON encoder writes it: NaN and infinities as Python's json
    writes them (not strict JSON), huge integers as digits, lone surrogates escaped."""
    return json.dumps(body).encode()


def _answer_is_a_result_or_a_refusal(status: int, text: str, streamed: bool) -> None:
    assert status in (200, 400), f"status {status}: {text[:300]}"
    if status == 400:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
    elif streamed:  # every 200 is checked: a stream that is not server-sent events fails here
        assert text.startswith("data: "), text[:300]
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        assert not any('"error"' in event[:10] for event in events), text[:300]
    else:
        assert json.loads(text)["choices"], text[:300]


def _healthy(server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT) as response:
        return response.status == 200


@pytest.mark.slow
def test_every_generated_body_gets_a_result_or_a_400_and_the_server_serves_on(server, offline):
    statuses = collections.Counter()

    @fuzz_settings(40)
    @given(path_and_body=st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION),
                                   st.tuples(st.just("/v1/chat/completions"), CHAT)))
    def one_body(path_and_body):
        path, body = path_and_body
        status, text = post(server, path, _encode(body))
        _answer_is_a_result_or_a_refusal(status, text, body.get("stream") is True)
        statuses[status] += 1
        assert _healthy(server)

    one_body()
    # The bodies must have reached the engine as well as its refusals, or passing would mean little.
    assert statuses[200] >= 3 and statuses[400] >= 3, statuses
    engine_state = server.engine.call(lambda e: (e.has_unfinished_requests(), e.block_manager.num_free_blocks,
                                                 e.runner.num_blocks)).result(TIMEOUT)
    assert engine_state[0] is False and engine_state[1] == engine_state[2]
    expected = offline.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    status, text = post(server, "/v1/completions", _encode({"prompt": [11, 12, 13], "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True}))
    assert status == 200 and json.loads(text)["choices"][0]["text"] == expected.text
