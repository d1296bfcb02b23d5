"""Tests for the build-it-yourself track ``labs/nano-vllm`` (snapshots, labs and reports).

What is checked here:

- every snapshot (v00-v09, v11, v12) runs as a script (``python .../run.py``) and prints exactly its
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
    "v11": [r"drafts \[[\d, ]+\] accepted [1-9]/\d", r"blocks freed \[\d+", r"tokens per verify: 1\.[1-9]",
            r"greedy output equals v09's decode token for token: True", r"same seed -> same output: True"],
    "v12": [r"allowed \[\d+(, \d+)+\]/64", r"\(cut [1-9]\)", r"FINISHED \(stop\) -> 'yes'",
            r"\[stop\] re\.fullmatch: True", r"\[length\] ran out of tokens",
            r"greedy output equal with and without speculation: True",
            r"after every step each machine held exactly its accepted tokens: True"],
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
    assert "the labs are v01 ... v09, v11 and v12" in capsys.readouterr().err


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


# -------------------------------------------------------------------------- mutations

MUTATIONS = {  # name: (version, file, original text, mutated text, the check that must fail)
    "v04-static-batching": (
        "v04", "scheduler.py",
        "while self.waiting and len(self.running) < self.max_num_seqs:",
        "while self.waiting and (scheduled or not self.running) and len(self.running) < self.max_num_seqs:",
        "test_a_freed_slot_is_refilled_while_others_still_decode"),
    "v05-evict-the-oldest": (
        "v05", "scheduler.py",
        "victim = self.running.pop() if self.running else seq",
        "victim = self.running.popleft() if self.running else seq",
        "test_c_the_victim_is_the_newest_running_request"),
    "v08-no-temperature": (
        "v08", "sampler.py",
        "scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)",
        "scaled = logits",
        "test_temperature_reshapes_the_distribution"),
    "v07-unchained-hash": (
        "v07", "block_manager.py",
        'h.update(parent_hash.to_bytes(8, "little", signed=True))',
        "pass",
        "test_block_hashes_are_chained"),
    # v11 (a) roll-back: each wrong answer must fail test_roll_back_keeps_only_accepted_tokens
    "v11-rejected-blocks-kept": (
        "v11", "block_manager.py",
        "keep = -(-num_tokens // self.block_size)",
        "keep = len(seq.block_table)",
        "test_roll_back_keeps_only_accepted_tokens"),
    "v11-computed-counted-after-append": (
        "v11", "scheduler.py",
        "        seq.num_computed_tokens = len(seq)\n        seq.append_token(token_id)",
        "        seq.append_token(token_id)\n        seq.num_computed_tokens = len(seq)",
        "test_roll_back_keeps_only_accepted_tokens"),
    "v11-rejected-drafts-counted": (
        "v11", "scheduler.py",
        "        seq.num_computed_tokens = len(seq)\n        seq.append_token(token_id)",
        "        seq.num_computed_tokens = len(seq) + len(seq.draft_token_ids)\n        seq.append_token(token_id)",
        "test_roll_back_keeps_only_accepted_tokens"),
    # v11 (b) acceptance: each biased rule must fail test_sampled_acceptance_leaves_the_distribution_unchanged
    "v11-always-accept": (
        "v11", "rejection_sampler.py",
        "if float(torch.rand((), generator=generator)) < float(p[draft]):",
        "if True:",
        "test_sampled_acceptance_leaves_the_distribution_unchanged"),
    "v11-resample-without-removing-the-draft": (
        "v11", "rejection_sampler.py",
        "residual[draft] = 0.0",
        "pass",
        "test_sampled_acceptance_leaves_the_distribution_unchanged"),
    "v11-judged-against-the-wrong-row": (
        "v11", "rejection_sampler.py",
        "p = probs[i]  #",
        "p = probs[i + 1]  #",
        "test_sampled_acceptance_leaves_the_distribution_unchanged"),
    # v11 (c) greedy output: each must fail test_greedy_output_equals_v09_token_for_token
    "v11-greedy-emits-the-draft": (
        "v11", "rejection_sampler.py",
        "emitted.append(target)  # equal to the draft when it is kept",
        "emitted.append(draft)",
        "test_greedy_output_equals_v09_token_for_token"),
    "v11-drafts-one-position-late": (
        "v11", "model_runner.py",
        "positions.extend(range(start, start + len(rows)))",
        "positions.extend([start] + list(range(start + 2, start + len(rows) + 1)))",
        "test_greedy_output_equals_v09_token_for_token"),
    "v11-greedy-compares-the-next-row": (
        "v11", "rejection_sampler.py",
        "for draft, target in zip(draft_token_ids, target_token_ids):",
        "for draft, target in zip(draft_token_ids, target_token_ids[1:]):",
        "test_greedy_output_equals_v09_token_for_token"),
    # v12 (a) the machine holds drafts: each must fail test_the_machine_advances_only_with_accepted_tokens
    "v12-drafts-advance-the-machine": (
        "v12", "scheduler.py",
        "            drafts = seq.grammar.validate_tokens(drafts)\n",
        "            drafts = seq.grammar.validate_tokens(drafts)\n            seq.grammar.accept_tokens(drafts)\n",
        "test_the_machine_advances_only_with_accepted_tokens"),
    "v12-draft-rows-not-rolled-back": (
        "v12", "structured_output.py",
        "            grammar.rollback(len(drafts))",
        "            pass",
        "test_the_machine_advances_only_with_accepted_tokens"),
    # v12 (b) the mask: each must fail a check on what can be produced
    "v12-every-row-gets-the-first-mask": (
        "v12", "structured_output.py",
        "grammar.fill_bitmask(bitmask, row + i)",
        "grammar.fill_bitmask(bitmask, row)",
        "test_verify_rows_get_the_mask_after_their_drafts"),
    "v12-eos-allowed-anywhere": (
        "v12", "structured_output.py",
        "return None if self.fsm.accepts(state) else frozenset()",
        "return None",
        "test_constrained_outputs_satisfy_their_constraints"),
    "v12-mask-never-applied": (
        "v12", "model_runner.py",
        "logits = apply_grammar_bitmask(logits, grammar_bitmask)",
        "logits = logits",
        "test_masks_come_before_temperature_and_top_k"),
    "v12-drafts-not-validated": (
        "v12", "scheduler.py",
        "            drafts = seq.grammar.validate_tokens(drafts)\n",
        "            pass\n",
        "test_greedy_output_is_the_same_with_and_without_speculation"),
    "v12-refusal-ignored": (
        "v12", "scheduler.py",
        "if seq.grammar is not None and not seq.grammar.accept_tokens([token_id]):",
        "if seq.grammar is not None and not seq.grammar.accept_tokens([token_id]) and False:",
        "test_a_token_the_machine_refuses_is_an_engine_bug"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_mutation_of_the_idea_fails_a_check(name: str, tmp_path: Path) -> None:
    version, file_name, original, mutated, check = MUTATIONS[name]
    copy = tmp_path / V[version]
    shutil.copytree(VERSIONS / V[version], copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / file_name).read_text()
    assert source.count(original) == 1, f"the mutation no longer applies to {file_name}"
    (copy / file_name).write_text(source.replace(original, mutated))
    function = getattr(H.load_check_module(version), check)
    result = H.run_check(function, H.Lab(copy, version))
    assert not result.passed, f"{name}: {check} still passes"


# ------------------------------------------------------------------- snapshot layout

@pytest.mark.parametrize("version", sorted(V))
def test_every_snapshot_has_notes_with_run_diff_and_task(version: str) -> None:
    notes = (VERSIONS / V[version] / "NOTES.md").read_text()
    assert f"`python labs/nano-vllm/versions/{V[version]}/run.py`" in notes
    if version == "v00":
        assert "Nothing to diff against" in notes and "specification" in notes
        assert "lab-check" not in notes  # v00 is read, not built: there is nothing to stub
        return
    previous = V[max(v for v in V if v < version)]  # v11 builds on v09 (v10 is a report), v12 on v11
    command = f"diff -ru -x __pycache__ labs/nano-vllm/versions/{previous} labs/nano-vllm/versions/{V[version]}"
    assert command in notes
    task = notes.split("**Your task.**", 1)[1]
    assert f"./course lab-start {version}" in task and f"./course lab-check {version}" in task
    for stub in TASKS[version]:
        assert f"`{stub.qualname}`" in task, f"{version} notes do not name the stub {stub.qualname}"
    for part, title in PARTS.get(version, {}).items():
        assert f"Part {part}" in task


def test_unchanged_files_are_byte_identical_to_the_version_named_in_their_header() -> None:
    """Snapshot convention: a module's docstring starts with the version that last changed it."""
    checked = 0
    for path in sorted(VERSIONS.glob("v*/*.py")):
        match = re.match(r'"""(v\d\d) - ', path.read_text())
        assert match, f"{path} must start with a docstring naming its version"
        origin = V[match.group(1)]
        assert match.group(1) <= path.parent.name[:3], f"{path} names a later version"
        if origin != path.parent.name:
            assert path.read_bytes() == (VERSIONS / origin / path.name).read_bytes(), path
            checked += 1
    assert checked >= 10


