"""Exercise checks of chapter 12 (Serving): usage in a stream, the context limit, the queue limit.

Each check sends real HTTP requests with the official ``openai`` client and judges what the
server answered (a usage record, a 200 or a 400, how many requests got a 429), never the
learner's code and never a timing:

* ``check_stream_usage`` (12.1): ``stream_options`` that make a streamed completion end with
  a chunk carrying the token counts, which must equal the tokens streamed (the chapter's
  server, the real model);
* ``check_max_tokens`` (12.2): the largest ``max_tokens`` the server accepts for
  ``CONTEXT_PROMPT``: that value is accepted, one more is refused with 400 (the chapter's
  server; an accepted request is closed after its first chunk, which aborts it);
* ``check_max_queue`` (12.3): the ``max_queue`` under which, with one request running on a
  server that runs one sequence at a time, ``QUEUE_ARRIVALS`` more arrive and exactly
  ``QUEUE_WAIT`` of them wait while the others are told 429 (a tiny random engine:
  mechanics only).

``overload`` is the experiment behind 12.3, kept here so the check and the worked solution
(``notebooks/solutions/12_serving.ipynb``) run the same thing.
"""

from __future__ import annotations

import threading
import time

from widgets.exercises import CheckResult, todo, verdict, whole

CONTEXT_PROMPT = "In one paragraph, explain why the sky is blue."  # exercise 12.2
USAGE_MAX_TOKENS = 8  # exercise 12.1
QUEUE_ARRIVALS, QUEUE_WAIT = 6, 2  # exercise 12.3: 6 arrive while one runs; 2 may wait
TIMEOUT = 120  # seconds for any one request


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def check_stream_usage(server, stream_options) -> CheckResult:
    """12.1: stream a completion with the learner's ``stream_options``; right when the last
    chunk carries ``usage`` and its completion tokens equal the tokens that were streamed."""
    name = "12.1"
    if todo(stream_options):
        return verdict(name, False, "", "set stream_options to the dictionary that asks for the token counts.")
    if not isinstance(stream_options, dict):
        return verdict(name, False, "", f"stream_options is a dictionary (OpenAI's field), got "
                       f"{type(stream_options).__name__}.")
    import openai

    with _client(server) as client:
        try:
            chunks = list(client.completions.create(
                model=server.model_name, prompt="The three primary colours are", max_tokens=USAGE_MAX_TOKENS,
                temperature=0, stream=True, stream_options=stream_options, extra_body={"ignore_eos": True}))
        except openai.BadRequestError as exc:
            return verdict(name, False, "", f"the server refused it (400): {exc.body['message']}")
    usage = chunks[-1].usage if chunks else None
    streamed = sum(1 for c in chunks if c.choices and c.choices[0].text)
    if usage is None:
        return verdict(name, False, "", f"{len(chunks)} chunks arrived and none carried usage: look for the "
                       "option that includes it.")
    right = usage.completion_tokens == USAGE_MAX_TOKENS and chunks[-1].choices == [] and streamed >= 1
    return verdict(name, right,
                   f"the last chunk has no choices and carries usage: {usage.prompt_tokens} prompt + "
                   f"{usage.completion_tokens} completion tokens; a client can bill or budget a stream without "
                   "counting tokens itself.",
                   f"usage arrived but says {usage.completion_tokens} completion tokens for {USAGE_MAX_TOKENS} asked.")


def _accepted(server, max_tokens: int) -> tuple[bool, str]:
    """(whether the server accepted ``CONTEXT_PROMPT`` with ``max_tokens``, its message if not).
    An accepted request is streamed, and closed after its first chunk: the server aborts it."""
    import openai

    with _client(server) as client:
        try:
            stream = client.completions.create(model=server.model_name, prompt=CONTEXT_PROMPT, max_tokens=max_tokens,
                                               temperature=0, stream=True)
        except openai.BadRequestError as exc:
            return False, exc.body["message"]
        with stream:
            next(iter(stream), None)
    return True, ""


def check_max_tokens(server, max_tokens) -> CheckResult:
    """12.2: the largest ``max_tokens`` the server accepts for ``CONTEXT_PROMPT``."""
    name = "12.2"
    if todo(max_tokens):
        return verdict(name, False, "", "set max_tokens to a whole number of tokens.")
    value = whole(max_tokens, 1, 10**7)
    if value is None:
        return verdict(name, False, "", "max_tokens is a whole number of tokens, at least 1.")
    ok, message = _accepted(server, value)
    if not ok:
        return verdict(name, False, "", f"the server refused max_tokens={value} with 400: {message}")
    more_ok, more_message = _accepted(server, value + 1)
    return verdict(name, not more_ok,
                   f"max_tokens={value} was accepted and {value + 1} refused: \"{more_message}\". Prompt and "
                   "output must fit the context window together, so the server refuses up front what the engine "
                   "would otherwise cut short.",
                   f"max_tokens={value} was accepted, and so is {value + 1}: find the largest the server accepts.")


def overload(max_queue: int) -> tuple[int, int]:
    """(requests that waited, requests refused with 429) when ``QUEUE_ARRIVALS`` requests
    arrive at once at a server with ``max_queue`` that runs one sequence at a time, while one
    long request runs. A tiny random engine (mechanics only); every stream is closed after."""
    import openai

    from nanoengine.entrypoints.openai.api_server import serve_in_background
    from widgets._common import single_thread, tiny_engine

    # The running request could take 8,000 tokens (seconds, even on the tiny model): it is still
    # running when the arrivals come, and is aborted (closed) once they have been answered.
    engine = tiny_engine(num_kv_blocks=520, block_size=16, max_model_len=8192, max_num_seqs=1)
    results: list = []
    with single_thread(), serve_in_background(engine, "tiny", max_queue=max_queue) as server, \
            _client(server) as client:
        running = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=8000, stream=True,
                                            extra_body={"ignore_eos": True})
        with running:
            deadline = time.monotonic() + TIMEOUT
            while server.engine.stats.num_running < 1:  # published by the engine thread after each step
                if time.monotonic() > deadline:
                    raise RuntimeError("the long request did not start")
                time.sleep(0.01)
            # it holds the only seat now: everything that arrives waits or is refused

            def arrive(i: int) -> None:
                try:
                    results.append(client.completions.create(model="tiny", prompt=[4, 5, i], max_tokens=2,
                                                             stream=True))
                except openai.RateLimitError as exc:
                    results.append(exc)

            threads = [threading.Thread(target=arrive, args=(i,)) for i in range(QUEUE_ARRIVALS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
        for r in results:
            if isinstance(r, openai.Stream):
                r.close()
    refused = sum(isinstance(r, openai.RateLimitError) for r in results)
    return len(results) - refused, refused


def check_max_queue(max_queue) -> CheckResult:
    """12.3: the ``max_queue`` under which exactly ``QUEUE_WAIT`` of the arrivals wait."""
    name = "12.3"
    if todo(max_queue):
        return verdict(name, False, "", "set max_queue to a whole number of waiting requests.")
    value = whole(max_queue, 1, 10_000)
    if value is None:
        return verdict(name, False, "", "max_queue is a whole number of requests, at least 1.")
    waited, refused = overload(value)
    return verdict(name, waited == QUEUE_WAIT,
                   f"{waited} requests waited and {refused} were told 429 (with Retry-After): the server sheds "
                   "load it could only queue, and a client can back off and retry instead of timing out.",
                   f"with max_queue={value}, {waited} waited and {refused} got 429; {QUEUE_WAIT} should wait. "
                   "Only requests that cannot start count: the running one holds the single seat.")
