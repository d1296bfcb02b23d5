"""Chapter 12's exercise checks (widgets.exercises.ch12): placeholders and bad values are
"not yet", and the checks judge what a real server answered (usage, 200 or 400, 429s).
A tiny random model with SmolLM2's tokenizer stands in for the chapter's real one."""

from __future__ import annotations

import pytest

from nanoengine.entrypoints.openai.api_server import serve_in_background
from widgets.exercises import ch12

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(build_tiny_llm):
    engine = build_tiny_llm(dict(device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=128, block_size=16)).engine
    prompt_tokens = len(engine.tokenizer.encode(ch12.CONTEXT_PROMPT, add_special_tokens=False))
    with serve_in_background(engine, "tiny") as running:
        running.prompt_tokens = prompt_tokens
        yield running


@pytest.mark.parametrize("check, values", [
    (ch12.check_stream_usage, [..., None, "include_usage", ["include_usage"]]),
    (ch12.check_max_tokens, [..., None, "10", 2.5, True, 0, -3]),
    (ch12.check_max_queue, [..., None, "2", 2.0, False, 0]),
])
def test_placeholders_and_bad_values_are_not_yet(check, values):
    for value in values:
        result = check(None, value) if check is not ch12.check_max_queue else check(value)
        assert not result.right and "not yet. Hint: " in str(result), (value, str(result))


def test_stream_usage_is_right_only_when_the_last_chunk_carries_it(server):
    assert ch12.check_stream_usage(server, {"include_usage": True}).right
    for wrong in ({}, {"include_usage": False}):
        result = ch12.check_stream_usage(server, wrong)
        assert not result.right and "none carried usage" in str(result)
    refused = ch12.check_stream_usage(server, {"include_tokens": True})
    assert not refused.right and "refused it (400)" in str(refused)


def test_max_tokens_is_right_only_at_the_edge_of_the_window(server):
    edge = MAX_MODEL_LEN - server.prompt_tokens
    right = ch12.check_max_tokens(server, edge)
    assert right.right and f"ask for at most {edge}" in str(right).replace("\n", " ")
    assert "and so is" in str(ch12.check_max_tokens(server, edge - 1))
    assert "refused max_tokens" in str(ch12.check_max_tokens(server, edge + 1))
    assert server.engine.call(lambda e: not e.has_unfinished_requests()).result(30)  # accepted ones were aborted


def test_max_queue_counts_the_requests_that_wait():
    assert ch12.overload(2) == (2, 4)
    assert ch12.check_max_queue(2).right
    for wrong in (1, 3):
        result = ch12.check_max_queue(wrong)
        assert not result.right and f"{wrong} waited" in str(result).replace("\n", " ")
