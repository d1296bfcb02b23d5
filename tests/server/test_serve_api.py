"""The OpenAI-compatible server end to end, through the official ``openai`` client.

The server runs in this process (uvicorn in a thread, on a free port of 127.0.0.1) over the
tiny random Llama with SmolLM2's tokenizer: mechanics only, so the text is noise, but
every token is checked against the same engine run offline. Every request has a timeout;
every server is stopped by its fixture.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request

import openai
import pytest

from nanoengine import SamplingParams
from nanoengine.entrypoints.openai.api_server import serve_in_background

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest
CONFIG = dict(device="cpu", max_model_len=1024, num_kv_blocks=512, block_size=16, max_num_seqs=8)
NAME = "tiny-test"
LONG = {"ignore_eos": True}  # extra_body: run to max_tokens
TIMEOUT = 60


@pytest.fixture(scope="module")
def server(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME) as running:
        yield running


def on_engine(server, fn):
    return server.engine.call(fn).result(TIMEOUT)


def wait_until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def idle(server) -> bool:
    """No request left in the engine and every KV block back in the free pool."""
    return on_engine(server, lambda e: not e.has_unfinished_requests()
                     and e.block_manager.num_free_blocks == e.runner.num_blocks)


def raw_post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


# --------------------------------------------------------------------- requests
def test_completion_matches_the_engine_run_offline(client, offline):
    got = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0,
                                    extra_body=LONG)
    want = offline.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12,
                                                                       ignore_eos=True))[0]
    choice = got.choices[0]
    assert got.object == "text_completion" and got.model == NAME and got.id.startswith("cmpl-")
    assert choice.text == want.text and choice.finish_reason == "length" and choice.index == 0
    prompt_tokens = len(offline.tokenizer.encode("The capital of France is", add_special_tokens=False))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
        (prompt_tokens, 12, prompt_tokens + 12)


def test_token_id_prompts_and_several_prompts_number_their_choices(client, offline):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[100, 200, 300], [7, 8, 9, 10]]
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2, extra_body=LONG)
    want = offline.generate(prompts, params)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want[0].text] * 2 + [want[1].text] * 2  # greedy: n equal copies
    assert got.usage.prompt_tokens == 7 and got.usage.completion_tokens == 20


def test_chat_applies_the_template_and_matches_llm_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body=LONG)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    choice = got.choices[0]
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client):
    got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                         temperature=0, stop=["e"], extra_body={"min_p": 0.0})
    assert got.choices[0].finish_reason in ("stop", "length") and got.usage.completion_tokens >= 1


def test_n_2_with_a_seed_is_reproducible_and_the_completions_differ(client):
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=11,
                  extra_body=LONG)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert len(texts) == 2 and texts[0] != texts[1] and texts == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 16


def test_stop_strings_end_the_text_before_them(client, offline):
    full = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].text
    stop = full[6:9]
    assert stop.strip() and stop in full
    got = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body=LONG).choices[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop and got.text == full[:full.index(stop)]


def test_logprobs_the_openai_way_on_both_endpoints(client):
    got = client.completions.create(model=NAME, prompt="Hi", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body=LONG).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == 4
    for token, logprob, top in zip(got.tokens, got.token_logprobs, got.top_logprobs):
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the most likely
        assert 3 <= len(top) <= 4 and logprob <= 0
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=LONG).choices[0].logprobs.content
    assert len(chat) == 3 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in chat)


# -------------------------------------------------------------------- streaming
def test_streamed_completion_concatenates_to_the_whole_text_with_usage(client, offline):
    want = offline.generate("Tell me", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].text
    chunks = list(client.completions.create(model=NAME, prompt="Tell me", max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=LONG))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == want
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_opens_with_the_role_and_ends_with_done(server, offline):
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        raw = response.read().decode()
    finally:
        conn.close()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    want = offline.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=6,
                                                                            ignore_eos=True))[0].text
    assert text == want and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_n_2_keeps_the_choices_apart(client):
    kwargs = dict(model=NAME, prompt="A list:", max_tokens=6, temperature=0.9, n=2, seed=5, extra_body=LONG)
    whole = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                assert choice.index not in finished  # each choice finishes once
                finished[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and finished == {0: "length", 1: "length"}


def test_streamed_logprobs_add_up_to_the_plain_responses(client):
    """Each chunk carries the logprobs of its own new tokens, with text offsets that
    continue where the previous chunk's text ended."""
    kwargs = dict(model=NAME, prompt="Count:", max_tokens=6, temperature=0, logprobs=2, extra_body=LONG)
    whole = client.completions.create(**kwargs).choices[0]
    tokens, logprobs, offsets, text, usage = [], [], [], "", []
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage.append(chunk.usage.completion_tokens)
            continue
        choice = chunk.choices[0]
        assert len(choice.logprobs.tokens) <= 1 and choice.logprobs.text_offset[:1] in ([], [len(text)])
        tokens += choice.logprobs.tokens
        logprobs += choice.logprobs.token_logprobs
        text += choice.text
    assert (tokens, logprobs, text) == (whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.text)
    assert usage == [6]  # include_usage: one usage chunk, and it counts every token


