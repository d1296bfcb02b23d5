"""Tests for the build-it-yourself track ``labs/nano-vllm`` (snapshots, labs and reports).

What is checked here:

- every snapshot v00-v09 runs as a script (``python .../run.py``) and prints exactly its
  saved transcript, ``expected_output.txt``, which shows its new idea at work;
- every version's *checks* (``labs/nano-vllm/checks/test_vNN.py``, the same checks the
  learner runs with ``./course lab-check vNN``) pass on the finished snapshot, and every
  *starter* (the snapshot with that version's idea stubbed out) fails them - on its
  ``TODO(vNN)`` stubs and nothing else; the starters are exactly what
  ``make_starters.py`` generates from the snapshots;
- mutations a maintainer would try (static batching, evicting the oldest request, a
  sampler without temperature, a hash that ignores the parent, an allocator that never
  chains the parent) each make the right check fail with a message saying what is wrong,
  and a scheduler that loops forever times out with a message instead of hanging;
- ``./course lab-start v10`` points to the reading report; usage errors name ``./course``;
  hints name the idea, not the code to write;
- the notes, the README and the two v10 reports: every name the reports cite exists
  in the file they cite it from (the snapshots and ``nanoengine`` by parsing the source;
  nano-vLLM against the name index recorded at the pinned revision).

Per-version behaviour lives in the check modules, not here, so that the learner and CI
run the very same assertions.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "labs" / "nano-vllm"
CHECKS = LAB / "checks"
sys.path.insert(0, str(CHECKS))

import lab_check  # noqa: E402
import lab_harness as H  # noqa: E402
import make_starters  # noqa: E402
from lab_tasks import PARTS, TASKS  # noqa: E402

VERSIONS, STARTERS, V = H.VERSIONS, H.STARTERS, H.V
MAPPING_DIR = VERSIONS / "v10_mapping"

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- scripts

TRACE_MARKERS = {  # the idea each transcript must show (the transcript itself is compared in full)
    "v00": [r"re-read\s+7 tokens", r"a KV cache would have computed only"],
    "v01": [r"Sequence\(id=0, .*finished=True\)"],
    "v02": [r"WAITING", r"\d:RUNNING", r"seq 2 FINISHED"],
    "v03": [r"PREFILL seq 0: 5 token\(s\) in", r"DECODE  seq 0: 1 token\(s\) in",
            r"features computed with the cache: 14; v00's naive loop would compute 44"],
    "v04": [r"DECODE  batch=\[\d+(, \d+)+\]", r"PREFILL batch=\[3\]"],
    "v05": [r"block_table: seq0=\[0, 1\]", r"PREEMPTED seq \d", r"blocks \[[\d, ]+\] returned",
            r"all requests finished; free blocks: 6/6"],
    "v06": [r"slot_mapping = \[", r"prepare_decode  seqs=\[0, 1\]", r"cu_seqlens_q = \[0, 5, 8\]"],
    "v07": [r"prefix hit: 8 tokens cached", r"ref_count: block0=2 block1=2",
            r"prefix hits: [1-9]\d* of", r"all zero: True"],
    "v08": [r"same seed -> same output: True", r"different seed -> different output: True",
            r"top_k=1 equals greedy: True"],
    "v09": [r"TinyTransformer\(torch\.nn\.Module\)", r"top logits \[", r"KV written to slots",
            r"greedy outputs match a no-cache forward pass of the same model: True",
            r"same seed -> same output: True"],
}


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(V))
def test_snapshot_runs_as_a_script_and_prints_its_transcript(version: str) -> None:
    script = VERSIONS / V[version] / "run.py"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    for marker in TRACE_MARKERS[version]:
        assert re.search(marker, result.stdout), f"{version} trace lacks {marker!r}:\n{result.stdout}"
    expected = (VERSIONS / V[version] / "expected_output.txt").read_text()
    assert result.stdout == expected, H.first_difference(result.stdout, expected)


# ------------------------------------------------------------------ solutions and starters

SOLUTION_CHECKS = [(v, f.__name__) for v in H.LAB_VERSIONS for f in H.check_functions(v)]


@pytest.mark.slow
@pytest.mark.parametrize(("version", "check"), SOLUTION_CHECKS, ids=[f"{v}-{c[5:]}" for v, c in SOLUTION_CHECKS])
def test_solution_passes_its_check(version: str, check: str) -> None:
    function = getattr(H.load_check_module(version), check)
    function(H.Lab(VERSIONS / V[version], version))


@pytest.mark.slow
@pytest.mark.parametrize("version", H.LAB_VERSIONS)
def test_starter_fails_its_checks_on_its_todo_stubs_only(version: str) -> None:
    results = H.run_checks(version, STARTERS / V[version])
    failed = [r for r in results if not r.passed]
    assert failed, f"the {version} starter passes every check: its stubs test nothing"
    not_todo = [f"{r.name}: {r.error}" for r in failed if not r.todo]
    assert not not_todo, "starter checks failed for a reason other than a TODO stub:\n" + "\n".join(not_todo)
    assert all(f"TODO({version})" in r.error for r in failed)
    assert not results[-1].passed and results[-1].name == "test_run_prints_the_expected_transcript"


@pytest.mark.parametrize("version", H.LAB_VERSIONS)
def test_starters_are_the_snapshots_with_the_tasks_stubbed(version: str) -> None:
    wanted = make_starters.starter_files(version)
    folder = STARTERS / V[version]
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert present == sorted(wanted), "run checks/make_starters.py"
    for name, text in wanted.items():
        assert (folder / name).read_text() == text, f"{folder / name} is stale: run checks/make_starters.py"
    for stub in TASKS[version]:
        starter = (folder / stub.file).read_text()
        assert f'raise NotImplementedError("TODO({version}): write {stub.qualname} ' in starter
        ast.parse(starter)
    for path in (VERSIONS / V[version]).glob("*.py"):  # no stubs in the solutions
        assert "NotImplementedError" not in path.read_text() and "TODO(" not in path.read_text(), path


def test_lab_start_and_lab_check_guide_the_learner(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(lab_check, "WORK", tmp_path)
    assert lab_check.main(["check", "v01"]) == 2  # no working copy yet
    assert "./course lab-start v01" in capsys.readouterr().out
    assert lab_check.main(["start", "v01"]) == 0
    assert (tmp_path / V["v01"] / "sequence.py").exists()
    assert lab_check.main(["start", "v01"]) == 1  # never overwrites the learner's work
    capsys.readouterr()
    assert lab_check.main(["check", "v01"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "hint:" in out and "TODO(v01): write Sequence.__init__" in out
    solved = tmp_path / V["v01"]
    shutil.copy(VERSIONS / V["v01"] / "sequence.py", solved / "sequence.py")  # "write" the stubs
    assert lab_check.main(["check", "v01"]) == 0
    out = capsys.readouterr().out
    assert "5/5 checks pass" in out and "Next: ./course lab-start v02" in out
    assert lab_check.main(["check", "v05", "--starter"]) == 1
    assert "A = paging" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lab_check.main(["check", "v00"])


def test_lab_start_v10_points_to_the_reading_report(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        lab_check.main(["lab-start", "v10"])
    message = str(exc.value)
    assert "reading report" in message and "versions/v10_mapping/MAPPING.md" in message
    assert (H.VERSIONS / "v10_mapping" / "MAPPING.md").exists()
    assert "unknown version" not in message


def test_usage_errors_name_the_course_command(capsys) -> None:
    for argv in (["lab-check"], ["lab-check", "v99"], ["lab-check", "v05", "--time-limit", "soon"], []):
        with pytest.raises(SystemExit) as exc:
            lab_check.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "./course" in err and "lab_check.py" not in err, err
    with pytest.raises(SystemExit):
        lab_check.main(["lab-check", "v99"])
    assert "the labs are v01 ... v09" in capsys.readouterr().err


def test_hints_point_at_the_idea_not_at_the_code() -> None:
    """A hint says what must hold, not which line to write: no calls, attributes, indexing or
    snake_case identifiers (file names such as expected_output.txt are fine)."""
    code = re.compile(r"\b\w+\([^)]*\)|\b\w+\.\w+|\w+\[[^\]]*\]|\b[a-z]+_[a-z_]+\b")
    for version in H.LAB_VERSIONS:
        for function in H.check_functions(version):
            _, hint = H._doc_parts(function)
            assert hint, f"{version} {function.__name__} has no hint"
            prose = re.sub(r"`[^`]*`|\b[\w.]+\.(?:py|txt|md)\b", "", hint)  # commands and file names
            assert not code.findall(prose), f"{version} {function.__name__}: the hint quotes code {code.findall(prose)}"
