"""The server as real clients found it (issue 25 §3): huge and slow bodies, integral floats,
neutral values of fields the server does not implement, the schema, the role chunk's
timing, ``/v1/models/{id}``, ``system_fingerprint`` and cached prompt tokens.

Same setup as test_serve_api: uvicorn in a thread on a free port, over the tiny random
Llama with SmolLM2's tokenizer. Raw sockets where a client library would hide what is
tested (a partial upload, headers sent slowly). Nothing is held to a time limit (the machine
is shared): counts and the server's own messages say what happened, and deadlines only guard
against a hang.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import threading
import time

import openai
import pytest

from nanoengine import SamplingParams
from nanoengine.entrypoints.openai.api_server import serve_in_background

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest
CONFIG = dict(device="cpu", max_model_len=1024, num_kv_blocks=512, block_size=16, max_num_seqs=8)
NAME = "tiny-test"
TIMEOUT = 60
HI = [{"role": "user", "content": "Hi"}]


class Recording:
    """The engine's tokenizer, noting which thread each ``encode`` ran on and how long its text was."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.threads: list[str] = []
        self.lengths: list[int] = []

    def encode(self, text, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.lengths.append(len(text))
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer_threads(build_tiny_llm):
    engine = build_tiny_llm(CONFIG).engine
    engine.tokenizer = Recording(engine.tokenizer)
    engine.input_processor.tokenizer = engine.tokenizer  # the server tokenizes through the engine's processor
    return engine


@pytest.fixture(scope="module")
def server(tokenizer_threads):
    with serve_in_background(tokenizer_threads, NAME) as running:
        yield running


@pytest.fixture(scope="module")
def strict(build_tiny_llm):
    """Small limits, to test them quickly."""
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME, max_body_bytes=4096, header_timeout=0.5,
                             body_timeout=0.5) as running:
        yield running


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def request(server, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, dict, dict | str]:
    conn = http.client.HTTPConnection(*address(server), timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read().decode()
        kind = response.getheader("content-type", "")
        return response.status, dict(response.getheaders()), json.loads(raw) if "json" in kind else raw
    finally:
        conn.close()


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


# ------------------------------------------------- 1. huge bodies, long prompts
def test_a_10_mb_prompt_is_refused_at_once_and_a_small_request_beside_it_is_served(server, client,
                                                                                 tokenizer_threads):
    results: dict[str, object] = {}
    tokenized = tokenizer_threads.tokenizer.lengths
    tokenized.clear()

    def send(name: str, prompt: str, max_tokens: int) -> None:
        try:
            results[name] = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens)
        except openai.APIStatusError as exc:
            results[name] = exc

    threads = [threading.Thread(target=send, args=("10 MB", "word " * 2_000_000, 4)),
               threading.Thread(target=send, args=("2 MB", "word " * 400_000, 4))]
    for t in threads:
        t.start()
    send("small", "Hello", 2)
    for t in threads:
        t.join(TIMEOUT)
    big, mid, small = results["10 MB"], results["2 MB"], results["small"]
    # Over the 8 MiB default: 413 in OpenAI's shape, the body never parsed.
    assert big.status_code == 413 and big.body["code"] == "request_too_large", big
    assert "larger than this server's limit of 8388608 bytes" in big.body["message"]
    # Under it, but too many bytes to fit in 1024 tokens: refused without tokenizing.
    assert mid.status_code == 400 and mid.body["code"] == "context_length_exceeded", mid
    assert "max_model_len is 1024" in mid.body["message"] and mid.body["param"] == "prompt"
    assert small.usage.completion_tokens == 2
    # Tokenizing 10 MB took 13 s on the engine thread, and held up every other request: counted, not
    # timed (a busy machine makes any time limit flaky), only the small prompt reached the tokenizer.
    assert tokenized == [len("Hello")], tokenized


def test_prompts_are_tokenized_on_the_tokenizer_thread_and_checked_before_the_engine(server, client,
                                                                                   tokenizer_threads):
    tokenizer = tokenizer_threads.tokenizer
    tokenizer.threads.clear()
    steps_before = server.engine.stats.num_steps
    with pytest.raises(openai.BadRequestError) as info:  # under the byte bound: tokenized, then refused
        client.completions.create(model=NAME, prompt="hello world " * 2000, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded" and "max_model_len is 1024" in \
        info.value.body["message"]
    assert server.engine.stats.num_steps == steps_before  # the engine did not see it
    client.chat.completions.create(model=NAME, messages=HI, max_tokens=1)
    client.completions.create(model=NAME, prompt="Hello", max_tokens=1)
    assert len(tokenizer.threads) == 3 and all(t.startswith("nanoengine-tokenizer") for t in tokenizer.threads), \
        tokenizer.threads


def test_the_body_limit_is_configurable(strict):
    body = json.dumps({"model": NAME, "prompt": "x" * 5000, "max_tokens": 1}).encode()
    status, _, payload = request(strict, "POST", "/v1/completions", body)
    assert status == 413 and payload["error"]["code"] == "request_too_large" and "4096 bytes" in \
        payload["error"]["message"]
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    # A declared size far over the limit is refused before a byte of the body is read.
    with socket.create_connection(address(strict), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\nConnection: close\r\n\r\n")
        assert read_until_closed(sock, time.monotonic() + 10).startswith(b"HTTP/1.1 413")
    status, _, payload = request(strict, "POST", "/v1/completions",
                                 json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1}).encode())
    assert status == 200 and payload["usage"]["completion_tokens"] == 1