# ------------------------------------------------------------------- disconnects
def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_blocks(server, client):
    wait_until(lambda: idle(server), "an idle server")
    free_at_start = on_engine(server, lambda e: e.block_manager.num_free_blocks)
    aborted_before = server.app.state.metrics.finished["abort"]
    stream = client.completions.create(model=NAME, prompt="Count with me:", max_tokens=1000, temperature=0,
                                       stream=True, extra_body=LONG)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert on_engine(server, lambda e: e.block_manager.num_free_blocks) < free_at_start  # it holds blocks now
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: idle(server), "the aborted request's blocks to be freed")
    assert on_engine(server, lambda e: e.block_manager.num_free_blocks) == free_at_start
    assert server.app.state.metrics.finished["abort"] == aborted_before + 1  # aborted, not finished
    on_engine(server, lambda e: e.check_invariants())


def test_a_client_that_disconnects_before_a_plain_response_aborts_too(server):
    wait_until(lambda: idle(server), "an idle server")
    aborted_before = server.app.state.metrics.finished["abort"]
    body = json.dumps({"model": NAME, "prompt": "Go on:", "max_tokens": 1000, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_until(lambda: on_engine(server, lambda e: e.has_unfinished_requests()), "the request to start")
    sock.close()
    wait_until(lambda: idle(server), "the abandoned request to be aborted")
    assert server.app.state.metrics.finished["abort"] == aborted_before + 1


# --------------------------------------------------------------------- bad input
BAD = [
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, "model", "does not exist"),
    ("negative max_tokens", {"model": NAME, "prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens must be at least 1"),
    ("prompt longer than max_model_len", {"model": NAME, "prompt": [1] * 1025}, "prompt", "max_model_len is 1024"),
    ("prompt + max_tokens over the window", {"model": NAME, "prompt": [1] * 1000, "max_tokens": 30}, "max_tokens",
     "ask for at most 24"),
    ("n above the limit", {"model": NAME, "prompt": "x", "n": 9}, "n", "max_num_seqs is 8"),
    ("a token id outside the vocabulary", {"model": NAME, "prompt": [1, 99999]}, "prompt", "[0, 49152)"),
    ("an unknown field", {"model": NAME, "prompt": "x", "tools": []}, "tools", "unknown or unsupported field"),
    ("a string for a number", {"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ("no prompt", {"model": NAME}, "prompt", "prompt is required"),
]


@pytest.mark.parametrize("name, body, param, fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_in_openais_shape(server, client, name, body, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        if "prompt" in body:
            rest = {k: v for k, v in body.items() if k not in ("model", "prompt")}
            client.completions.create(model=body["model"], prompt=body["prompt"], extra_body=rest)
        else:
            client.post("/completions", body=body, cast_to=dict)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"], error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, fragment", [(b"{bad json", "not valid JSON"), (b"", "not valid JSON"),
                                            (b"[1, 2]", "must be a JSON object")])
def test_a_body_that_is_not_a_json_object_is_a_400(server, body, fragment):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, payload = raw_post(server, path, body)
        assert status == 400 and fragment in payload["error"]["message"]


def test_bad_chat_input_is_a_400(client):
    for kwargs in (dict(messages=[]), dict(messages=[{"role": "user", "content": "x"}], top_logprobs=3),
                   dict(messages=[{"role": "user", "content": "x"}], max_tokens=2000)):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, **kwargs)


@pytest.mark.slow
def test_bad_requests_leave_the_engine_serving_the_others(server, client, offline):
    want = offline.generate("Keep going", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].text
    stream = client.completions.create(model=NAME, prompt="Keep going", max_tokens=60, temperature=0, stream=True,
                                       extra_body=LONG)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    errors = 0
    for _, body, _, _ in BAD:  # while the stream is running
        try:
            client.post("/completions", body=body, cast_to=dict)
        except openai.BadRequestError:
            errors += 1
    raw_post(server, "/v1/completions", b"{bad")
    text += "".join(c.choices[0].text for c in chunks)
    assert errors == len(BAD) and text == want
    with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT) as health:
        assert health.status == 200


# ------------------------------------------------------------ the other routes
def test_models_health_metrics_and_unknown_routes(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == 1024
    status, body = raw_post(server, "/v1/nothing-here", b"{}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        page = response.read().decode()
    finally:
        conn.close()
    assert response.getheader("content-type").startswith("text/plain; version=0.0.4")
    lines = dict(line.rsplit(" ", 1) for line in page.splitlines() if not line.startswith("#"))
    label = f'{{model_name="{NAME}"}}'
    assert int(lines[f"nanoengine:kv_cache_blocks{label}"]) == 512
    assert int(lines[f'nanoengine:time_to_first_token_seconds_count{label}']) >= 1
    assert int(lines[f"nanoengine:generation_tokens_total{label}"]) > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "prefix_cache_hit_rate",
                 "inter_token_latency_seconds_count"):
        assert f"nanoengine:{name}{label}" in lines, name


def test_reset_prefix_cache(server, client):
    client.completions.create(model=NAME, prompt=list(range(1, 40)), max_tokens=1)
    assert raw_post(server, "/reset_prefix_cache", b"")[1]["dropped_blocks"] >= 2
    assert raw_post(server, "/reset_prefix_cache", b"")[1]["dropped_blocks"] == 0


# ------------------------------------------------------- queue limit, API key
def test_overload_past_the_queue_limit_is_429_and_never_a_crash(build_tiny_llm):
    engine = build_tiny_llm({**CONFIG, "max_num_seqs": 1}).engine
    with serve_in_background(engine, NAME, max_queue=2) as server, \
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=TIMEOUT) as client:
        running = client.completions.create(model=NAME, prompt="long", max_tokens=1000, stream=True, extra_body=LONG)
        next(iter(running))  # it holds the only seat: whatever comes next waits
        results: dict[int, object] = {}

        def send(i: int) -> None:
            try:
                results[i] = client.completions.create(model=NAME, prompt=f"wait {i}", max_tokens=4, stream=True,
                                                       extra_body=LONG)
            except openai.APIStatusError as exc:
                results[i] = exc

        threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        refused = [r for r in results.values() if isinstance(r, openai.RateLimitError)]
        accepted = [r for r in results.values() if isinstance(r, openai.Stream)]
        assert len(refused) == 3 and len(accepted) == 2, results
        assert refused[0].body["code"] == "queue_full" and refused[0].response.headers["retry-after"] == "1"
        assert "already waiting" in refused[0].body["message"]
        running.close()  # the long one leaves; the two that waited now run to the end
        assert [[c.choices[0].finish_reason for c in s if c.choices][-1] for s in accepted] == ["length"] * 2
        assert server.app.state.metrics.rejected == 3
        wait_until(lambda: idle(server), "the overloaded server to drain")
        assert client.completions.create(model=NAME, prompt="after", max_tokens=2).choices[0].finish_reason


@pytest.mark.slow
def test_with_an_api_key_every_v1_request_without_it_is_401(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME, api_key="s3cret") as server:
        def status(path: str, key: str | None) -> int:
            host, port = server.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
            try:
                conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
                return conn.getresponse().status
            finally:
                conn.close()

        assert [status(p, None) for p in ("/v1/models", f"/v1/models/{NAME}", "/v1/nothing")] == [401] * 3
        assert status("/v1/models", "wrong") == 401 and status("/v1/models", "s3cret") == 200
        assert status("/health", None) == 200  # probes need no key (test_serve_clients: /v1 only)
        with openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=TIMEOUT) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                bad.completions.create(model=NAME, prompt="x", max_tokens=1)
            assert info.value.body["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0, timeout=TIMEOUT) as good:
            assert good.completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_the_server_listens_on_127_0_0_1_by_default(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME) as server:
        assert server.url.startswith("http://127.0.0.1:")
