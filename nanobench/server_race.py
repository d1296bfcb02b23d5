"""Online through HTTP, the engine's server against vLLM's: ``bench --vs-vllm --online-rates R ...``.

``--online-rates`` alone steps the engine in this process (``benchmark.run_online``);
``--server URL`` sends the arrivals to a server someone else started (``online_client``).
This module starts both servers itself, each as its own process on this machine, and
sends them the same workload through the same client, so what is compared is what a
user of either server would see:

* the engine's: ``python -m nanoengine serve`` with the course's Python;
* vLLM's: ``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` (the
  ``vllm serve`` command of vLLM's CPU wheel 0.32 fails to start; the module it wraps
  works), with the settings of ``vllm_peer`` (thread binding, KV cache, preloads) and
  ``VLLM_SERVER_DEV_MODE=1``, which opens its ``/reset_prefix_cache`` endpoint: the
  client empties each server's prefix cache before each rate, as the engine's own runs do.

Both serve the same model directory in the same dtype with the same token budget per
step. Each waits for ``GET /health`` before it is measured; both stay up for the whole
comparison and each rate is a round sent to one server, then the other, so a slow spell of
a shared machine hits both. A rate's rounds take turns at which server goes first: on a 2-core
Xeon the server that ran second in a round often had the lower TTFT p50, whichever it was.
One bias is left, and measured rather than removed (it would take restarting vLLM, a
minute's load, every round): with two identical engine servers, the one started second
had a 4-5 ms lower inter-token p50 at 2 requests/s (44 against 49 ms) in every round,
whichever ran first, and vLLM started second gained the same against the engine
(results/README.md). The engine is started first, so the bias runs against it.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nanobench.timing import in_turn

HEALTH_TIMEOUT_S = 1200.0  # vLLM compiles its model before it answers
SERVED_MODEL_NAME = "nanoengine-bench"


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """An OpenAI-compatible server this benchmark started: its command, URL and log."""

    name: str
    command: list[str]
    env: dict
    port: int
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = tempfile.NamedTemporaryFile("w", prefix=f"{self.name}-server-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env)
        log.close()

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
        """Seconds until ``GET /health`` answered 200; an error naming the log if the server
        exits or stays silent."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited (code {self.process.returncode}) before it was "
                                   f"healthy: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the {self.name} server was not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "no log"
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"last lines of {self.log_path}:\n" + "\n".join(text)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def engine_server(model_dir: Path, dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int, seed: int, device: str = "cpu") -> ServerProcess:
    """``python -m nanoengine serve`` with these settings on ``device`` (the vLLM race: the CPU)."""
    port = free_port()
    command = [sys.executable, "-m", "nanoengine", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_MODEL_NAME, "--device", device, "--dtype", dtype,
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs),
               "--max-model-len", str(max_model_len), "--seed", str(seed), "--log-level", "warning"]
    return ServerProcess("nanoengine", command, dict(os.environ), port)


def vllm_server(settings) -> ServerProcess:
    """vLLM's OpenAI server with ``settings`` (``vllm_peer.VllmSettings``) and its environment."""
    from nanobench.vllm_peer import vllm_python

    port = free_port()
    command = [str(vllm_python(settings.venv)), "-m", "vllm.entrypoints.openai.api_server",
               "--model", settings.model_dir, "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
               "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
               "--max-num-seqs", str(settings.max_num_seqs), "--seed", str(settings.seed),
               "--disable-uvicorn-access-log"]
    if settings.enforce_eager:
        command.append("--enforce-eager")
    env, _ = settings.environment()
    env["VLLM_SERVER_DEV_MODE"] = "1"  # opens /reset_prefix_cache, which the client calls before each rate
    return ServerProcess("vllm", command, env, port)


def race_servers(servers: list[ServerProcess], prompts: list[list[int]], output_lens: list[int],
                 rates: list[float], seed: int) -> dict:
    """Every server started and healthy, then each rate sent to each in turn by the
    project's client (``online_client.run_server_online``); a rate's rounds take turns at which
    server goes first (each row says whether its server ran first). The servers are stopped after.

    Returns ``{name: {"rows": [one row per rate], "command": [...], "seconds_to_healthy": s}}``.
    """
    from nanobench.online_client import run_server_online

    results = {}
    try:
        for server in servers:  # one at a time: two models compiling at once on two cores helps nobody
            server.start()
            healthy = server.wait_healthy()
            print(f"{server.name} server healthy at {server.url} after {healthy:.0f} s (log {server.log_path})")
            results[server.name] = {"command": server.command, "seconds_to_healthy": healthy, "rows": []}
        rounds_of: dict[float, int] = {}  # how many rounds each rate has had so far
        for rate in rates:  # each rate's rounds take turns at which server goes first
            turn = rounds_of[rate] = rounds_of.get(rate, -1) + 1
            order = in_turn(servers, turn)
            for position, server in enumerate(order):
                print(f"{server.name} server:", end=" ")
                rows = run_server_online(server.url, prompts, output_lens, [rate], seed, model=SERVED_MODEL_NAME)
                results[server.name]["rows"].extend({**row, "ran_first": position == 0} for row in rows)
    finally:
        for server in servers:
            server.stop()
    return results


