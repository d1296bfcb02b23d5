"""A soak: the engine's server under an hour of mixed load, its engine core's memory every minute.

A server runs for days, so its resident memory must level off. The engine core keeps the
memory its steps free (``nanoengine/backends/cpu_platform.py`` says why) and gives it back to
the kernel when it goes idle; this benchmark checks the two together over a long run, the
way a deployment runs the engine:

* the server is ``python -m nanoengine serve`` (``server_race.engine_server``), the engine
  core in a process of its own, on the default model;
* ``--clients`` clients (asyncio and ``httpx``, in this process) send requests one after
  another, each drawn at random (``draw_request``): completions and chat, streamed or not,
  prompts of 4 to 1,500 tokens as random token ids or as words, greedy or sampled (top-k,
  top-p, a seed or none), sometimes ``n`` of 2 or 3; some streams are closed after a few
  chunks (the client goes away, the server aborts the request) and some requests are bad
  on purpose (the server must answer 400);
* every minute the clients pause for the minute's last ``IDLE_GAP_S`` seconds, so that the
  engine goes idle now and then, as a real server's does (and trims, unless ``--no-trim``
  starts it with ``NANOENGINE_TRIM_WHEN_IDLE=0``);
* at the end of every minute's pause, the engine core's ``VmRSS`` and ``RssAnon``
  (``/proc/<pid>/status``) are read, with the highest ``VmRSS`` seen under load in that
  minute (read every second) and the requests done, aborted, refused and failed so far.

A request fails when it gets a status other than the one it asked for (200 for a good
request, 400 for a bad one; 499, the status of a request whose client left, counts as
aborted), when a stream ends with an error event or without ``[DONE]``, or when it times
out. The results file holds the samples and a summary: resident memory at minute 1, at the
end, its maximum, and its growth over the run's second half, which is within ``--bound-mib``
when the memory levelled off.

    python -m nanobench.soak --minutes 60 --out results/soak-cpu-<date>.json
    python -m nanobench.soak --minutes 60 --no-trim --out results/soak-cpu-<date>-no-trim.json
    python -m nanobench.soak --minutes 2 --out /tmp/soak.json      # a quick look
    python -m nanobench.soak --trim-cost 20     # what trimming costs the first request after idle

The price of trimming is paid by the first step after an idle spell, which faults the
pages it needs back in; ``--trim-cost`` measures it as that request's time to first token
through a trimming and a non-trimming server, taking turns. An engine in your own process
(``LLM``, the benchmark) never trims: only the server's engine core does.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nanobench.online_client import VOCAB_LIMIT
from nanobench.server_race import SERVED_MODEL_NAME, ServerProcess, engine_server
from nanobench.timing import in_turn

MINUTE_S = 60.0
IDLE_GAP_S = 15.0  # the last seconds of every minute: no new requests; those in flight end, the engine goes idle
SAMPLE_LEAD_S = 1.0  # a minute's sample is read this long before the next minute's load starts
THINK_S = 0.5  # a client's mean pause between two requests (exponential)
MAX_PROMPT_TOKENS = 1500
MAX_OUTPUT_TOKENS = 128
REQUEST_TIMEOUT_S = 300.0
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
BAD_SHARE = 0.05  # requests the server must refuse
ABORT_SHARE = 0.1  # streams the client closes after a few chunks
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile")
MiB = 1024 * 1024
WORDS = ("the engine reads every weight once per token and a server runs for days so its memory must level "
         "off while prompts of every length arrive and finish in batches of every size").split()


def process_memory(pid: int | str) -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``RssFile`` of process ``pid`` (or "self") in bytes, from
    ``/proc/<pid>/status`` (Linux)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
            found[name] = int(value.split()[0]) * 1024  # "123456 kB"
    return found


def engine_core_pid(server: ServerProcess) -> int:
    """The engine core's process: the server's child that ``multiprocessing`` spawned (not its
    resource tracker)."""
    import psutil

    cores = [child.pid for child in psutil.Process(server.process.pid).children()
             if any("spawn_main" in part for part in child.cmdline())]
    if len(cores) != 1:
        raise RuntimeError(f"expected one engine-core process under the server (pid {server.process.pid}), "
                           f"found {cores}")
    return cores[0]


# ----------------------------------------------------------------- the requests
@dataclass(frozen=True)
class SoakRequest:
    """One request of the mixed load: where it goes, its JSON body, and what the client does."""

    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict | str  # a str is sent as it is (not JSON: a bad request)
    bad: bool = False  # the server must answer 400
    abort_after_chunks: int | None = None  # close the stream after this many chunks

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream", False)


def prompt_length(rng: random.Random) -> int:
    """Log-uniform from 4 to ``MAX_PROMPT_TOKENS``: as many short prompts as long ones."""
    return int(math.exp(rng.uniform(math.log(4), math.log(MAX_PROMPT_TOKENS))))


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def draw_bad_request(rng: random.Random) -> SoakRequest:
    """A request the server must refuse with 400: a value out of range, a prompt longer than
    the model reads, a field it does not know, a body that is not JSON."""
    good = {"model": SERVED_MODEL_NAME, "prompt": words(rng, 8)}
    body = rng.choice([{**good, "max_tokens": -1}, {**good, "top_p": 2.0},
                       {**good, "prompt": [rng.randrange(VOCAB_LIMIT) for _ in range(MAX_MODEL_LEN + 1)]},
                       {**good, "frobnicate": 1}, '{"model": "not json'])
    return SoakRequest("/v1/completions", body, bad=True)


def draw_request(rng: random.Random) -> SoakRequest:
    """One request of the mixed load, drawn with ``rng``."""
    if rng.random() < BAD_SHARE:
        return draw_bad_request(rng)
    body: dict = {"model": SERVED_MODEL_NAME, "max_tokens": rng.randint(1, MAX_OUTPUT_TOKENS)}
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=0.8, top_k=rng.choice((-1, 20, 50)), top_p=rng.choice((1.0, 0.9)))
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        if rng.random() < 0.2:
            body["n"] = rng.choice((2, 3))
    length = prompt_length(rng)
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": words(rng, length * 2 // 3)}]  # ~1.5 tokens a word
    else:
        path = "/v1/completions"
        body["prompt"] = ([rng.randrange(VOCAB_LIMIT) for _ in range(length)] if rng.random() < 0.5
                          else words(rng, length * 2 // 3))
    abort_after = None
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < ABORT_SHARE:
            abort_after = rng.randint(1, 8)
    return SoakRequest(path, body, abort_after_chunks=abort_after)


async def send(client, request: SoakRequest) -> tuple[str, str | None]:
    """Send ``request``; its outcome ("done", "aborted", "refused" or "failed") and, for a
    failure, why."""
    import httpx

    expected = 400 if request.bad else 200
    content = request.body if isinstance(request.body, str) else json.dumps(request.body)
    try:
        async with client.stream("POST", request.path, content=content,
                                 headers={"Content-Type": "application/json"}) as response:
            if response.status_code != 200 or not request.stream:
                text = (await response.aread()).decode(errors="replace")
                if response.status_code == 499:
                    return "aborted", None
                if response.status_code != expected:
                    return "failed", f"{response.status_code} where {expected} was due: {text[:200]}"
                return ("refused" if request.bad else "done"), None
            chunks, last = 0, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line.removeprefix("data: ")
                if last.startswith('{"error"'):
                    return "failed", f"the stream ended with an error: {last[:200]}"
                chunks += 1
                if chunks == request.abort_after_chunks:
                    return "aborted", None  # leaving the block closes the connection mid-stream
            return ("done", None) if last == "[DONE]" else ("failed", f"the stream ended without [DONE]: {last[:200]}")
    except httpx.TimeoutException:
        return "failed", f"no answer within {REQUEST_TIMEOUT_S:.0f} s"
    except httpx.HTTPError as exc:
        return "failed", f"{type(exc).__name__}: {exc}"[:300]


# ----------------------------------------------------------------- the run
@dataclass
class Tally:
    """What the clients have seen so far."""

    outcomes: collections.Counter
    errors: list[str]
    in_flight: int = 0


def seconds_until_load(start: float) -> float:
    """0 while the clients may send; in a minute's idle gap, how long until it ends."""
    into_minute = (time.monotonic() - start) % MINUTE_S
    return 0.0 if into_minute < MINUTE_S - IDLE_GAP_S else MINUTE_S - into_minute


