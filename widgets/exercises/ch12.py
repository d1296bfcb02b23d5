"""Exercise checks of chapter 12 (Serving): usage of a stream, the context limit, the queue limit.

Each check sends real HTTP requests with the official ``openai`` client and judges what the
server answered (a usage record, a 200 or a 400, how many requests got a 429), never the
learner's code and never a timing:

* ``check_stream_usage`` (12.1): the learner predicts the ``usage`` record that ends a stream
  of ``USAGE_PROMPTS`` (two token-id prompts) with ``n=USAGE_N`` completions each; the check
  streams that request with ``stream_options={"include_usage": True}`` and compares;
* ``check_max_tokens`` (12.2): the largest ``max_tokens`` the server accepts for
  ``CONTEXT_PROMPT``: that value is accepted, one more is refused with 400 (the chapter's
  server; an accepted request is closed after its first chunk, which aborts it);
* ``check_max_queue`` (12.3): the smallest ``max_queue`` under which, while one long request
  holds the only seat, at most one of the ``QUEUE_SIZES`` arrivals (requests of several
  prompts each, sent one after another) is refused, and none with 400 (a tiny random
  engine: mechanics only).

The checks of 12.1 and 12.2 need the chapter's server. The chapter's last cell stops it, so
after "Run All" a check finds no server listening: it then serves the same engine from a
server of its own for the duration of the check (``_serving``) instead of failing with a
connection error.

``overload`` is the experiment behind 12.3, kept here so the check and the worked solution
(``notebooks/solutions/12_serving.ipynb``) run the same thing.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request

from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole

CONTEXT_PROMPT = "In one paragraph, explain why the sky is blue."  # exercise 12.2
USAGE_PROMPTS = [[791, 6209, 315, 9822, 374, 12366, 13, 578, 6864],  # exercise 12.1: token ids,
                 [40, 1093, 311, 3137, 264, 2875, 3446, 922, 264, 8415, 889, 374, 3094, 13]]  # ids < 49152
USAGE_N = 2  # completions per prompt (12.1)
USAGE_MAX_TOKENS = 6  # tokens per completion (12.1), EOS ignored
QUEUE_SIZES = [2, 1, 3, 1, 2]  # exercise 12.3: prompts per arriving request, in arrival order
TIMEOUT = 120  # seconds for any one request


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def _listening(server) -> bool:
    """Whether ``server`` answers ``GET /health`` (a stopped one refuses the connection)."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def _serving(server):
    """The chapter's server if it is still listening; otherwise (its last cell stopped it) a
    new server on the same engine, stopped again when the check is done, which hands the
    engine back to the notebook."""
    if _listening(server):
        yield server
        return
    from nanoengine.entrypoints.openai.api_server import serve_in_background

    with serve_in_background(server.engine.engine, server.model_name) as again:
        yield again