def latency_table(results: dict) -> list[dict]:
    """Per rate and server: TTFT and inter-token latency p50 and p90 (ms), tok/s, failures, and
    whether the server ran first in its round (None in files written before the order alternated)."""
    table = []
    for name, entry in results.items():
        for row in entry["rows"]:
            ttft, itl = row.get("ttft_ms") or {}, row.get("itl_ms") or {}
            table.append({"server": name, "rate_requests_per_s": row["rate_requests_per_s"],
                          "ttft_p50_ms": ttft.get("p50"), "ttft_p90_ms": ttft.get("p90"),
                          "itl_p50_ms": itl.get("p50"), "itl_p90_ms": itl.get("p90"),
                          "output_tokens_per_s": row["output_tokens_per_s"], "failed": row["failed"],
                          "ran_first": row.get("ran_first")})
    return sorted(table, key=lambda r: (r["rate_requests_per_s"], r["server"]))


# The whole workload at once: Poisson arrivals at this rate land within tens of milliseconds,
# so both paths run at their capacity (chapter 12's burst).
SATURATION_RATE = 1000.0


def server_saturation(llm, model_dir: Path, prompts: list[list[int]], output_lens: list[int], rounds: int,
                      seed: int) -> dict:
    """The engine's server at saturation against the same engine in this process (``--server-saturation``).

    ``llm``: the engine already built here. The server (``engine_server`` with ``llm``'s
    device and settings) runs in a process of its own, as a deployment runs it; the project's client sends it the whole workload at once (``SATURATION_RATE``), and
    ``run_online`` serves the same arrivals in this process. The rounds alternate (server,
    then in-process), so a slow spell of the machine hits both. The client runs in this
    process and shares the machine's cores with the server: what it costs is in the
    server's figure, as it is for any client on the same machine.
    """
    from nanobench.benchmark import run_online
    from nanobench.online_client import run_server_online

    engine = llm.engine
    server = engine_server(model_dir, str(engine.config.torch_dtype).removeprefix("torch."),
                           engine.config.max_num_batched_tokens, engine.config.max_num_seqs, engine.max_model_len,
                           seed, device=engine.config.torch_device.type)
    rows = []
    server.start()
    try:
        healthy = server.wait_healthy()
        print(f"engine server healthy at {server.url} after {healthy:.0f} s (log {server.log_path})")
        for _ in range(rounds):
            through = run_server_online(server.url, prompts, output_lens, [SATURATION_RATE], seed,
                                        model=SERVED_MODEL_NAME)[0]
            local = run_online(llm, prompts, output_lens, [SATURATION_RATE], seed)[0]
            rows.append({"server_tok_s": through["output_tokens_per_s"], "in_process_tok_s": local["output_tokens_per_s"],
                         "server_failed": through["failed"], "server": through, "in_process": local})
    finally:
        server.stop()
    server_tok_s = statistics.median(r["server_tok_s"] for r in rows)
    in_process_tok_s = statistics.median(r["in_process_tok_s"] for r in rows)
    return {"rate_requests_per_s": SATURATION_RATE, "rounds": rows, "server_tok_s": server_tok_s,
            "in_process_tok_s": in_process_tok_s, "ratio": server_tok_s / in_process_tok_s,
            "server_command": server.command, "seconds_to_healthy": healthy,
            "client": "openai.AsyncOpenAI, streaming /v1/completions (nanobench/online_client.py), in the bench's process"}


def describe_saturation(result: dict) -> str:
    """One line: the server's and the in-process throughput at saturation, and their ratio."""
    return (f"server at saturation (its own process, the whole workload at once, median of {len(result['rounds'])}): "
            f"{result['server_tok_s']:.1f} tok/s through the server, {result['in_process_tok_s']:.1f} in-process "
            f"= {result['ratio']:.0%}")


SATURATION_COMMAND = "python -m nanobench --skip-hf --single-stream-tokens 0 --server-saturation"


def saturation_report(results_dir: Path) -> str:
    """The newest ``bench --server-saturation`` figures in ``results_dir``, with the machine,
    date and command that produced them (chapter 12), or how to measure them if none has."""
    from nanobench.peer_report import machine_of, newest_with

    found = newest_with(results_dir, "server_saturation")
    if found is None:
        return f"no results file in {results_dir} measures the server at saturation yet: run {SATURATION_COMMAND}"
    name, data = found
    result = data["server_saturation"]
    rounds = ", ".join(f"{r['server_tok_s']:.0f} / {r['in_process_tok_s']:.0f}" for r in result["rounds"])
    return (f"{name}: {str(data.get('date', ''))[:16].replace('T', ' ')} UTC, {machine_of(data)}, "
            f"{data.get('dtype', '?')}, engine revision {data.get('environment', {}).get('nanoengine_revision', '?')}\n"
            f"    command: {data.get('command', '?')}\n"
            f"    {describe_saturation(result)}\n"
            f"    each round, through the server / in-process: {rounds} tok/s")