async def run_client(client, rng: random.Random, start: float, end: float, tally: Tally) -> None:
    """Send drawn requests one after another until ``end``, pausing in every idle gap."""
    while time.monotonic() < end - IDLE_GAP_S:  # the last minute's idle gap ends the run
        await asyncio.sleep(seconds_until_load(start))
        tally.in_flight += 1
        outcome, error = await send(client, draw_request(rng))
        tally.in_flight -= 1
        tally.outcomes[outcome] += 1
        if error is not None and len(tally.errors) < 20:
            tally.errors.append(error)
        await asyncio.sleep(rng.expovariate(1 / THINK_S))


def sample(minute: int, core_pid: int, peak: int, tally: Tally) -> dict:
    """One row of the results: the core's memory now (MiB), its peak since the last row, the counts."""
    memory = process_memory(core_pid)
    return {"minute": minute, "rss_mib": round(memory["VmRSS"] / MiB, 1),
            "rss_anon_mib": round(memory["RssAnon"] / MiB, 1),
            "peak_rss_mib": round(max(peak, memory["VmRSS"]) / MiB, 1), "in_flight": tally.in_flight,
            **{outcome: tally.outcomes[outcome] for outcome in ("done", "aborted", "refused", "failed")}}


async def watch_memory(core_pid: int, start: float, minutes: int, tally: Tally) -> list[dict]:
    """A sample at the end of every minute's idle gap (the first before any load), reading the
    core's VmRSS every second in between for the minute's peak."""
    samples = [sample(0, core_pid, 0, tally)]
    for minute in range(1, minutes + 1):
        mark, peak = start + minute * MINUTE_S - SAMPLE_LEAD_S, 0
        while (now := time.monotonic()) < mark:
            peak = max(peak, process_memory(core_pid)["VmRSS"])
            await asyncio.sleep(min(1.0, mark - now))
        samples.append(sample(minute, core_pid, peak, tally))
        row = samples[-1]
        print(f"minute {minute}: engine core RSS {row['rss_mib']:.0f} MiB (anonymous {row['rss_anon_mib']:.0f}), "
              f"peak under load {row['peak_rss_mib']:.0f}; {row['done']} done, {row['aborted']} aborted, "
              f"{row['refused']} refused, {row['failed']} failed", flush=True)
    return samples


