"""scripts/build_site.py without a browser or Sphinx: what it collects, what it refuses, and
what each notebook becomes on the page (tests/browser/test_site.py builds and crawls the site).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"


def _copy_course(tmp_path: Path) -> Path:
    """The index and the notebooks it links to, in a scratch repository layout."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return root


@pytest.mark.slow
def test_pages_come_from_the_index_in_its_order(build_site) -> None:
    pages = build_site.collect_pages(REPO)
    index = (REPO / "notebooks" / "README.md").read_text(encoding="utf-8")
    table = re.findall(r"^\| *\d+ *\| *\[[^\]]+\]\((\d\d_[\w-]+\.ipynb)\)", index, re.M)
    chapters = [p.path.name for p in pages if p.section == "Chapters"]
    assert chapters == table and len(chapters) >= 12
    solutions = [p.path for p in pages if p.section == "Worked solutions"]
    assert [s.name for s in solutions] == chapters and all(s.parent.name == "solutions" for s in solutions)
    rest = [str(p.path) for p in pages if p.section == "Labs and simulators"]
    assert rest == ["labs/nano-vllm/README.md", "notebooks/widgets_demo.ipynb"]


@pytest.mark.parametrize("damage", ["strip outputs", "never executed"])
def test_an_unexecuted_notebook_is_named_with_the_command_and_nothing_is_built(build_site, tmp_path, damage) -> None:
    root = _copy_course(tmp_path)
    victim = root / "notebooks" / "07_prefix_caching.ipynb"
    nb = json.loads(victim.read_text(encoding="utf-8"))
    if damage == "strip outputs":  # what nbstripout or "Clear all outputs" + save leave
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
    else:
        del nb["metadata"]["nanoengine"]
    victim.write_text(json.dumps(nb), encoding="utf-8")
    out = tmp_path / "site"
    out.mkdir()
    (out / "index.html").write_text("the previous site")
    with pytest.raises(build_site.SiteError) as error:
        build_site.build(out, root=root)
    message = str(error.value)
    assert "notebooks/07_prefix_caching.ipynb" in message
    assert "scripts/execute_notebooks.py notebooks/07_prefix_caching.ipynb" in message
    assert "nothing was built" in message
    assert "03_kv_cache" not in message  # only the notebook at fault is named
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "site"]  # no build directory left behind
    assert [p.name for p in out.iterdir()] == ["index.html"] and (out / "index.html").read_text() == "the previous site"


def test_a_missing_index_or_chapter_is_named(build_site, tmp_path) -> None:
    with pytest.raises(build_site.SiteError, match="notebooks/README.md not found"):
        build_site.collect_pages(tmp_path)
    root = _copy_course(tmp_path)
    (root / "notebooks" / "12_serving.ipynb").unlink()
    with pytest.raises(build_site.SiteError, match=r"notebooks/12_serving.ipynb: linked from .* but not found"):
        build_site.collect_pages(root)


def _outputs(nb: dict) -> list[dict]:
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def _html(output: dict) -> str:
    text = output.get("data", {}).get("text/html", "")
    return "".join(text) if isinstance(text, list) else text


def test_a_chapter_page_gets_provenance_static_widgets_and_drawable_figures(build_site) -> None:
    path = Path("notebooks/07_prefix_caching.ipynb")
    original = json.loads((REPO / path).read_text(encoding="utf-8"))
    staged = build_site.stage_notebook(REPO, path, build_site._widget_docs(REPO))
    # every widget view replaced by a static view, every figure by HTML that draws it
    widgets = sum(WIDGET_VIEW in o.get("data", {}) for o in _outputs(original))
    figures = sum(PLOTLY in o.get("data", {}) for o in _outputs(original))
    assert widgets and figures
    staged_outputs = _outputs(staged)
    assert not any(WIDGET_VIEW in o.get("data", {}) or PLOTLY in o.get("data", {}) for o in staged_outputs)
    assert sum("class='ne-static" in _html(o) for o in staged_outputs) == widgets
    assert sum("Plotly.newPlot" in _html(o) for o in staged_outputs) == figures
    assert len(staged_outputs) == len(_outputs(original))  # nothing else dropped
    # the code a reader sees is the notebook's, unchanged (nbval's instructions are cell tags)
    assert len(staged["cells"]) == len(original["cells"])
    code = [("".join(a["source"]), "".join(b["source"])) for a, b in zip(original["cells"], staged["cells"])
            if a["cell_type"] == "code"]
    assert code and all(before == after and "NBVAL" not in after for before, after in code)
    # the provenance, under the title, from the notebook's own metadata
    meta = original["metadata"]["nanoengine"]
    first = "".join(next(c for c in staged["cells"] if c["cell_type"] == "markdown")["source"])
    title_line, rest = first.split("\n", 1)
    assert title_line.startswith("# Chapter 7")
    assert meta["machine"] in rest.split(":::")[1] and meta["executed"][:10] in rest


