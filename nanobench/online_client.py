"""The online benchmark through HTTP: ``bench --online-rates R --server URL`` (chapters 11, 12).

``run_online`` (``nanobench/benchmark.py``) steps the engine in this process and reads its
per-token timestamps. This module sends the *same* workload (the same random token-id
prompts, the same output lengths, the same seeded Poisson arrivals, greedy, EOS ignored)
to any OpenAI-compatible server instead, this project's (``python -m nanoengine serve``) or
another (``vllm serve``), through the streaming completions API with the official
``openai`` client, and measures what a client sees:

* TTFT: from the request's scheduled arrival to the first streamed chunk with text (so
  HTTP, JSON, the server's queue and its first step all count);
* inter-token latency: the gaps between chunks with text (one token per chunk on this
  server and on vLLM);
* TPOT and end-to-end latency, from the same timestamps; the output token count is the
  server's ``usage`` (``stream_options.include_usage``).

Rows have ``run_online``'s shape (``latency_summary`` of ``RequestMetrics`` built from the
client's timestamps), plus the failed requests. EOS is ignored through vLLM's extra field
``ignore_eos``; a server that does not honour it may stop early, which the rows show as
fewer tokens than requested. Before each rate the client asks the server to forget its
prefix cache (``POST /reset_prefix_cache``, vLLM's development endpoint, which this
server has), so a rate is not served from the previous rate's prompts; the row records
whether that worked. The key for a server started with ``--api-key`` comes from
``$NANOENGINE_API_KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nanobench.benchmark import (describe_latency, environment, latency_summary, load_average,
                                 make_output_lens, make_workload, poisson_arrivals)
from nanoengine.outputs import RequestMetrics

VOCAB_LIMIT = 10000  # prompt token ids below this: valid in any vocabulary a server is likely to have
REQUEST_TIMEOUT_S = 600.0  # one request, first byte to last


@dataclass(frozen=True)
class StreamedRequest:
    """What the client saw of one streamed completion."""

    metrics: RequestMetrics | None  # None when the request failed
    num_output_tokens: int
    error: str | None = None


def api_root(url: str) -> str:
    """The server's root from its root or its ``/v1`` URL (``http://host:port``)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server must be a URL starting with http:// or https://, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def reset_prefix_cache(url: str, api_key: str | None = None) -> bool:
    """Ask the server to forget its prefix cache; False if it has no such endpoint."""
    request = urllib.request.Request(api_root(url) + "/reset_prefix_cache", method="POST",
                                     headers=_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=30):
            return True
    except urllib.error.HTTPError:
        return False


async def stream_one(client, model: str, prompt: list[int] | str, max_tokens: int, arrival: float,
                     extra_body: dict | None = None) -> StreamedRequest:
    """One greedy streamed completion; timestamps of every chunk that carried text."""
    import openai

    token_times: list[float] = []
    usage_tokens = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **(extra_body or {})})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                token_times.append(now)
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
    except (openai.APIError, OSError) as exc:
        return StreamedRequest(None, 0, f"{type(exc).__name__}: {exc}"[:300])
    finished = time.perf_counter()
    num_tokens = usage_tokens if usage_tokens is not None else len(token_times)
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=None,
                             first_token_time=token_times[0] if token_times else None, finished_time=finished,
                             num_output_tokens=num_tokens, token_times=tuple(token_times))
    return StreamedRequest(metrics, num_tokens)


