"""``python -m nanoengine serve`` and ``bench --online-rates R --server URL``.

Bad flags end with exit status 2 and one ``error: ...`` line before any model loads; the
real command serves a tiny checkpoint in a subprocess until Ctrl-C; the benchmark's
Poisson workload reaches a server through the ``openai`` client and comes back in
``run_online``'s record shape.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from nanoengine.__main__ import main
from nanoengine.entrypoints.openai.api_server import serve_in_background
from nanobench import online_client
from nanobench.benchmark import make_output_lens

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest
ROOT = Path(__file__).resolve().parents[2]
# run_online's row: every one of these keys, with the same meaning.
ONLINE_ROW = {"rate_requests_per_s", "seconds", "output_tokens_per_s", "achieved_requests_per_s", "arrival_span_s",
              "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, fragment", [
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--max-queue", "0"], "max_queue must be an integer >= 1"),
    (["--api-key", " "], "api_key is empty"),
    (["--max-body-bytes", "0"], "max_body_bytes must be an integer >= 1"),
    (["--header-timeout", "0"], "header_timeout must be a number of seconds > 0"),
    (["--body-timeout", "nan"], "body_timeout must be a number of seconds > 0"),
    (["--served-model-name", ""], "served_model_name is empty"),
    (["--host", ""], "host must be an address"),
    (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--device", "tpu"], "device must be one of"),
    (["--model", "/no/such/model"], "is neither"),
])
def test_bad_flags_are_refused_before_the_model_loads(capsys, argv, fragment):
    code, out, err = run(capsys, "serve", *argv)
    assert code == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err, err
    assert not out


def test_a_port_in_use_is_refused_before_the_model_loads(capsys, tiny_llama_tok_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, out, err = run(capsys, "serve", "--model", str(tiny_llama_tok_dir), "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "loading" not in out


def _serve_tiny(model_dir: Path) -> subprocess.Popen:
    """``python -m nanoengine serve`` on the tiny checkpoint, as a user starts it (stdout piped)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "nanoengine", "serve", "--model", str(model_dir),
                             "--port", "0", "--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "64",
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` started with multiprocessing's spawn (read from /proc; its
    resource tracker, also a child, is left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            spawned = b"spawn_main" in (stat.parent / "cmdline").read_bytes()
        except OSError:  # it ended meanwhile
            continue
        if parent == pid and spawned:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow  # a real process, as the issue attacked it
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the engine core through /proc")
def test_the_issues_request_is_refused_and_a_dead_engine_ends_the_server_with_status_1(tiny_llama_tok_dir):
    process = _serve_tiny(tiny_llama_tok_dir)
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")):
            lines.append(process.stdout.readline())
            assert lines[-1], f"the server exited early: {''.join(lines)}"
        url = lines[-1].split(" at ", 1)[1].split(" ", 1)[0]
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as client:
            with pytest.raises(openai.BadRequestError, match="top_k"):  # the issue's curl, as the client sends it
                client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                          extra_body={"top_k": 9223372036854775808})
            got = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
            assert got.usage.completion_tokens == 3
            [core] = _spawned_children(process.pid)  # the engine-core process
            os.kill(core, signal.SIGKILL)  # the engine itself stops: the server must not answer 503 forever
            assert process.wait(timeout=60) == 1
        rest = process.stdout.read()
        assert "exiting with status 1" in rest and "exited unexpectedly" in rest, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()


@pytest.mark.slow  # a real process: python, torch and the tiny checkpoint load in ~10 s
def test_python_m_nanoengine_serve_answers_until_ctrl_c(tiny_llama_tok_dir):
    process = _serve_tiny(tiny_llama_tok_dir)
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, f"the server exited early: {''.join(lines)}"
            lines.append(line)
            if line.startswith("serving"):
                break
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), line
        assert "the engine in a process of its own" in line, line  # the default, as in vLLM (engine_core)
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            got = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
            assert got.usage.completion_tokens == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()


# ------------------------------------------------------------------ bench --server
def test_bench_server_arguments_are_checked(capsys):
    code, _, err = run(capsys, "bench", "--server", "ftp://example", "--online-rates", "1")
    assert code == 2 and "server must be a URL starting with http:// or https://" in err
    code, _, err = run(capsys, "bench", "--server", "http://127.0.0.1:1")
    assert code == 2 and "server needs --online-rates" in err
    assert online_client.api_root("http://h:1/v1/") == online_client.api_root("http://h:1") == "http://h:1"


@pytest.mark.slow
def test_bench_drives_a_server_with_the_same_poisson_workload(capsys, tmp_path, build_tiny_llm):
    engine = build_tiny_llm(dict(device="cpu", max_model_len=256, num_kv_blocks=256, block_size=8)).engine
    out = tmp_path / "server.json"
    with serve_in_background(engine, "tiny") as server:
        code, printed, err = run(capsys, "bench", "--server", server.url, "--online-rates", "40", "8",
                                 "--num-requests", "5", "--min-prompt", "4", "--max-prompt", "20", "--output-len", "6",
                                 "--min-output-len", "2", "--out", str(out))
        metrics = server.app.state.metrics
        assert code == 0, err
        assert metrics.finished["length"] == 1 + 2 * 5  # the warm-up, then every request of both rates
    results = json.loads(out.read_text())
    lens = make_output_lens(5, 2, 6, seed=0)
    assert results["server"]["url"] == server.url and results["server"]["model"] == "tiny"
    assert results["workload"]["output_tokens"] == sum(lens) and results["workload"]["ignore_eos"]
    rows = {row["rate_requests_per_s"]: row for row in results["online"]}
    assert set(rows) == {40.0, 8.0}
    for row in rows.values():
        assert ONLINE_ROW <= set(row) and row["failed"] == 0 and row["prefix_cache_reset"]
        assert row["output_tokens_received"] == row["output_tokens_requested"] == sum(lens)  # EOS ignored
        assert row["ttft_ms"]["count"] == 5 and row["ttft_ms"]["p50"] > 0
        assert row["itl_ms"]["count"] <= sum(n - 1 for n in lens)  # a chunk per token with text
    # At 8 requests/s the 5 arrivals span longer than at 40: the run cannot end before its last arrival.
    assert rows[8.0]["seconds"] >= rows[8.0]["arrival_span_s"] > rows[40.0]["arrival_span_s"]
    assert "server, online 40 req/s" in printed and results["command"].startswith("python -m nanoengine bench")


def test_a_failed_request_is_counted_not_fatal(build_tiny_llm):
    engine = build_tiny_llm(dict(device="cpu", max_model_len=64, num_kv_blocks=64, block_size=8)).engine
    with serve_in_background(engine, "tiny") as server:
        rows = online_client.run_server_online(server.url, [[1, 2, 3], [4] * 70], [4, 4], [50.0], seed=0)
    assert rows[0]["failed"] == 1 and "max_model_len is 64" in rows[0]["errors"][0]
    assert rows[0]["ttft_ms"]["count"] == 1
