"""No single request can stop the server (chapter 12's promise to a hostile client).

The issue's reproduction (``top_k`` = 2**63 through either endpoint, streamed or not, or
through the ``openai`` client's ``extra_body``) is refused with a 400 naming the field, and
the server stays healthy. A bug that one request's data still reaches inside a step (one
is planted here) answers that request with a 500, or ends its stream with an error event,
while the request beside it completes with the tokens it has alone. The command-line
server's exit when the engine itself stops is tested in ``test_serve_cli``.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from nanoengine import SamplingParams
from nanoengine.entrypoints.openai.api_server import serve_in_background
from nanoengine.layers.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest
CONFIG = dict(device="cpu", max_model_len=256, num_kv_blocks=128, block_size=16, max_num_seqs=8)
NAME = "tiny-faults"
TIMEOUT = 60
HUGE_TOP_K = 9223372036854775808  # 2**63, the issue's value
MARKED_TOP_K = 7  # the planted bug raises on requests with this top_k


@pytest.fixture(scope="module")
def server(build_tiny_llm):
    with serve_in_background(build_tiny_llm(CONFIG).engine, NAME) as running:
        yield running


def post(server, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            text = response.read().decode()
            return response.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def healthy(server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT) as response:
        return response.status == 200


def free_blocks_back(server) -> bool:
    return server.engine.call(lambda e: not e.has_unfinished_requests()
                              and e.block_manager.num_free_blocks == e.runner.num_blocks).result(TIMEOUT)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True}),
], ids=["completions", "completions stream", "chat", "chat stream"])
@pytest.mark.parametrize("top_k", [HUGE_TOP_K, 10**30, 49153], ids=["2**63", "10**30", "vocabulary + 1"])
def test_the_issues_top_k_is_a_400_and_the_server_serves_on(server, path, body, top_k):
    status, answer = post(server, path, {"model": NAME, **body, "top_k": top_k})
    assert status == 400 and answer["error"]["param"] == "top_k", answer
    assert "top_k" in answer["error"]["message"]
    assert healthy(server)
    status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 3,
                                                       "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_the_issues_top_k_through_the_openai_client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=TIMEOUT) as client:
        with pytest.raises(openai.BadRequestError, match="top_k"):
            client.completions.create(model=NAME, prompt="Hello", max_tokens=4, extra_body={"top_k": HUGE_TOP_K})
        got = client.completions.create(model=NAME, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 3


@pytest.fixture
def planted_bug(monkeypatch):
    """A sampler that raises on requests with ``top_k == MARKED_TOP_K`` (this process's engine thread uses it)."""
    real = Sampler._candidate_probs

    def planted(logits, params):
        if any(p.top_k == MARKED_TOP_K for p in params):
            raise RuntimeError("a planted bug")
        return real(logits, params)

    monkeypatch.setattr(Sampler, "_candidate_probs", staticmethod(planted))


def test_a_request_that_trips_a_bug_gets_a_500_and_its_neighbour_its_tokens(server, offline, planted_bug):
    prompt = [11, 12, 13, 14]
    expected = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=TIMEOUT) as client:
        # The neighbour streams while the faulty request runs beside it in the same steps.
        neighbour = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
        first = next(iter(neighbour))
        with pytest.raises(openai.InternalServerError, match="a planted bug"):
            client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1.0,
                                      extra_body={"top_k": MARKED_TOP_K})
        text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in neighbour if chunk.choices)
        assert text == expected.text
        with pytest.raises(openai.APIError, match="a planted bug"):  # streamed: an error event ends the stream
            for _ in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=8, stream=True, extra_body={"top_k": MARKED_TOP_K}):
                pass
    assert healthy(server) and free_blocks_back(server)
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT).read().decode()
    assert 'finished_reason="error"} 2' in metrics.replace(f'model_name="{NAME}",', "")
