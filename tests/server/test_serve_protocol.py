"""The OpenAI wire format (nanoengine.entrypoints.openai.protocol), without a server: strict
parsing with errors that name the field, the mapping to SamplingParams, the context-window
fit, and the two logprobs shapes."""

from __future__ import annotations

import json

import pytest

from nanoengine import SamplingParams
from nanoengine.entrypoints.openai import protocol
from nanoengine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                                    fit_to_context, parse_request)
from nanoengine.outputs import TokenLogprob


def refused(model, body) -> ProtocolError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ProtocolError) as info:
        request = parse_request(model, raw)
        request.check_supported()
        try:
            request.to_sampling_params()
        except ValueError as exc:  # SamplingParams' own checks: the server answers them as serving does
            raise protocol.value_error(exc, request) from None
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize("body, param, fragment", [
    (b"{bad", None, "not valid JSON"),
    (b"", None, "not valid JSON"),
    (b"[]", None, "must be a JSON object"),
    ({"max_tokens": 3}, "prompt", "prompt is required"),
    ({"prompt": "hi", "tools": []}, "tools", "unknown or unsupported field 'tools'"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": ["a", 1]}, "prompt", "prompt must be a string, a list of token ids"),
    ({"prompt": {"text": "hi"}}, "prompt", "prompt must be"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": "hi", "stop": 3}, "stop", "stop must be a string or a list of strings"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "hi", "echo": True}, "echo", "not supported"),
    ({"prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
    ({"prompt": "hi", "suffix": ""}, "suffix", "not supported"),  # any suffix, even an empty one
    ({"prompt": "hi", "best_of": 3}, "best_of", "must equal n"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "hi", "logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
])
def test_bad_completion_bodies_are_400_naming_the_field(body, param, fragment):
    error = refused(CompletionRequest, body)
    assert error.param == param and fragment in error.message, (error.param, error.message)
    assert protocol.error_body(error.message, error.type, error.param, error.code)["error"]["param"] == param


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature", "temperature must be non-negative"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "top_k": -3}, "top_k", "top_k must be"),
    ({"prompt": "hi", "min_p": 2.0}, "min_p", "[0, 1]"),
    ({"prompt": "hi", "seed": -1}, "seed", "seed must be"),
    ({"prompt": "hi", "n": 0}, "n", "n must be an integer >= 1"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "hi", "stop": [""]}, "stop", "non-empty strings"),
])
def test_bad_values_are_refused_by_sampling_params_as_400(body, param, fragment):
    request = parse_request(CompletionRequest, json.dumps(body).encode())
    with pytest.raises(ValueError) as info:
        request.to_sampling_params()
    error = protocol.value_error(info.value, request)
    assert error.status == 400 and error.param == param and fragment in error.message, error.message


def test_a_completion_request_maps_to_sampling_params():
    request = parse_request(CompletionRequest, json.dumps({
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "seed": 4, "n": 2, "stop": "\n", "stop_token_ids": [9], "logprobs": 3,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
        "best_of": 2}).encode())
    request.check_supported()
    assert request.prompts() == [[1, 2, 3]] and request.include_usage
    assert request.to_sampling_params() == SamplingParams(temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, seed=4,
                                                          n=2, max_tokens=7, stop=("\n",), stop_token_ids=(9,),
                                                          logprobs=3, ignore_eos=True)
    defaults = parse_request(CompletionRequest, b'{"prompt": "hi"}').to_sampling_params()
    assert defaults == SamplingParams(max_tokens=16)  # OpenAI's defaults: temperature 1, 16 tokens


@pytest.mark.parametrize("prompt, prompts", [("a", ["a"]), ([5, 6], [[5, 6]]), (["a", "b"], ["a", "b"]),
                                             ([[1], [2, 3]], [[1], [2, 3]])])
def test_prompts_are_one_or_several(prompt, prompts):
    assert parse_request(CompletionRequest, json.dumps({"prompt": prompt}).encode()).prompts() == prompts


def test_chat_requests_map_logprobs_and_max_tokens_the_chat_way():
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]}],
            "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9}
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    request.check_supported()
    assert request.conversation() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi !"}]
    params = request.to_sampling_params()
    assert params.logprobs == 3 and params.max_tokens == 9 and request.requested_max_tokens == 9
    plain = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert plain.to_sampling_params().logprobs is None and plain.requested_max_tokens is None
    with_true = parse_request(ChatCompletionRequest,
                              b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}')
    assert with_true.to_sampling_params().logprobs == 0  # the sampled token's logprob, no alternatives


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": ["a"]},
      "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_chat_bodies_are_400(body, param):
    assert refused(ChatCompletionRequest, body).param == param


