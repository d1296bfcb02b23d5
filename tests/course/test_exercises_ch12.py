"""Chapter 12's exercise checks (widgets.exercises.ch12): placeholders and bad values are
"not yet", the checks judge what a real server answered (usage, 200 or 400, 429s), plausible
wrong answers fail, and the checks still work once the chapter's server has been stopped.
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
    (ch12.check_stream_usage, [..., None, "include_usage", {"include_usage": True},
                               {"prompt_tokens": ..., "completion_tokens": 1, "total_tokens": 1},
                               {"prompt_tokens": 1.5, "completion_tokens": 1, "total_tokens": 2.5},
                               {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 3}]),
    (ch12.check_max_tokens, [..., None, "10", 2.5, True, 0, -3]),
    (ch12.check_max_queue, [..., None, "2", 2.0, False, 0]),
])
def test_placeholders_and_bad_values_are_not_yet(check, values):
    for value in values:
        result = check(None, value) if check is not ch12.check_max_queue else check(value)
        assert not result.right and "not yet. Hint: " in str(result), (value, str(result))


@pytest.mark.slow
def test_stream_usage_is_right_only_for_the_servers_counts(server):
    right = ch12.predicted_usage(ch12.USAGE_PROMPTS, ch12.USAGE_N, ch12.USAGE_MAX_TOKENS)
    served, texts = ch12.streamed_usage(server)
    assert served == right and texts >= 1
    assert ch12.check_stream_usage(server, right).right
    prompt, completion = right["prompt_tokens"], right["completion_tokens"]
    wrong_answers = [  # the prompt counted once per completion; only one completion per prompt; n ignored
        {"prompt_tokens": ch12.USAGE_N * prompt, "completion_tokens": completion},
        {"prompt_tokens": prompt, "completion_tokens": len(ch12.USAGE_PROMPTS) * ch12.USAGE_MAX_TOKENS},
        {"prompt_tokens": prompt, "completion_tokens": ch12.USAGE_N * ch12.USAGE_MAX_TOKENS},
    ]
    for wrong in wrong_answers:
        wrong["total_tokens"] = wrong["prompt_tokens"] + wrong["completion_tokens"]
        result = ch12.check_stream_usage(server, wrong)
        assert not result.right and str(completion) not in str(result).split("Hint:")[1], str(result)


@pytest.mark.slow
def test_max_tokens_is_right_only_at_the_edge_of_the_window(server):
    edge = MAX_MODEL_LEN - server.prompt_tokens
    right = ch12.check_max_tokens(server, edge)
    assert right.right and f"ask for at most {edge}" in str(right).replace("\n", " ")
    assert "and so is" in str(ch12.check_max_tokens(server, edge - 1))
    assert "refused max_tokens" in str(ch12.check_max_tokens(server, edge + 1))
    assert server.engine.call(lambda e: not e.has_unfinished_requests()).result(30)  # accepted ones were aborted


@pytest.mark.slow
def test_checks_serve_again_after_the_server_was_stopped(build_tiny_llm):
    """After "Run All" the chapter's last cell has stopped its server: no ConnectError."""
    engine = build_tiny_llm(dict(device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=128, block_size=16)).engine
    stopped = serve_in_background(engine, "tiny")
    stopped.stop()
    assert not ch12._listening(stopped)
    right = ch12.predicted_usage(ch12.USAGE_PROMPTS, ch12.USAGE_N, ch12.USAGE_MAX_TOKENS)
    assert ch12.check_stream_usage(stopped, right).right
    edge = MAX_MODEL_LEN - len(engine.tokenizer.encode(ch12.CONTEXT_PROMPT, add_special_tokens=False))
    assert ch12.check_max_tokens(stopped, edge).right
    assert not engine.has_unfinished_requests()  # the check's own server was stopped, the engine handed back


@pytest.mark.slow
def test_the_server_follows_the_queue_rule():
    for q in (2, 4, 7):
        assert ch12.overload(q) == ch12.admitted_by_rule(q), q
    assert ch12.admitted_by_rule(2)[2] == "400"  # three prompts can never wait under a limit of 2


@pytest.mark.slow
def test_max_queue_is_right_only_at_the_smallest_limit():
    answer = min(q for q in range(1, 20) if ch12.admitted_by_rule(q).count("429") <= 1
                 and "400" not in ch12.admitted_by_rule(q))
    assert ch12.check_max_queue(answer).right
    # plausible wrong answers: every prompt but one (sum - 1), the largest request, one too few
    for wrong in {sum(ch12.QUEUE_SIZES) - 1, max(ch12.QUEUE_SIZES), answer - 1, answer + 1} - {answer}:
        assert not ch12.check_max_queue(wrong).right, wrong


# ------------------------------------------------------------------ the chapter's readings: both sides
def _rows(ttfts, rates=(1.88, 30.16)):
    return [{"rate_requests_per_s": r, "ttft_ms": {"p50": t}} for r, t in zip(rates, ttfts)]


def test_ttft_climbs_only_on_a_curve_whose_numbers_climb():
    server = ch12.read_ttft_climb(_rows([110, 273]), "through the server")
    assert "110 -> 273 ms" in server and "it climbed" in server
    in_process = ch12.read_ttft_climb(_rows([75, 78]), "in-process")  # the case: 69-82 ms
    assert "stayed about level" in in_process and "climbed" not in in_process
    assert "climbed" in ch12.read_ttft_climb(_rows([100, 150]), "x")  # the threshold, 1.5x
    assert "level" in ch12.read_ttft_climb(_rows([100, 149]), "x")


def test_the_gap_readings_follow_their_numbers():
    assert "widened" in ch12.read_gap_trend([35, 41, 33, 131, 195], hops_ms=1.05)
    assert "narrowed" in ch12.read_gap_trend([131, 195, 33, 35, 41], hops_ms=1.05)
    assert "stayed about level" in ch12.read_gap_trend([35, 36, 35, 35.5, 36], hops_ms=1.05)
    assert "something else" in ch12.read_median_gap(41, 1.05) and "OpenMP team" in ch12.read_median_gap(41, 1.05)
    assert "account for it" in ch12.read_median_gap(2.0, 1.05)
    assert "negative" in ch12.read_median_gap(-3.0, 1.05)


def test_the_slow_reader_reading():
    assert "did not wait" in ch12.read_slow_reader(15)
    assert "shows nothing" in ch12.read_slow_reader(0)
