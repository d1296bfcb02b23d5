"""``bench --vs-vllm``: vLLM's CPU build driven as a long-lived subprocess (nanobench/vllm_peer.py).

Most tests drive a stand-in runner (``fake_vllm_runner.py``, the same JSON-lines protocol)
with the course's own Python, so they need no vLLM; the last runs the real runner and is
skipped where ``./course vllm-setup`` has not made ``.venv-vllm``.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from nanoengine.__main__ import main
from nanobench.vllm_peer import (DEFAULT_VENV, VllmPeer, VllmRunnerError, VllmSettings, VllmSetupError,
                                 format_cpu_list, greedy_agreement, vllm_python)

FAKE_RUNNER = Path(__file__).with_name("fake_vllm_runner.py")
sys.path.insert(0, str(FAKE_RUNNER.parent))
from fake_vllm_runner import fake_tokens  # noqa: E402


def settings(**overrides) -> VllmSettings:
    values = dict(model_dir="/nowhere/model", dtype="float32", max_model_len=64, max_num_batched_tokens=256,
                  max_num_seqs=16, threads_bind="0", kvcache_space_gib=1)
    return VllmSettings(**{**values, **overrides})


def fake_peer(**overrides) -> VllmPeer:
    return VllmPeer(settings(**overrides), python=sys.executable, runner=FAKE_RUNNER, load_timeout_s=60,
                    run_timeout_s=60)


# ------------------------------------------------------------- arguments
def test_missing_venv_is_a_clear_error_before_anything_loads(tmp_path, capsys):
    with pytest.raises(VllmSetupError, match="./course vllm-setup"):
        vllm_python(tmp_path / "no-venv")
    # The command line says the same and exits 2, before any model is read.
    code = main(["bench", "--vs-vllm", "--vllm-venv", str(tmp_path / "no-venv"), "--model", str(tmp_path / "none")])
    assert code == 2 and "./course vllm-setup" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "float16"], "float32 or bfloat16"),
    (["--device", "cuda"], "--device cpu"),
    (["--vllm-kvcache-gib", "0"], "vllm_kvcache_gib"),
    (["--vllm-compare-prompts", "0"], "vllm_compare_prompts"),
    (["--compile"], "leave out"),
])
def test_bad_vs_vllm_arguments_are_refused(tmp_path, capsys, extra, message):
    code = main(["bench", "--vs-vllm", "--vllm-venv", str(tmp_path), "--model", str(tmp_path / "none"), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_settings_refuse_bad_values_and_name_the_environment():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        settings(dtype="float16")
    with pytest.raises(ValueError, match="whole number of GiB"):
        settings(kvcache_space_gib=0.5)
    env, preloads = settings(threads_bind="0-1", kvcache_space_gib=4).environment(
        {"PYTHONPATH": "/course", "VIRTUAL_ENV": "/course/.venv", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    assert env.get("LD_PRELOAD", "") == ":".join(p for p in preloads.values() if p)


def test_cpu_lists_use_vllms_syntax():
    assert format_cpu_list({0, 1}) == "0-1"
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3"
    with pytest.raises(ValueError):
        format_cpu_list([])


# ------------------------------------------------------------- agreement
def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    check = greedy_agreement([[1, 2, 3, 4], [5, 6, 7], [8, 9]], [[1, 2, 3, 4], [5, 0, 7], [8]])
    assert check["prompts_compared"] == 3 and check["identical_prompts"] == 1
    assert check["first_divergence"] == [None, 1, 1]  # a shorter output diverges where it ends
    assert check["tokens_agreeing"] == 4 + 1 + 1 and check["tokens_compared"] == 4 + 3 + 2
    assert check["earliest_divergence"] == 1
    same = greedy_agreement([[1, 2]], [[1, 2]])
    assert same["earliest_divergence"] is None and same["tokens_agreeing"] == same["tokens_compared"] == 2
    with pytest.raises(ValueError, match="same prompts"):
        greedy_agreement([[1]], [])


# -------------------------------------------------------------- protocol
def test_peer_loads_once_and_answers_timed_runs():
    with fake_peer() as peer:
        ready = peer.wait_ready()
        assert ready["vllm_version"] == "0.0-fake"
        assert ready["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the settings reached the runner
        prompts = [[1, 2, 3], [4, 5]]
        first = peer.run(prompts, [4, 6], keep_tokens=1)
        assert first["output_tokens"] == 10 and first["seconds"] > 0
        assert first["tokens"] == [fake_tokens([1, 2, 3], 4)]  # only the first keep_tokens prompts
        second = peer.run(prompts, [4, 6], keep_tokens=2)  # the same process takes another run
        assert second["tokens"][1] == fake_tokens([4, 5], 6)
        assert peer.decoder([1, 2])(3)["output_tokens"] == 3
        process = peer.process
    assert peer.process is None and process.returncode == 0  # quit on close


@pytest.mark.parametrize("mode, message", [
    ("fail-load", "cannot load"),
    ("die-on-run", "exited"),
    ("noise", "not JSON"),
])
def test_peer_failures_are_clear_errors_with_the_log(monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    with fake_peer() as peer:
        with pytest.raises(VllmRunnerError, match=message) as caught:
            peer.wait_ready()
            peer.run([[1, 2]], [2])
        assert "a log line a real vLLM would print" in str(caught.value)  # the log's tail comes along


def test_peer_refuses_mismatched_lengths_without_sending():
    with fake_peer() as peer:
        with pytest.raises(ValueError, match="one max_tokens per prompt"):
            peer.run([[1], [2]], [3])
        assert peer.run([[1]], [3])["output_tokens"] == 3  # still usable


def test_peer_results_refuse_a_short_run(monkeypatch):
    from nanobench.vllm_peer import peer_results

    monkeypatch.setenv("FAKE_VLLM_MODE", "short")
    with fake_peer() as peer:
        runs = [peer.run([[1, 2]], [4], keep_tokens=1)]
        with pytest.raises(VllmRunnerError, match="not a measurement"):
            peer_results(peer, runs, {"output_tokens_per_s": 1.0}, [[0] * 4], expected_tokens=4)


# ------------------------------------------------------------ end to end
def fake_venv(tmp_path: Path, runner: Path = FAKE_RUNNER) -> Path:
    """A directory shaped like .venv-vllm whose ``bin/python`` runs the stand-in ``runner``
    (with the course's Python) whatever script it is given (``test_llamacpp_peer`` gives
    llama.cpp's stand-in)."""
    python = tmp_path / "fake-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{runner}" "$2"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python.parent.parent


@pytest.mark.slow  # the engine, transformers and the roofline on a tiny model
def test_bench_vs_vllm_alternates_and_writes_a_vllm_section(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench-vllm.json"
    code = main(["bench", "--vs-vllm", "--vllm-venv", str(fake_venv(tmp_path)), "--vllm-threads-bind", "0",
                 "--model", str(tiny_llama_dir), "--num-requests", "4", "--min-prompt", "4", "--max-prompt", "12",
                 "--output-len", "4", "--hf-batch-size", "2", "--skip-generate-batch", "--single-stream-tokens", "3",
                 "--repeats", "2", "--vllm-compare-prompts", "3", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    vllm = results["vllm"]
    assert vllm["version"] == "0.0-fake" and vllm["repeats"] == 2 and len(vllm["seconds_spread"]["runs"]) == 2
    assert vllm["settings"]["threads_bind"] == "0" and vllm["settings"]["kvcache_space_gib"] == 4
    assert vllm["settings"]["dtype"] == "float32" and set(vllm["settings"]["preloads"]) == {"tcmalloc", "iomp5"}
    assert vllm["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vllm["ratio_engine_over_vllm"] == pytest.approx(
        results["systems"]["nanoengine"]["output_tokens_per_s"] / vllm["output_tokens_per_s"])
    check = vllm["greedy_agreement"]
    assert check["prompts_compared"] == 3 and check["tokens_compared"] == 12  # the fake's tokens differ
    single = results["single_stream_decode"]
    assert "vllm_tok_s" in single and "ratio_over_vllm" in single
    assert "hf_static" in results["systems"]  # transformers still ran in the same rounds
    assert results["round_order"] == [["nanoengine", "vllm", "hf_static"], ["hf_static", "vllm", "nanoengine"]]


@pytest.mark.slow  # the engine and the roofline on a tiny model
def test_bench_vs_vllm_without_transformers_still_races_the_single_stream(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bench-vllm.json"
    code = main(["bench", "--vs-vllm", "--vllm-venv", str(fake_venv(tmp_path)), "--vllm-threads-bind", "0",
                 "--model", str(tiny_llama_dir), "--num-requests", "3", "--min-prompt", "4", "--max-prompt", "8",
                 "--output-len", "4", "--skip-hf", "--single-stream-tokens", "3", "--repeats", "1",
                 "--vllm-compare-prompts", "2", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    single = results["single_stream_decode"]
    assert single["hf_tok_s"] is None and single["ratio"] is None  # transformers was not loaded
    assert "vllm_tok_s" in single and single["tokens"] == 3
    assert single["weight_bytes"] > 0 and single["memory_bandwidth_gbs"] == results["roofline"]["memory_bandwidth_gbs"]
    if single["nanoengine_tok_s"] is not None:
        assert single["weight_traffic_share"] == pytest.approx(
            single["weight_bytes"] * single["nanoengine_tok_s"] / (single["memory_bandwidth_gbs"] * 1e9))
        assert "copy bandwidth" in capsys.readouterr().out
    else:  # three tokens of a tiny model may be too quick to time here: the bench says so, and claims no share
        assert "weight_traffic_share" not in single and "too fast to time" in capsys.readouterr().out


@pytest.mark.slow  # loads vLLM's CPU build (about a minute and a half: it compiles)
@pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "python").exists(), reason="no .venv-vllm (./course vllm-setup)")
def test_real_vllm_runner_agrees_with_the_engine_in_float32():
    from nanoengine import LLM, default_model_dir
    from nanobench.benchmark import make_workload, run_engine_once

    model_dir = default_model_dir()
    prompts = make_workload(2, 8, 24, seed=0)
    lens = [8, 8]
    llm = LLM(model_dir, dtype="float32")
    try:
        engine_tokens = run_engine_once(llm, prompts, lens).tokens
    finally:
        llm.shutdown()
    with VllmPeer(VllmSettings(model_dir=str(model_dir), dtype="float32", max_model_len=64,
                               max_num_batched_tokens=256, max_num_seqs=8)) as peer:
        ready = peer.wait_ready()
        assert ready["vllm_version"] and ready["settings"]["resolved"]["dtype"] == "float32"
        result = peer.run(prompts, lens, keep_tokens=2)
    assert result["output_tokens"] == 16
    assert greedy_agreement(engine_tokens, result["tokens"])["identical_prompts"] == 2


# ------------------------------------------------------ online, both servers
def test_a_server_that_exits_is_a_clear_error_with_its_log():
    from nanobench.server_race import ServerProcess

    server = ServerProcess("broken", [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(4)"], {}, 1)
    server.start()
    with pytest.raises(RuntimeError, match="exited \\(code 4\\)") as caught:
        server.wait_healthy(timeout_s=30)
    assert "bad flag" in str(caught.value)


def test_vllm_server_uses_the_peer_settings_and_opens_the_cache_reset(tmp_path):
    from nanobench.server_race import vllm_server

    server = vllm_server(settings(venv=str(fake_venv(tmp_path)), threads_bind="0-1", enforce_eager=True))
    assert server.command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert server.command[server.command.index("--dtype") + 1] == "float32" and "--enforce-eager" in server.command
    assert server.env["VLLM_SERVER_DEV_MODE"] == "1" and server.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert server.url == f"http://127.0.0.1:{server.port}"


@pytest.mark.slow  # starts two servers
def test_race_servers_alternates_rates_and_order_and_reports_latency_percentiles(tiny_llama_tok_dir):
    from nanobench.server_race import engine_server, latency_table, race_servers

    servers = [engine_server(tiny_llama_tok_dir, "float32", 256, 8, 64, 0) for _ in range(2)]
    servers[1].name = "second"
    prompts, lens = [[5, 6, 7, 8], [9, 10, 11]], [4, 3]
    race = race_servers(servers, prompts, lens, [4.0, 8.0, 4.0], seed=0)
    assert all(s.process.poll() is not None for s in servers)  # stopped after
    table = latency_table(race)
    assert [(r["rate_requests_per_s"], r["server"], r["ran_first"]) for r in table] == [
        (4.0, "nanoengine", True), (4.0, "nanoengine", False), (4.0, "second", False), (4.0, "second", True),
        (8.0, "nanoengine", True), (8.0, "second", False)]  # a rate's second round: the other server first
    assert all(r["failed"] == 0 and r["ttft_p50_ms"] > 0 and r["itl_p90_ms"] >= r["itl_p50_ms"] for r in table)


@pytest.mark.slow  # starts a server
def test_server_saturation_alternates_the_server_and_the_same_engine_in_process(tiny_llama_tok_dir):
    from nanobench.server_race import SATURATION_RATE, server_saturation
    from nanoengine import LLM

    llm = LLM(tiny_llama_tok_dir, device="cpu", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=256)
    prompts, lens = [[5, 6, 7, 8], [9, 10, 11], [12, 13]], [4, 3, 5]
    try:
        result = server_saturation(llm, tiny_llama_tok_dir, prompts, lens, rounds=2, seed=0)
    finally:
        llm.shutdown()
    rounds = result["rounds"]
    assert len(rounds) == 2 and all(r["server_failed"] == 0 for r in rounds)
    # the server got the same settings as the engine here, and every token asked for came back
    command = result["server_command"]
    assert command[command.index("--max-num-seqs") + 1] == "8" and command[command.index("--max-model-len") + 1] == "64"
    assert command[command.index("--device") + 1] == "cpu"
    assert all(r["server"]["output_tokens_received"] == sum(lens) for r in rounds)
    assert all(r["server"]["rate_requests_per_s"] == r["in_process"]["rate_requests_per_s"] == SATURATION_RATE
               for r in rounds)
    assert result["ratio"] == pytest.approx(result["server_tok_s"] / result["in_process_tok_s"])
    assert result["server_tok_s"] == pytest.approx(sum(r["server_tok_s"] for r in rounds) / 2)  # two rounds' median
    assert result["in_process_tok_s"] == pytest.approx(sum(r["in_process_tok_s"] for r in rounds) / 2)


def test_server_saturation_and_a_server_url_are_refused_together(capsys):
    code = main(["bench", "--server", "http://127.0.0.1:1", "--online-rates", "1", "--server-saturation"])
    assert code == 2 and "cannot be combined with --server" in capsys.readouterr().err


def test_saturation_report_reads_the_newest_measure_with_its_provenance(tmp_path):
    from nanobench.server_race import saturation_report

    assert "no results file" in saturation_report(tmp_path) and "--server-saturation" in saturation_report(tmp_path)

    def write(name: str, date: str, server: float, local: float) -> None:
        rounds = [{"server_tok_s": server, "in_process_tok_s": local}]
        (tmp_path / name).write_text(json.dumps({
            "date": date, "dtype": "float32", "command": f"bench for {name}",
            "environment": {"cpu_model": "Some Xeon", "cpu_count": 2, "nanoengine_revision": "abc1234"},
            "server_saturation": {"rounds": rounds, "server_tok_s": server, "in_process_tok_s": local,
                                  "ratio": server / local}}))

    write("bench-cpu-old.json", "2026-12-01T10:00:00+00:00", 50.0, 100.0)
    write("bench-cpu-new.json", "2026-12-04T10:00:00+00:00", 188.0, 200.0)
    (tmp_path / "bench-cpu-other.json").write_text(json.dumps({"date": "2026-12-05T00:00:00+00:00"}))
    text = saturation_report(tmp_path)
    assert text.startswith("bench-cpu-new.json: 2026-12-04 10:00 UTC, Some Xeon, 2 cores, float32")
    assert "bench for bench-cpu-new.json" in text and "abc1234" in text
    assert "188.0 tok/s through the server, 200.0 in-process = 94%" in text and "188 / 200 tok/s" in text


def test_engine_server_serves_on_the_device_it_is_given(tiny_llama_tok_dir):
    from nanobench.server_race import engine_server

    for device in ("cpu", "cuda"):
        command = engine_server(tiny_llama_tok_dir, "bfloat16", 256, 8, 64, 0, device=device).command
        assert command[command.index("--device") + 1] == device  # not started: only the command is read