def test_readme_documents_the_track_and_the_labs() -> None:
    readme = (LAB / "README.md").read_text()
    for folder in V.values():
        assert folder in readme
    assert "versions/v10_mapping/MAPPING.md" in readme and "versions/v10_mapping/CODE_MAP.md" in readme
    for command in ("./course lab-start v01", "./course lab-check v01", "NANO_VLLM_LAB_DIR",
                    "checks/make_starters.py"):
        assert command in readme


def test_v00_naive_loop_stops_on_eos_or_budget() -> None:
    run = H.Lab(VERSIONS / V["v00"]).load("run").run
    completion = run.generate([5, 9, 13, 2, 8], max_tokens=10)
    assert completion == [40, 12, 37, 0]  # stops at EOS (0) before the budget
    assert len(run.generate([7, 7, 1], max_tokens=10)) == 10
    assert run.toy_next_token([5, 9, 13, 2, 8]) == 40


def test_v09_does_not_import_nanoengine() -> None:
    for path in (VERSIONS / V["v09"]).glob("*.py"):
        assert "nanoengine" not in path.read_text(), path
    before = {name for name in sys.modules if name.startswith("nanoengine")}
    H.Lab(VERSIONS / V["v09"]).load("llm_engine", "run")
    assert {name for name in sys.modules if name.startswith("nanoengine")} == before