# ---------------------------------------------------------- 2. integral floats
def test_integral_floats_are_integers(client):
    got = client.post("/completions", cast_to=dict, body={"model": NAME, "prompt": [331.0, 20.0], "max_tokens": 2.0,
                                                          "n": 1.0, "logprobs": 2.0, "seed": 7.0, "top_k": 5.0})
    assert got["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(got["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
    chat = client.post("/chat/completions", cast_to=dict, body={"model": NAME, "messages": HI, "max_tokens": 1.0,
                                                                "logprobs": True, "top_logprobs": 3.0})
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    for field, value in (("max_tokens", 1.5), ("n", 2.5), ("prompt", [331.5])):
        with pytest.raises(openai.BadRequestError) as info:
            client.post("/completions", cast_to=dict, body={"model": NAME, "prompt": "x", field: value})
        assert info.value.body["param"] == "prompt" if field == "prompt" else field
        if field != "prompt":
            assert "must be an integer (a whole number such as 4 or 4.0), got" in info.value.body["message"]


# ----------------------------------------------------------- 3. neutral values
def test_neutral_values_of_unimplemented_fields_are_served(client):
    plain = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4, temperature=0)
    neutral = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4, temperature=0,
                                             response_format={"type": "text"}, tool_choice="none", tools=[],
                                             parallel_tool_calls=False, store=False, metadata={"run": "7"},
                                             service_tier="auto", modalities=["text"])
    assert neutral.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "required"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("store", True),
    ("service_tier", "flex"),
])
def test_values_that_would_change_the_result_are_refused(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=HI, max_tokens=1, **{field: value})
    error = info.value.body
    assert error["param"] == field and error["code"] == "unsupported" and "allowed:" in error["message"], error