async def run_server_once(url: str, model: str, prompts: list, output_lens: list[int], arrivals: list[float],
                          api_key: str | None = None) -> tuple[list[StreamedRequest], float]:
    """Send request i at ``arrivals[i]`` seconds from now; (results in input order, seconds
    from the first arrival to the last response's end)."""
    import openai

    if not len(prompts) == len(output_lens) == len(arrivals):
        raise ValueError(f"need one output length and arrival per prompt, got {len(prompts)} prompts, "
                         f"{len(output_lens)} lengths, {len(arrivals)} arrivals")
    client = openai.AsyncOpenAI(base_url=api_root(url) + "/v1", api_key=api_key or "none", max_retries=0,
                                timeout=REQUEST_TIMEOUT_S)
    start = time.perf_counter()

    async def at_arrival(i: int) -> StreamedRequest:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        return await stream_one(client, model, prompts[i], output_lens[i], start + arrivals[i])

    try:
        results = await asyncio.gather(*(at_arrival(i) for i in range(len(prompts))))
    finally:
        await client.close()
    return list(results), time.perf_counter() - start


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the server lists at ``GET /v1/models``."""
    request = urllib.request.Request(api_root(url) + "/v1/models", headers=_headers(api_key))
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.loads(response.read())["data"]
    if not models:
        raise ValueError(f"the server at {url} lists no model")
    return models[0]["id"]


def _run(coroutine):
    """Run a coroutine to the end, also from inside a running event loop (a notebook's):
    then on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def run_server_online(url: str, prompts: list, output_lens: list[int], rates: list[float], seed: int,
                      model: str | None = None, api_key: str | None = None) -> list[dict]:
    """``run_online``'s rows, measured through the server at ``url`` by a streaming client."""
    model = model or served_model(url, api_key)
    warm, _ = _run(run_server_once(url, model, [[1, 2, 3, 4, 5, 6, 7, 8]], [2], [0.0], api_key))
    if warm[0].error:
        raise RuntimeError(f"the warm-up request to {url} failed: {warm[0].error}")
    rows = []
    for rate in rates:
        reset = reset_prefix_cache(url, api_key)
        arrivals = poisson_arrivals(len(prompts), rate, seed)
        results, seconds = _run(run_server_once(url, model, prompts, output_lens, arrivals, api_key))
        ok = [r for r in results if r.error is None]
        received = sum(r.num_output_tokens for r in ok)
        rows.append({"rate_requests_per_s": rate, "seconds": seconds, "output_tokens_per_s": received / seconds,
                     "achieved_requests_per_s": len(ok) / seconds, "arrival_span_s": arrivals[-1],
                     "output_tokens_requested": sum(output_lens), "output_tokens_received": received,
                     "failed": len(results) - len(ok), "errors": [r.error for r in results if r.error][:5],
                     "prefix_cache_reset": reset, **latency_summary([r.metrics for r in ok])})
        print(f"server, online {rate:g} req/s: {received / seconds:.1f} tok/s, {len(results) - len(ok)} failed; "
              f"{describe_latency(rows[-1])}")
    return rows


def run_server_bench(args: argparse.Namespace) -> dict:
    """``bench --online-rates R ... --server URL``: the online rows through the server, in a
    results file (``results/bench-server-<date>.json`` unless ``--out``)."""
    api_key = os.environ.get("NANOENGINE_API_KEY")
    prompts = make_workload(args.num_requests, args.min_prompt, args.max_prompt, args.seed, vocab_limit=VOCAB_LIMIT)
    min_out = args.output_len if args.min_output_len is None else args.min_output_len
    output_lens = make_output_lens(args.num_requests, min_out, args.output_len, args.seed)
    model = served_model(args.server, api_key)
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} random ids, "
          f"{min_out}-{args.output_len} output tokens each, greedy, EOS ignored; server {args.server}, model {model}")
    load_at_start = load_average()
    rows = run_server_online(args.server, prompts, output_lens, args.online_rates, args.seed, model, api_key)
    results = {
        "server": {"url": args.server, "model": model, "client": "openai.AsyncOpenAI, streaming /v1/completions"},
        "online": rows,
        "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                     "output_len": args.output_len, "output_len_range": [min_out, args.output_len],
                     "output_tokens": sum(output_lens), "seed": args.seed, "greedy": True, "ignore_eos": True,
                     "prompt_tokens": sum(len(p) for p in prompts)},
        "load_average": {"start": load_at_start, "end": load_average()},
        "environment": environment(),  # the client's machine; the server may be elsewhere
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "format": "results/README.md",
    }
    out = Path(args.out) if args.out else Path("results") / f"bench-server-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results written to {out}")
    return results