# ------------------------------------------------------------- v10: the mapping reports

CITATION = re.compile(r"(?:(v\d\d) )?`([\w/.]+\.py)` :: ((?:`[\w.]+`(?:,\s+)?)+)")
NANOENGINE_CITATION = re.compile(r"`(nanoengine/[\w/]+\.py)` \(((?:`[\w.]+`(?:,\s+)?)+)\)")


def _names(cell: str) -> list[str]:
    return re.findall(r"`([\w.]+)`", cell)


def _defined_names(source: str) -> set[str]:
    """Top-level functions, classes and assignments; 'Class.member' for methods,
    class attributes and ``self.x = ...`` assignments."""
    names: set[str] = set()

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return node.targets
        return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item in node.body:
                    names.add(f"{node.name}.{item.name}")
                for target in targets(item):
                    if isinstance(target, ast.Name) and item in node.body:
                        names.add(f"{node.name}.{target.id}")
                    elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                          and target.value.id == "self"):
                        names.add(f"{node.name}.{target.attr}")
        else:
            names.update(t.id for t in targets(node) if isinstance(t, ast.Name))
    return names


def _resolves(name: str, defined: set[str]) -> bool:
    """``A.b`` must be defined as such; a bare ``b`` is top-level or a member of some class."""
    return name in defined or ("." not in name and any(d.endswith(f".{name}") for d in defined))