def test_fit_to_context_fills_or_refuses():
    params = SamplingParams(max_tokens=1)
    assert fit_to_context(params, None, 30, 100).max_tokens == 70  # chat: the rest of the window
    assert fit_to_context(SamplingParams(max_tokens=70), 70, 30, 100).max_tokens == 70  # exactly fits
    with pytest.raises(ValueError, match=r"ask for at most 70"):
        fit_to_context(SamplingParams(max_tokens=71), 71, 30, 100)
    with pytest.raises(ValueError, match="fills the model's context window"):
        fit_to_context(params, None, 100, 100)


ENTRIES = ((TokenLogprob(7, -0.5, " a"), TokenLogprob(3, -0.2, " b"), TokenLogprob(9, -3.0, " c")),
           (TokenLogprob(4, -0.1, "d"), TokenLogprob(8, -2.5, "e")))


def test_completion_logprobs_are_parallel_lists_with_offsets():
    got = protocol.completion_logprobs(ENTRIES, text_offset=5)
    assert got == {"tokens": [" a", "d"], "token_logprobs": [-0.5, -0.1],
                   "top_logprobs": [{" a": -0.5, " b": -0.2, " c": -3.0}, {"d": -0.1, "e": -2.5}],
                   "text_offset": [5, 7]}


def test_chat_logprobs_list_the_top_n_most_likely_first():
    got = protocol.chat_logprobs(ENTRIES, top_n=2)["content"]
    assert [t["token"] for t in got] == [" a", "d"] and got[0]["logprob"] == -0.5
    assert [c["token"] for c in got[0]["top_logprobs"]] == [" b", " a"]  # by probability, not sampled-first
    assert got[1]["bytes"] == [100] and len(protocol.chat_logprobs(ENTRIES, 0)["content"][0]["top_logprobs"]) == 0


def test_server_sent_events_and_usage():
    assert protocol.sse({"a": "é"}) == 'data: {"a": "é"}\n\n' and protocol.DONE == "data: [DONE]\n\n"
    assert protocol.usage(3, 4, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 2}}
    chunk = protocol.response("text_completion", "cmpl-1", 1, "m", [])
    assert "usage" not in chunk and protocol.response("text_completion", "cmpl-1", 1, "m", [], {"x": 1})["usage"]


def test_integral_floats_are_integers_and_other_floats_are_refused():
    request = parse_request(CompletionRequest, json.dumps({"prompt": [331.0, 2], "max_tokens": 3.0, "n": 1.0,
                                                           "logprobs": 5.0, "stop_token_ids": [7.0]}).encode())
    assert request.prompt == [331, 2] and request.max_tokens == 3 and request.n == 1 and request.logprobs == 5
    assert request.stop_token_ids == [7] and all(type(v) is int for v in (request.max_tokens, *request.prompt))
    for field, value in (("max_tokens", 1.5), ("n", float("1e400")), ("seed", -0.5)):
        error = refused(CompletionRequest, {"prompt": "x", field: value})
        assert error.param == field and "must be an integer (a whole number such as 4 or 4.0)" in error.message
    assert refused(CompletionRequest, {"prompt": [1.5]}).param == "prompt"
    assert refused(CompletionRequest, {"prompt": "x", "n": True}).param == "n"  # a boolean is not a number


CHAT = {"messages": [{"role": "user", "content": "x"}]}


def test_neutral_values_of_unimplemented_chat_fields_are_accepted():
    body = {**CHAT, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "service_tier": "default",
            "modalities": ["text"]}
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    request.check_supported()
    assert request.to_sampling_params() == parse_request(ChatCompletionRequest, json.dumps(CHAT).encode()) \
        .to_sampling_params()
    assert parse_request(ChatCompletionRequest, json.dumps({**CHAT, "tool_choice": "auto"}).encode())


@pytest.mark.parametrize("field, value, allowed", [
    ("tools", [{"type": "function"}], "empty"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, '"none" or "auto"'),
    ("store", True, "false"),
    ("modalities", ["text", "audio"], '["text"]'),
])
def test_values_that_change_the_result_are_refused_saying_what_is_allowed(field, value, allowed):
    error = refused(ChatCompletionRequest, {**CHAT, field: value})
    assert error.param == field and error.code == "unsupported" and f"allowed: {allowed}" in error.message, \
        error.message