# ---------------------------------------------------------------- 4. the schema
def test_openapi_describes_the_bodies_and_the_errors(server):
    status, _, schema = request(server, "GET", "/openapi.json")
    assert status == 200
    components = schema["components"]["schemas"]

    def resolve(node):
        return components[node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node

    for path, model, required in (("/v1/completions", "CompletionRequest", "prompt"),
                                  ("/v1/chat/completions", "ChatCompletionRequest", "messages")):
        post = schema["paths"][path]["post"]
        body = resolve(post["requestBody"]["content"]["application/json"]["schema"])
        assert body is components[model] and required in body["required"]
        assert body["additionalProperties"] is False  # unknown fields are refused, and the schema says so
        assert {"max_tokens", "n", "temperature", "stream", "stop"} <= set(body["properties"])
        for status_code in ("400", "401", "408", "413", "429"):
            error = resolve(post["responses"][status_code]["content"]["application/json"]["schema"])
            assert set(resolve(error["properties"]["error"])["properties"]) == {"message", "type", "param", "code"}
        assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    chat = components["ChatCompletionRequest"]["properties"]
    assert {"integer"} <= {t.get("type") for t in chat["max_tokens"]["anyOf"]}
    assert resolve(chat["response_format"]["anyOf"][0])["properties"]["type"]["enum"] == ["text", "json_object",
                                                                                          "json_schema"]
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    text = json.dumps(schema)
    for name in set(part.split('"')[0] for part in text.split('"#/components/schemas/')[1:]):
        assert name in components, name  # every reference resolves


# -------------------------------------------------------------- 5. chat stream
@pytest.mark.slow
def test_the_role_chunk_goes_out_with_the_first_token(build_tiny_llm):
    engine = build_tiny_llm(CONFIG).engine
    gate, original_step = threading.Event(), engine.step

    def gated_step():  # no step, so no token, until the test opens the gate
        gate.wait(TIMEOUT)
        return original_step()

    engine.step = gated_step
    body = json.dumps({"model": NAME, "messages": HI, "max_tokens": 3, "stream": True}).encode()
    with serve_in_background(engine, NAME) as running, socket.create_connection(address(running), timeout=0.2) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        early = read_until_closed(sock, time.monotonic() + 1.0)  # the prefill has not run
        assert b"data:" not in early, early
        gate.set()
        rest = early + read_until_closed(sock, time.monotonic() + TIMEOUT)
    events = [json.loads(event) for event in re.findall(rb"data: (\{.*?\})\n\n", rest)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "content" in events[1]["choices"][0]["delta"] and b"data: [DONE]" in rest


def test_streamed_chat_chunks_carry_the_stop_reason(client, offline):
    text = offline.chat(HI, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    stop = text[4:6]
    kwargs = dict(model=NAME, messages=HI, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kwargs).model_dump()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] == stop
    chunks = [c.model_dump() for c in client.chat.completions.create(**kwargs, stream=True)]
    assert all("stop_reason" in c["choices"][0] for c in chunks)
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == plain["message"]["content"]


# -------------------------------------------------------------- 6. the API key
def test_the_api_key_protects_v1_only(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME, api_key="s3cret") as running:
        def status(method: str, path: str, key: str | None = None) -> int:
            return request(running, method, path, headers={"Authorization": f"Bearer {key}"} if key else {})[0]

        assert [status("GET", p) for p in ("/health", "/metrics", "/openapi.json")] == [200] * 3
        assert [status("GET", p) for p in ("/v1/models", f"/v1/models/{NAME}", "/v1/nothing")] == [401] * 3
        assert status("POST", "/v1/completions", "wrong") == 401
        assert status("GET", "/v1/models", "s3cret") == 200
        assert status("OPTIONS", "/v1/models") != 401  # a CORS preflight carries no credentials


# ----------------------------------------------- 7. disconnects and slow clients
@pytest.mark.slow
def test_a_client_that_disconnects_mid_upload_leaves_no_traceback(server, client):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "nanoengine.serve")]
    for log in loggers:
        log.addHandler(handler)
    try:
        with socket.create_connection(address(server), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 10000\r\n\r\n" + b'{"prompt": "' + b"x" * 100)
            time.sleep(0.3)  # the handler is reading the body
        time.sleep(0.5)  # the server notices the connection is gone
        assert client.completions.create(model=NAME, prompt="still here", max_tokens=1).usage.completion_tokens == 1
    finally:
        for log in loggers:
            log.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


@pytest.mark.slow
def test_headers_sent_slowly_are_timed_out(strict):
    start = time.monotonic()
    with socket.create_connection(address(strict), timeout=0.1) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        # A header line every 0.1 s: the head is never complete. 10 s only guards against a hang: a 408 read
        # before then is the server's own 0.5 s limit (its message names it), however busy the machine.
        while time.monotonic() - start < 10:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                sock.sendall(b"X-Slow: 1\r\n")
                continue
            except ConnectionResetError:
                break
            answer += chunk
            if not chunk:
                break
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer, answer


@pytest.mark.slow
def test_a_body_sent_slowly_is_timed_out(strict):
    start = time.monotonic()
    with socket.create_connection(address(strict), timeout=0.1) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": ')
        answer = read_until_closed(sock, start + 10)  # only a hang guard: the 408 is the server's 0.5 s limit
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
    assert b"did not arrive within 0.5 s" in answer, answer


# ------------------------------------ 8. models/{id}, fingerprint, cached tokens
def test_models_retrieve_and_an_unknown_id_is_a_404(client):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and "'gpt-4' does not exist" in info.value.body["message"]


def test_system_fingerprint_and_cached_prompt_tokens(server, client):
    request(server, "POST", "/reset_prefix_cache", b"")
    prompt = list(range(1, 50))  # 49 tokens: three full blocks of 16 can be cached
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < 49 and cached % 16 == 0, cached
    streamed = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = client.chat.completions.create(model=NAME, messages=HI, max_tokens=1)
    fingerprints = {first.system_fingerprint, second.system_fingerprint, chat.system_fingerprint,
                    *(c.system_fingerprint for c in streamed)}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")


@pytest.mark.slow
def test_the_length_bound_is_given_only_where_it_holds(tokenizer_threads):
    """``_too_long`` may refuse a text untokenized only if no token stands for more bytes
    than its vocabulary string: checked on the real tokenizer, and refused for tokenizers
    that drop or fuse text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nanoengine.entrypoints.openai.serving import _max_token_bytes, _too_long

    tokenizer = tokenizer_threads.tokenizer
    bound = _max_token_bytes(tokenizer)
    for text in ("word " * 300, " " * 5000, "é" * 999, "<|im_start|>" * 300, "0123456789" * 100):
        assert len(text.encode()) / len(tokenizer.encode(text, add_special_tokens=False)) <= bound, text[:20]
    assert _too_long("word " * 400_000, bound, 1024) > 1024 and _too_long("word " * 100, bound, 1024) is None

    def bpe(pre, **kwargs):
        backend = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "<unk>": 3}, [("a", "b")], **kwargs))
        backend.pre_tokenizer = pre
        return PreTrainedTokenizerFast(tokenizer_object=backend)

    assert _max_token_bytes(bpe(pre_tokenizers.ByteLevel())) == 5
    assert _max_token_bytes(bpe(pre_tokenizers.Metaspace(), byte_fallback=True)) == 5
    assert _max_token_bytes(bpe(pre_tokenizers.Whitespace())) is None  # whitespace is dropped
    assert _max_token_bytes(bpe(pre_tokenizers.Metaspace(), unk_token="<unk>", fuse_unk=True)) is None
    assert _max_token_bytes(bpe(pre_tokenizers.Metaspace())) is None  # unknown characters are dropped
    assert _max_token_bytes(None) is None