async def soak(url: str, core_pid: int, minutes: int, clients: int, seed: int) -> tuple[list[dict], Tally]:
    """``clients`` clients for ``minutes`` minutes against the server at ``url``; the samples and the tally."""
    import httpx

    tally = Tally(collections.Counter(), [])
    start = time.monotonic()
    end = start + minutes * MINUTE_S
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        samples, *_ = await asyncio.gather(watch_memory(core_pid, start, minutes, tally),
                                           *(run_client(client, random.Random(seed * 1000 + i), start, end, tally)
                                             for i in range(clients)))
    return samples, tally


def summarize(samples: list[dict], bound_mib: float) -> dict:
    """Resident memory at minute 1, at the end, its maximum and its growth over the second half
    (from the middle minute to the last), at the ends of the pauses and at the minutes' peaks."""
    loaded = samples[1:]
    middle, last = loaded[(len(loaded) - 1) // 2], loaded[-1]

    def series(key: str) -> dict:
        return {"minute_1": loaded[0][key], "end": last[key], "max": max(s[key] for s in loaded),
                "second_half_growth": round(last[key] - middle[key], 1)}

    rss, peak = series("rss_mib"), series("peak_rss_mib")
    return {"rss_mib": rss, "peak_rss_mib": peak, "second_half_from_minute": middle["minute"], "bound_mib": bound_mib,
            "levelled_off": max(rss["second_half_growth"], peak["second_half_growth"]) <= bound_mib,
            "failed": last["failed"]}


# ----------------------------------------------------------------- what a trim costs
IDLE_BEFORE_PROBE_S = 3.0  # longer than the core's TRIM_AFTER_IDLE_S plus a trim: the core has trimmed
PROBE = {"model": SERVED_MODEL_NAME, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True,
         "prompt": [(7 * i) % VOCAB_LIMIT for i in range(150)]}


async def first_token_after_idle(url: str) -> float:
    """Seconds to the first streamed chunk of ``PROBE``, sent to an idle server."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=PROBE) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return time.perf_counter() - start
    raise RuntimeError("the probe's stream carried no chunk")


def trim_cost(model_dir: Path, rounds: int, seed: int) -> dict:
    """The price of trimming when idle: the first request after an idle spell, its time to
    first token through a server that trims and one that does not, in alternating turns
    (both servers up together, so the machine is the same for both). Each turn waits
    ``IDLE_BEFORE_PROBE_S`` first, so the trimming server has trimmed and its next step
    faults the freed pages back in."""
    from nanoengine.backends.cpu_platform import TRIM_VARIABLE

    servers = {}
    for name, trim in (("trim", "1"), ("no_trim", "0")):
        server = engine_server(model_dir, "float32", 2048, MAX_NUM_SEQS, MAX_MODEL_LEN, seed)
        server.env[TRIM_VARIABLE] = trim
        servers[name] = server
    ttft: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            server.start()
            server.wait_healthy()
        for name, server in servers.items():  # a first request each, not counted: warm-up
            asyncio.run(first_token_after_idle(server.url))
        for turn in range(rounds):
            for name in in_turn(servers, turn):
                time.sleep(IDLE_BEFORE_PROBE_S)
                ttft[name].append(asyncio.run(first_token_after_idle(servers[name].url)))
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: round(statistics.median(times) * 1000, 1) for name, times in ttft.items()}
    return {"rounds": rounds, "idle_before_each_s": IDLE_BEFORE_PROBE_S, "probe": {**PROBE, "prompt": "150 tokens"},
            "ttft_ms": {name: [round(t * 1000, 1) for t in times] for name, times in ttft.items()},
            "median_ttft_ms": medians, "trim_over_no_trim": round(medians["trim"] / medians["no_trim"], 3)}


def main(argv: list[str] | None = None) -> int:
    from nanobench.benchmark import environment, load_average
    from nanoengine import default_model_dir
    from nanoengine.backends.cpu_platform import TRIM_VARIABLE

    words_given = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m nanobench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=int, default=60, help="minutes of load (default 60)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--no-trim", action="store_true", help=f"start the server with {TRIM_VARIABLE}=0")
    p.add_argument("--bound-mib", type=float, default=64.0,
                   help="the growth over the second half within which memory counts as levelled off (default 64)")
    p.add_argument("--trim-cost", type=int, default=0, metavar="ROUNDS",
                   help="instead of the soak: the first request after idle, its TTFT through a trimming and a "
                        "non-trimming server, ROUNDS alternating turns (results/soak-trim-cost-cpu-<date>.json)")
    p.add_argument("--out", default=None, help="results JSON (default: results/soak-cpu-<date>[-no-trim].json)")
    args = p.parse_args(words_given)
    if args.minutes < 1 or args.clients < 1 or args.trim_cost < 0:
        p.error(f"--minutes and --clients must be >= 1 and --trim-cost >= 0, got {args.minutes}, {args.clients} "
                f"and {args.trim_cost}")
    if not Path("/proc/self/status").exists():
        p.error("the soak reads the engine core's memory from /proc: Linux only")

    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.trim_cost:
        now = datetime.datetime.now(datetime.timezone.utc)
        cost = trim_cost(model_dir, args.trim_cost, args.seed)
        out = Path(args.out) if args.out else Path("results") / f"soak-trim-cost-cpu-{now.date()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"kind": "the first request after idle, through a trimming and a non-trimming "
                                           "server", **cost, "environment": environment(),
                                   "date": now.isoformat(timespec="seconds"),
                                   "command": " ".join(["python -m nanobench.soak", *words_given]),
                                   "format": "results/README.md"}, indent=2))
        print(f"TTFT of the first request after {IDLE_BEFORE_PROBE_S:g} s idle, median of {args.trim_cost}: "
              f"{cost['median_ttft_ms']['trim']} ms trimming, {cost['median_ttft_ms']['no_trim']} ms not "
              f"({cost['trim_over_no_trim']}x); written to {out}")
        return 0
    server = engine_server(model_dir, "float32", 2048, MAX_NUM_SEQS, MAX_MODEL_LEN, args.seed)
    server.env[TRIM_VARIABLE] = "0" if args.no_trim else "1"
    load_at_start = load_average()
    server.start()
    try:
        healthy = server.wait_healthy()
        core_pid = engine_core_pid(server)
        print(f"server healthy at {server.url} after {healthy:.0f} s, engine core pid {core_pid}, trimming when idle "
              f"{'off' if args.no_trim else 'on'}; {args.clients} clients for {args.minutes} minutes "
              f"(log {server.log_path})", flush=True)
        samples, tally = asyncio.run(soak(server.url, core_pid, args.minutes, args.clients, args.seed))
        exit_code = server.process.poll()
    finally:
        server.stop()
    summary = summarize(samples, args.bound_mib)
    now = datetime.datetime.now(datetime.timezone.utc)
    results = {
        "kind": "soak: the engine core's resident memory under mixed load",
        "settings": {"minutes": args.minutes, "clients": args.clients, "seed": args.seed, "model": str(model_dir),
                     "trim_when_idle": not args.no_trim, "idle_gap_s": IDLE_GAP_S, "think_s": THINK_S,
                     "prompt_tokens": [4, MAX_PROMPT_TOKENS], "max_output_tokens": MAX_OUTPUT_TOKENS,
                     "bad_share": BAD_SHARE, "abort_share_of_streams": ABORT_SHARE,
                     "server_command": server.command, "seconds_to_healthy": healthy},
        "samples": samples, "summary": summary, "errors": tally.errors,
        "server_exit_code_during_run": exit_code,
        "load_average": {"start": load_at_start, "end": load_average()}, "environment": environment(),
        "date": now.isoformat(timespec="seconds"), "command": " ".join(["python -m nanobench.soak", *words_given]),
        "format": "results/README.md",
    }
    out = Path(args.out) if args.out else \
        Path("results") / f"soak-cpu-{now.date()}{'-no-trim' if args.no_trim else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    rss, peak = summary["rss_mib"], summary["peak_rss_mib"]
    print(f"engine core RSS at the ends of the pauses {rss['minute_1']:.0f} -> {rss['end']:.0f} MiB "
          f"(max {rss['max']:.0f}), peaks under load {peak['minute_1']:.0f} -> {peak['end']:.0f} "
          f"(max {peak['max']:.0f}); growth over the second half {rss['second_half_growth']:+.0f} / "
          f"{peak['second_half_growth']:+.0f} MiB: "
          f"{'levelled off' if summary['levelled_off'] else 'NOT levelled off'} (bound {args.bound_mib:g} MiB); "
          f"{summary['failed']} failed; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
