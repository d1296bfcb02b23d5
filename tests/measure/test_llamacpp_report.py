"""Chapter 11's reading of a ``bench --vs-llamacpp`` file: every figure from the file, and each
reading on both sides of its thresholds (nanobench/llamacpp_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanobench import llamacpp_report

ROOT = Path(__file__).resolve().parents[2]


def system(decode: float, ttft_ms: float, weight_bytes: int, share: float, **extra) -> dict:
    return {"decode_tok_s": {"median": decode, "min": decode * 0.9, "max": decode * 1.1}, "ttft_ms": {"median": ttft_ms},
            "weight_bytes": weight_bytes, "weight_traffic_share": share, **extra}


def results(engine=50.0, peer=50.0, q8=None, shares=(0.9, 0.9), ttft=(60.0, 90.0), dtype="float32") -> dict:
    systems = {"nanoengine": system(engine, ttft[0], 540_000_000, shares[0]),
               "llamacpp": system(peer, ttft[1], 540_000_000, shares[1],
                                  greedy_agreement={"tokens_agreeing": 128, "tokens_compared": 128,
                                                    "earliest_divergence": None})}
    if q8 is not None:
        systems["llamacpp_q8_0"] = system(q8[0], 80.0, 540_000_000 // 4, q8[1], gguf={"weights": "q8_0"},
                                          greedy_agreement={"tokens_agreeing": 20, "tokens_compared": 128,
                                                            "earliest_divergence": 20})
    return {"file": "bench-llamacpp-cpu-2026-12-07-float32.json", "dtype": dtype, "date": "2026-12-07T07:03:23+00:00",
            "command": "python -m nanoengine bench --vs-llamacpp --dtype float32", "memory_bandwidth_gbs": 28.0,
            "environment": {"cpu_model": "AMD EPYC", "cpu_count": 2, "nanoengine_revision": "abc1234"},
            "workload": {"prompt_tokens": 32, "output_tokens": 128, "repeats": 15}, "systems": systems}


@pytest.mark.parametrize("engine, says", [(50.0, "level (1.00x)"), (54.9, "level (1.10x)"),
                                          (56.0, "the engine faster (1.12x)"), (44.0, "llama.cpp faster (0.88x)")])
def test_decode_at_the_same_precision_reads_level_within_ten_percent(engine, says):
    assert f"decode {says}" in llamacpp_report.reading(results(engine=engine))


def test_bandwidth_bound_only_when_both_read_near_the_copy_bandwidth():
    assert "the ceiling of one stream" in llamacpp_report.reading(results(shares=(0.85, 0.7)))
    below = llamacpp_report.reading(results(shares=(0.85, 0.5)))
    assert "well below the copy bandwidth (85% and 50%)" in below and "ceiling" not in below


@pytest.mark.parametrize("ttft, says", [((60.0, 90.0), "the engine sooner"), ((90.0, 60.0), "llama.cpp sooner"),
                                        ((60.0, 62.0), "level")])
def test_first_token(ttft, says):
    assert f"forward pass: {says}" in llamacpp_report.reading(results(ttft=ttft))


def test_q8_0_bound_by_bytes_limited_by_compute_or_no_faster():
    # the Q8_0 file holds a quarter of the bytes: bound by the bytes from 0.75 x 4 = 3x as fast
    assert "fewer bytes are more tokens" in llamacpp_report.reading(results(q8=(150.0, 0.7)))
    compute = llamacpp_report.reading(results(q8=(100.0, 0.46)))
    assert "decodes 2.00x as fast: less than the bytes alone" in compute and "46%" in compute
    same = llamacpp_report.reading(results(q8=(54.0, 0.25)))
    assert "cost what the bytes saved" in same
    assert "Q8_0" not in llamacpp_report.reading(results())


def test_describe_prints_provenance_every_system_and_the_token_agreement():
    text = llamacpp_report.describe(results(q8=(100.0, 0.46)))
    for expected in ("2026-12-07 07:03 UTC, AMD EPYC, 2 cores, engine revision abc1234",
                     "command: python -m nanoengine bench --vs-llamacpp", "llama.cpp, Q8_0", "q8_0 weights",
                     "128/128 agree", "20/128 agree, parting at position 20"):
        assert expected in text


def test_report_takes_the_newest_file_of_each_dtype_float32_first(tmp_path):
    old, new, bf16 = results(engine=40.0), results(engine=60.0), results(dtype="bfloat16")
    old["date"], new["date"], bf16["date"] = "2026-12-01T00:00:00", "2026-12-07T00:00:00", "2026-12-08T00:00:00"
    for name, data in (("bench-llamacpp-cpu-a-float32.json", old), ("bench-llamacpp-cpu-b-float32.json", new),
                       ("bench-llamacpp-cpu-c-bfloat16.json", bf16)):
        (tmp_path / name).write_text(json.dumps({k: v for k, v in data.items() if k != "file"}))
    files = llamacpp_report.newest_files(tmp_path)
    assert [f["file"] for f in files] == ["bench-llamacpp-cpu-b-float32.json", "bench-llamacpp-cpu-c-bfloat16.json"]
    assert llamacpp_report.report(tmp_path / "empty").startswith("no bench --vs-llamacpp results")


def test_the_committed_results_read():
    text = llamacpp_report.report(ROOT / "results")
    assert "bench-llamacpp-cpu-" in text and "reading (" in text