def _nanovllm_index() -> tuple[str, dict[str, set[str]]]:
    text = (MAPPING_DIR / "nanovllm_names.txt").read_text()
    pin = re.search(r"^# pinned: (.+)$", text, re.M)
    assert pin, "nanovllm_names.txt must start with '# pinned: <revision>'"
    index = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            path, names = line.split(":", 1)
            index[path.strip()] = set(names.split())
    return pin.group(1).strip(), index


def test_mapping_reports_cite_only_names_that_exist() -> None:
    pin, index = _nanovllm_index()
    checked = {"nano-vLLM": 0, "track": 0, "nanoengine": 0}
    for report in ("MAPPING.md", "CODE_MAP.md"):
        text = (MAPPING_DIR / report).read_text()
        for version, path, cell in CITATION.findall(text):
            names = _names(cell)
            if path.startswith("nanovllm/"):
                assert path in index, f"{report} cites {path}, which is not in nanovllm_names.txt"
                missing = [n for n in names if not _resolves(n, index[path])]
                assert not missing, f"{report}: {path} has no {missing} at {pin}"
                checked["nano-vLLM"] += len(names)
            else:
                assert version, f"{report}: a track citation of {path} must name its version (vNN `file`)"
                source = VERSIONS / V[version] / path
                assert source.exists(), f"{report} cites {version} {path}, which does not exist"
                defined = _defined_names(source.read_text())
                missing = [n for n in names if not _resolves(n, defined)]
                assert not missing, f"{report}: {version} {path} defines no {missing}"
                checked["track"] += len(names)
        for path, cell in NANOENGINE_CITATION.findall(text):
            source = ROOT / path
            assert source.exists(), f"{report} cites {path}, which does not exist"
            defined = _defined_names(source.read_text())
            missing = [n for n in _names(cell) if not _resolves(n, defined)]
            assert not missing, f"{report}: {path} defines no {missing}"
            checked["nanoengine"] += len(_names(cell))
    assert checked["nano-vLLM"] >= 60 and checked["track"] >= 30 and checked["nanoengine"] >= 5, checked


def test_mapping_is_pinned_and_covers_every_snapshot() -> None:
    pin, index = _nanovllm_index()
    mapping = (MAPPING_DIR / "MAPPING.md").read_text()
    code_map = (MAPPING_DIR / "CODE_MAP.md").read_text()
    assert pin in mapping and pin in code_map, "both reports must state the pinned nano-vLLM revision"
    sections = re.split(r"^## ", mapping, flags=re.M)
    for folder in V.values():
        section = next((s for s in sections if s.startswith(folder)), None)
        assert section is not None, f"MAPPING.md has no section for {folder}"
        assert CITATION.search(section), f"the {folder} section cites no file :: name"
    for original in ("nanovllm/engine/scheduler.py", "nanovllm/engine/block_manager.py",
                     "nanovllm/engine/model_runner.py", "nanovllm/layers/attention.py"):
        assert f"`{original}` ::" in mapping and f"`{original}` ::" in code_map
    assert "nanovllm/engine/block_manager.py" in index and "BlockManager.hash_blocks" in index[
        "nanovllm/engine/block_manager.py"]


def test_after_v09_comes_v11_and_the_report_is_named() -> None:
    assert "./course lab-start v11" in lab_check._next_step("v09") and "v10_mapping" in lab_check._next_step("v09")
    assert lab_check._next_step("v11") == "Next: ./course lab-start v12"
    assert "last lab" in lab_check._next_step("v12") and "v10_mapping" in lab_check._next_step("v12")
    assert lab_check._next_step("v04") == "Next: ./course lab-start v05"