def test_a_progress_bar_widget_is_a_note_not_a_simulator(build_site) -> None:
    path = Path("notebooks/11_benchmarks.ipynb")
    original = json.loads((REPO / path).read_text(encoding="utf-8"))
    bars = [o for o in _outputs(original) if WIDGET_VIEW in o.get("data", {})
            and "%|" in "".join(o["data"].get("text/plain", ""))]
    if not bars:
        pytest.skip("chapter 11 shows no progress bar today")
    staged = build_site.stage_notebook(REPO, path, build_site._widget_docs(REPO))
    notes = [_html(o) for o in _outputs(staged) if "ne-widget-note" in _html(o)]
    assert len(notes) == len(bars) and all("a progress bar (" in n for n in notes)
    assert not any("Simulator: <code>widget" in _html(o) for o in _outputs(staged))


def test_the_quiz_view_lists_every_question_and_option_and_marks_no_answer(build_site) -> None:
    view = build_site.quiz_view(7, "Quiz(7, live=[prefix_hit_question(x)])", Path("notebooks/07_prefix_caching.ipynb"),
                                  "Chapter 7: Prefix caching")
    quiz = json.loads((REPO / "widgets" / "quizzes" / "ch07.json").read_text(encoding="utf-8"))
    code = build_site._rst_code
    for question in quiz["questions"]:
        assert code(question["question"]) in view
        for option in question["options"]:
            assert code(option["text"]) in view
            assert code(option["explanation"]) not in view
        # alphabetical, whatever the file's order (the author's, which could hint at the answer)
        positions = [view.index(f"<li>{code(o['text'])}</li>") for o in question["options"]]
        texts = [o["text"] for _, o in sorted(zip(positions, question["options"]), key=lambda p: p[0])]
        assert texts == sorted(texts, key=str.casefold)
    assert "correct" not in view.lower() and "right:" not in view.lower()
    assert "1 question built from the live engine" in view
    assert "./course lab" in view and "notebooks/07_prefix_caching.ipynb" in view


def test_the_build_imports_no_engine() -> None:
    """Reading needs no torch: a fresh clone installs only requirements-site.txt."""
    import subprocess

    script = ("import sys, runpy; sys.argv = ['build_site', '--help']; "
              "mod = runpy.run_path('scripts/build_site.py', run_name='not_main'); "
              "from pathlib import Path; "
              "mod['stage_notebook'](Path('.'), Path('notebooks/07_prefix_caching.ipynb'), mod['_widget_docs'](Path('.'))); "
              "mod['collect_pages'](Path('.')); "
              "print(sorted(m for m in ('torch', 'nanoengine', 'widgets', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_live_only_demo_gets_a_static_view_per_simulator(build_site) -> None:
    path = Path("notebooks/widgets_demo.ipynb")
    staged = build_site.stage_notebook(REPO, path, build_site._widget_docs(REPO))
    views = [_html(o) for o in _outputs(staged)]
    for name in ("SamplingPlayground", "SchedulerStepper", "BlockAllocatorView", "MemoryEstimator", "TokenEditor"):
        assert sum(f"<code>{name}</code>" in v for v in views) == 1, name
    assert sum("Quiz: chapter 8" in v for v in views) == 1
    assert all("./course lab" in v for v in views)
    assert "no saved outputs" in "".join("".join(c["source"]) for c in staged["cells"] if c["cell_type"] == "markdown")


def test_site_requirements_are_pinned_and_repin_nothing_of_the_course() -> None:
    def pins(name: str) -> dict[str, str | None]:
        lines = [line.split("#")[0].strip().lower() for line in (REPO / name).read_text().splitlines()]
        return {line.split("==")[0]: (line.split("==")[1] if "==" in line else None) for line in lines if line}

    site, course = pins("requirements-site.txt"), pins("requirements.txt")
    assert site
    for name, version in site.items():
        if name in course:  # the course's pin wins (requirements.txt is the constraints file)
            assert version is None, f"{name} is pinned in requirements.txt: list it without a version"
        else:
            assert version, f"{name} is not pinned"
    assert "/site/" in (REPO / ".gitignore").read_text().splitlines()