def predicted_usage(prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    """The ``usage`` of one request over ``prompts`` with ``n`` completions of exactly
    ``max_tokens`` tokens each (EOS ignored): each prompt is counted once, however many
    completions share it (they share its KV blocks, chapter 4), and every completion's tokens
    count."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = len(prompts) * n * max_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def streamed_usage(server) -> tuple[dict | None, int]:
    """(the usage chunk's counts, the number of chunks with text) for exercise 12.1's request,
    streamed with ``include_usage``."""
    with _client(server) as client:
        chunks = list(client.completions.create(
            model=server.model_name, prompt=USAGE_PROMPTS, n=USAGE_N, max_tokens=USAGE_MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage if chunks else None
    texts = sum(1 for c in chunks if c.choices and c.choices[0].text)
    if usage is None:
        return None, texts
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}, texts


def check_stream_usage(server, usage) -> CheckResult:
    """12.1: the learner's ``usage`` dictionary against the one the server streams last."""
    name = "12.1"
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if todo(usage) or (isinstance(usage, dict) and any(todo(usage.get(k)) for k in keys)):
        return verdict(name, False, "", tr("fill in the three counts of usage (whole numbers of tokens)."))
    if not isinstance(usage, dict) or set(usage) != set(keys):
        return verdict(name, False, "", tr("usage is a dictionary with exactly the keys {keys}.",
                                           keys=', '.join(keys)))
    counts = {k: whole(usage[k], 0, 10**7) for k in keys}
    if any(v is None for v in counts.values()):
        return verdict(name, False, "", tr("each count in usage is a whole number of tokens, 0 or more."))
    if counts["total_tokens"] != counts["prompt_tokens"] + counts["completion_tokens"]:
        return verdict(name, False, "", tr("total_tokens is the prompt's tokens plus the completions' tokens: your "
                                           "three numbers do not add up."))
    with _serving(server) as live:
        served, _ = streamed_usage(live)
    if served is None:
        return verdict(name, False, "", tr("the stream ended without a usage chunk (is the server an old one?)."))
    wrong = [k for k in keys if counts[k] != served[k]]
    if not wrong:
        return verdict(name, True, tr("the stream's last chunk says {prompt} prompt + {completion} completion = "
                                      "{total} tokens: every prompt counted once, whatever its {n} completions "
                                      "share, and every completion's {max_tokens} tokens counted.",
                                      prompt=served['prompt_tokens'], completion=served['completion_tokens'],
                                      total=served['total_tokens'], n=USAGE_N, max_tokens=USAGE_MAX_TOKENS), "")
    hints = {"prompt_tokens": tr("prompt_tokens is not what the server counted: how many times is a prompt "
                                 "counted when several completions share it?"),
             "completion_tokens": tr("completion_tokens is not what the server counted: count the completions "
                                     "the request makes (how many prompts, how many each).")}
    return verdict(name, False, "", " ".join(hints[k] for k in wrong if k in hints))


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
        return verdict(name, False, "", tr("set max_tokens to a whole number of tokens."))
    value = whole(max_tokens, 1, 10**7)
    if value is None:
        return verdict(name, False, "", tr("max_tokens is a whole number of tokens, at least 1."))
    with _serving(server) as live:
        ok, message = _accepted(live, value)
        if not ok:
            return verdict(name, False, "", tr("the server refused max_tokens={value} with 400: {message}",
                                               value=value, message=message))
        more_ok, more_message = _accepted(live, value + 1)
    return verdict(name, not more_ok,
                   tr("max_tokens={value} was accepted and {more} refused: \"{message}\". Prompt and "
                      "output must fit the context window together, so the server refuses up front what the engine "
                      "would otherwise cut short.", value=value, more=value + 1, message=more_message),
                   tr("max_tokens={value} was accepted, and so is {more}: find the largest the server accepts.",
                      value=value, more=value + 1))


def admitted_by_rule(max_queue: int, sizes: list[int] = QUEUE_SIZES) -> list[str]:
    """What the server's rule answers each arrival, in order, when nothing is admitted in
    between: "400" for a request with more prompts than may ever wait, "429" for one that would
    take the waiting count past ``max_queue`` (all of its prompts or none), "wait" otherwise."""
    answers, waiting = [], 0
    for k in sizes:
        if k > max_queue:
            answers.append("400")
        elif waiting + k > max_queue:
            answers.append("429")
        else:
            waiting += k
            answers.append("wait")
    return answers


def overload(max_queue: int, sizes: list[int] = QUEUE_SIZES) -> list[str]:
    """The server's answer to each of ``sizes``'s requests (``len(sizes[i])`` token-id prompts
    each), sent one after another while one long request holds the only seat of a server with
    ``max_queue`` that runs one sequence at a time: "wait", "429" or "400". A tiny random engine
    (mechanics only); every stream is closed afterwards, which aborts its requests."""
    import openai

    from nanoengine.entrypoints.openai.api_server import serve_in_background
    from widgets._common import single_thread, tiny_engine

    # The running request could take 8,000 tokens (seconds, even on the tiny model): it is still
    # running when the arrivals come, and is aborted (closed) once they have been answered.
    engine = tiny_engine(num_kv_blocks=520, block_size=16, max_model_len=8192, max_num_seqs=1)
    answers: list[str] = []
    streams = []
    with single_thread(), serve_in_background(engine, "tiny", max_queue=max_queue) as server, \
            _client(server) as client:
        running = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=8000, stream=True,
                                            extra_body={"ignore_eos": True})
        with running:
            deadline = time.monotonic() + TIMEOUT
            while server.engine.stats.num_running < 1:  # published by the engine thread after each step
                if time.monotonic() > deadline:
                    raise RuntimeError(tr("the long request did not start"))
                time.sleep(0.01)
            # it holds the only seat now: everything that arrives waits or is refused
            try:
                for i, k in enumerate(sizes):  # one after another: the order is the rule's order
                    try:
                        streams.append(client.completions.create(
                            model="tiny", prompt=[[4, 5, i, j] for j in range(k)], max_tokens=2, stream=True))
                        answers.append("wait")
                    except openai.RateLimitError:
                        answers.append("429")
                    except openai.BadRequestError:
                        answers.append("400")
            finally:
                for stream in streams:
                    stream.close()
    return answers


def check_max_queue(max_queue) -> CheckResult:
    """12.3: the smallest ``max_queue`` under which at most one arrival is refused (429), none
    with 400."""
    name = "12.3"
    if todo(max_queue):
        return verdict(name, False, "", tr("set max_queue to a whole number of waiting requests."))
    value = whole(max_queue, 1, 10_000)
    if value is None:
        return verdict(name, False, "", tr("max_queue is a whole number of waiting prompts, at least 1."))
    answers = overload(value)
    refused, bad = answers.count("429"), answers.count("400")
    said = ", ".join((tr("{k} prompts: {answer}", k=k, answer=_answer(a)) if k > 1 else
                      tr("{k} prompt: {answer}", k=k, answer=_answer(a))) for k, a in zip(QUEUE_SIZES, answers))
    if bad:
        return verdict(name, False, "", tr("with max_queue={value} the server answered ({said}): a request with "
                                           "more prompts than may ever wait is refused with 400, since retrying it "
                                           "could never succeed.", value=value, said=said))
    if refused > 1:
        return verdict(name, False, "", tr("with max_queue={value} the server answered ({said}): {refused} refused. "
                                           "Count the prompts waiting after each arrival: a request is admitted "
                                           "whole or not at all.", value=value, said=said, refused=refused))
    smaller = admitted_by_rule(value - 1) if value > 1 else None  # the rule, which overload is tested to follow
    if smaller is not None and smaller.count("429") <= 1 and "400" not in smaller:
        return verdict(name, False, "", tr("with max_queue={value} at most one request is refused, but a smaller "
                                           "limit does that too: find the smallest (a smaller queue is a shorter "
                                           "wait for the ones admitted).", value=value))
    return verdict(name, True, tr("the server answered ({said}). The refused request waits for nothing and can "
                                  "retry or go to another replica, while the waiting ones start as seats free up; "
                                  "one prompt fewer of room and a second request would be refused.", said=said), "")


def _answer(answer: str) -> str:
    """One of ``overload``'s answers as a learner reads it: "wait" in the notebook's language, a
    status code as it is."""
    return tr("wait") if answer == "wait" else answer


# ------------------------------------------------------------------ the chapter's readings
# Each turns the numbers a cell measured into the sentence it prints, so the sentence says the
# opposite when the numbers do (tests/course/test_exercises_ch12.py feeds each both sides).
CLIMB = 1.5  # TTFT p50 at the highest rate over the lowest: at or above this, "climbed"


def read_ttft_climb(rows: list[dict], label: str) -> str:
    """Section 6: did TTFT p50 climb from the lowest offered rate to the highest on this curve? It
    climbs once the rate passes what that path serves (its capacity) and requests queue; where it
    stays level, the rates never passed that path's capacity."""
    lo, hi = rows[0], rows[-1]
    ratio = hi["ttft_ms"]["p50"] / lo["ttft_ms"]["p50"]
    fields = dict(label=label, lo=lo['ttft_ms']['p50'], hi=hi['ttft_ms']['p50'], lo_rate=lo['rate_requests_per_s'],
                  hi_rate=hi['rate_requests_per_s'], ratio=ratio)
    if ratio >= CLIMB:
        return tr("{label}: TTFT p50 {lo:.0f} -> {hi:.0f} ms from {lo_rate:g} to {hi_rate:g} req/s ({ratio:.1f}x): "
                  "it climbed, so the highest rates passed what this path serves and requests queued", **fields)
    return tr("{label}: TTFT p50 {lo:.0f} -> {hi:.0f} ms from {lo_rate:g} to {hi_rate:g} req/s ({ratio:.1f}x): "
              "it stayed about level, so even the highest rate stayed within what this path serves", **fields)


def read_gap_trend(gaps_ms: list[float], hops_ms: float) -> str:
    """Section 6: how the server-minus-in-process TTFT gap moved with the rate (two lowest rates
    against two highest; a change within the measured hops counts as level)."""
    low, high = sum(gaps_ms[:2]) / len(gaps_ms[:2]), sum(gaps_ms[-2:]) / len(gaps_ms[-2:])
    if high > low + hops_ms:
        return tr("the gap widened with the rate (mean {low:+.0f} ms at the two lowest rates, {high:+.0f} ms at the "
                  "two highest)", low=low, high=high)
    if high < low - hops_ms:
        return tr("the gap narrowed with the rate (mean {low:+.0f} ms at the two lowest rates, {high:+.0f} ms at the "
                  "two highest)", low=low, high=high)
    return tr("the gap stayed about level with the rate (mean {low:+.0f} ms at the two lowest rates, {high:+.0f} ms "
              "at the two highest)", low=low, high=high)


def read_median_gap(median_gap_ms: float, hops_ms: float) -> str:
    """Section 6: the median gap against the HTTP + engine-thread hops measured in section 3."""
    if median_gap_ms > 2 * hops_ms:
        said = tr("{times:.0f}x the measured HTTP + engine-thread hops: most of it is something "
                  "else; in this notebook, the client's work on the same cores and the engine thread's second OpenMP "
                  "team (section 3), which a server in a process of its own does not have (the next cell)",
                  times=median_gap_ms / hops_ms)
    elif median_gap_ms >= -2 * hops_ms:
        said = tr("within twice the measured HTTP + engine-thread hops: those hops account for it")
    else:
        said = tr("negative: the server's requests got their first token sooner in this run, which no serving cost "
                  "explains; with one run per rate, this machine's noise is larger than what serving adds")
    return tr("the median gap, {gap:+.0f} ms, is {said}", gap=median_gap_ms, said=said)


def read_slow_reader(waiting: int) -> str:
    """Section 7: chunks already waiting after a client's pause mean the engine did not wait for it."""
    if waiting:
        return tr("the engine did not wait for the reader")
    return tr("none had piled up, so this run shows nothing either way (was the pause shorter than a step?)")
