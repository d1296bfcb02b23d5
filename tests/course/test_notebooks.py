"""The chapters' saved outputs are fresh, small and free of widget state (template v2).

nbval (run by ``./course test``) re-executes every chapter and compares the outputs it
can; these tests check what nbval cannot see:

* every notebook stays under 1 MB and carries no saved widget state;
* a chapter's outputs were produced at a revision whose engine and widgets are today's
  (``scripts/execute_notebooks.py`` records it in ``metadata.nanoengine``);
* every source listing a chapter shows (``widgets.course.show_source``) is still the
  source of the file and lines it names, byte for byte (its SHA-256 is saved with it).
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("notebooks/solutions/*.ipynb"))
CHAPTERS = [p for p in NOTEBOOKS if re.match(r"\d\d_", p.name)]  # chapters and their solutions
LISTING = re.compile(r"class='ne-source' data-path='([^']+)' data-first-line='(\d+)' "
                     r"data-lines='(\d+)' data-sha256='([0-9a-f]{64})'")
MAX_BYTES = 1_000_000


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _outputs_html(nb: dict) -> list[str]:
    texts = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            for mime in ("text/html", "text/plain"):
                if mime in data:
                    value = data[mime]
                    texts.append("".join(value) if isinstance(value, list) else value)
    return texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_small_and_has_no_widget_state(path: Path):
    text = path.read_text()
    assert len(text.encode()) < MAX_BYTES, f"{path.name} is {len(text.encode()):,} bytes; the limit is 1 MB"
    nb = json.loads(text)
    assert "widgets" not in nb["metadata"], f"{path.name} saved widget state: re-execute it with scripts/execute_notebooks.py"
    assert "application/vnd.jupyter.widget-state+json" not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_test_instructions_are_cell_tags_not_code_a_learner_reads(path: Path):
    """nbval's instructions live in cell tags (``nbval-ignore-output``), not as a first line of code."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        assert "NBVAL" not in "".join(cell["source"]), f"{path.name} cell {i}: use the tag nbval-ignore-output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_simulator_cell_opened_before_running_says_to_run_it(path: Path):
    """Opened before running, a widget cell shows the course's 'run this cell' line (what the course's
    JupyterLab saves in its place), never the widget's Python repr; and nbval never compares it."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                text = "".join(data.get("text/plain", ""))
                if not output.get("metadata", {}).get("nanoengine_widget"):  # only a library's progress bar
                    assert not re.match(r"\s*[A-Za-z_]\w*\(", text), \
                        f"{path.name} cell {i} saved its widget's repr: re-execute it with scripts/execute_notebooks.py"
                else:
                    assert "Run this cell to bring the simulator back" in text, f"{path.name} cell {i}"
                assert "nbval-ignore-output" in cell["metadata"].get("tags", []), f"{path.name} cell {i}"


def _belongs_to_another_chapter(changed_file: str, notebook: Path) -> bool:
    """A chapter's own exercise checks and quiz (``widgets/exercises/chNN.py``,
    ``widgets/quizzes/chNN.json``) feed only chapter NN and its solution, so adding chapter
    11's checks does not make chapter 5's outputs stale. Everything else under nanoengine/,
    nanobench/ and widgets/ may feed any chapter."""
    match = re.fullmatch(r"widgets/(?:exercises/ch(\d\d)\.py|quizzes/ch(\d\d)\.json)", changed_file)
    return bool(match) and (match.group(1) or match.group(2)) != notebook.name[:2]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_outputs_come_from_todays_engine(path: Path):
    meta = json.loads(path.read_text())["metadata"].get("nanoengine")
    assert meta and meta.get("revision"), f"{path.name} has no recorded revision: run scripts/execute_notebooks.py"
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    revision = meta["revision"]
    if _git("cat-file", "-e", f"{revision}^{{commit}}").returncode != 0:
        pytest.fail(f"{path.name} was executed at {revision[:10]}, which this repository does not have")
    changed = [f for f in _git("diff", "--name-only", revision, "HEAD", "--", "nanoengine", "nanobench",
                               "widgets").stdout.split()
               if not _belongs_to_another_chapter(f, path)]
    assert not changed, (f"{path.name}'s outputs come from {revision[:10]}; since then {len(changed)} engine or "
                         f"widget files changed ({', '.join(changed[:5])}): re-execute it with "
                         f"scripts/execute_notebooks.py")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_listings_are_todays_source(path: Path):
    nb = json.loads(path.read_text())
    listings = [m.groups() for text in _outputs_html(nb) for m in LISTING.finditer(html.unescape(text))]
    if not listings:
        if "show_source(" in "".join("".join(c["source"]) for c in nb["cells"]):
            pytest.fail(f"{path.name} calls show_source but saved no listing header: re-execute it")
        pytest.skip(f"{path.name} shows no source listing")
    for shown, first, count, digest in listings:
        lines = (ROOT / shown).read_text().splitlines(keepends=True)
        start = int(first) - 1
        now = "".join(lines[start:start + int(count)])
        assert hashlib.sha256(now.encode()).hexdigest() == digest, \
            f"{path.name} shows {shown} from line {first} as it was, not as it is: re-execute it"


SKELETON = ["## Learning goals", "## The analogy", "## Myths and common mistakes", "## Quiz", "## Takeaways",
            "## Exercises"]


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.parent.name == "notebooks"], ids=lambda p: p.name)
def test_chapter_follows_the_template_skeleton(path: Path):
    """Template v2: the same headings in the same order, numbered sections between the analogy
    and the myths, and a first code cell that prepares the environment before torch loads."""
    cells = json.loads(path.read_text())["cells"]
    headings = [line for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
    named = [h for h in headings if not re.match(r"## \d+\.", h)]
    if named and named[-1] == "## References":  # course v3: a References cell closes the chapter
        named = named[:-1]
    assert named == SKELETON, f"{path.name} headings {named} differ from the template's {SKELETON}"
    sections = [i for i, h in enumerate(headings) if re.match(r"## \d+\.", h)]
    assert sections and headings.index("## The analogy") < sections[0] < sections[-1] < \
        headings.index("## Myths and common mistakes"), f"{path.name}: numbered sections must sit between"
    first_code = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "prepare_environment()" in first_code, f"{path.name}: the first code cell must be the setup cell"
    assert first_code.index("prepare_environment()") < first_code.find("import torch") or \
        "import torch" not in first_code, f"{path.name}: prepare_environment() must run before torch is imported"


def test_only_a_chapters_own_checks_and_quiz_are_exempt_from_its_freshness():
    ch5, ch5_solution = Path("notebooks/05_scheduler.ipynb"), Path("notebooks/solutions/05_scheduler.ipynb")
    assert _belongs_to_another_chapter("widgets/exercises/ch11.py", ch5)
    assert _belongs_to_another_chapter("widgets/quizzes/ch07.json", ch5_solution)
    assert not _belongs_to_another_chapter("widgets/exercises/ch05.py", ch5_solution)
    assert not _belongs_to_another_chapter("widgets/exercises/__init__.py", ch5)
    assert not _belongs_to_another_chapter("widgets/live_questions.py", ch5)
    assert not _belongs_to_another_chapter("nanoengine/engine/scheduler.py", ch5)


def test_a_listing_of_a_decorated_method_is_its_own_file():
    """``show_source`` of a method under ``@torch.inference_mode()`` lists the engine's file, not torch's wrapper."""
    from nanoengine.engine.model_runner import SamplingRunner
    from widgets.course import source_of

    text, shown, first = source_of(SamplingRunner.execute_model)
    lines = (ROOT / shown).read_text().splitlines(keepends=True)
    assert shown == "nanoengine/engine/model_runner.py"
    assert text == "".join(lines[first - 1:first - 1 + text.count("\n")])
    assert "def execute_model(" in text
