"""Execute the chapters at the current revision and save them with their provenance.

    .venv/bin/python scripts/execute_notebooks.py                 # every chapter and solution
    .venv/bin/python scripts/execute_notebooks.py notebooks/03_kv_cache.ipynb

Committed outputs must come from the code they sit beside (template v2, "fresh outputs").
This runs each notebook top to bottom in a fresh kernel, with OpenMP's threads as a
learner's kernel gets them (spinning while idle; run it on a quiet machine: ``./course test``
makes them sleep, for shared CI machines), then, before saving:

* drops saved widget state (``metadata.widgets``): it is megabytes of JSON, and the views it
  describes do not survive a kernel restart. Each simulator's output keeps its widget view (the
  site's build draws a static card for it, named in the output's metadata) but its plain-text
  fallback, what JupyterLab shows for it before the cell runs, becomes the line the course's
  JupyterLab saves in its place ("Run this cell to bring the simulator back",
  ``jupyter/course_hooks.py``), not the widget's Python repr;
* records ``metadata.nanoengine``: the git revision the outputs come from, the date, the
  machine, and how long the run took (the 90 s budget of template v2);
* refuses to save a notebook over 1 MB.

Run it on a clean working tree (commit first), so the recorded revision holds the code
that produced the outputs; ``tests/course/test_notebooks.py`` checks the revision against HEAD.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 1_000_000
SOURCE_DIRS = ("nanoengine", "nanobench", "widgets")  # what the outputs depend on


def mark_widget_views(nb) -> int:
    """Give each simulator's widget view the course's "run this cell" line as its plain text, and its
    class name (read by ``build_site.widget_name``) as ``metadata.nanoengine_widget``; returns how
    many there were. A view whose repr names no class (a library's progress bar) keeps its text,
    which the site describes. Every such cell is one nbval does not compare
    (tests/course/test_notebooks.py checks it)."""
    import importlib.util

    from build_site import widget_name

    spec = importlib.util.spec_from_file_location("course_hooks", ROOT / "jupyter" / "course_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    marked = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if hooks.WIDGET_VIEW in data and (name := widget_name(output)) != "widget":
                output.setdefault("metadata", {})["nanoengine_widget"] = name
                data["text/plain"] = hooks.RERUN_NOTE
                marked += 1
    return marked


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def execute(path: Path, revision: str, timeout: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   record_timing=False).execute()
    seconds = time.perf_counter() - start
    nb.metadata.pop("widgets", None)
    mark_widget_views(nb)
    from widgets.course import machine_description

    nb.metadata["nanoengine"] = {
        "revision": revision, "executed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_description(), "seconds": round(seconds, 1)}
    text = nbformat.writes(nb) + "\n"
    if len(text.encode()) > MAX_BYTES:
        raise SystemExit(f"{path.name} would be {len(text.encode()):,} bytes, over {MAX_BYTES:,}: trim its outputs")
    path.write_text(text)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/[0-9][0-9]_*.ipynb")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    parser.add_argument("--allow-dirty", action="store_true", help="run with uncommitted engine/widget changes")
    args = parser.parse_args(argv)
    dirty = git("status", "--porcelain", "--", *SOURCE_DIRS)
    if dirty and not args.allow_dirty:
        raise SystemExit(f"uncommitted changes under {', '.join(SOURCE_DIRS)}: commit first, so the recorded "
                         f"revision holds the code behind the outputs\n{dirty}")
    revision = git("rev-parse", "HEAD")
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted(
        (ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        seconds = execute(path.resolve(), revision, args.timeout)
        print(f"{path.name}: {seconds:.1f} s at {revision[:10]}")
    rebuild_translations()
    return 0


def rebuild_translations() -> None:
    """The translated notebooks carry the English notebooks' outputs: rebuild them now, or say
    which units stop it (docs/TRANSLATING.md)."""
    import translations

    for lang in translations.LANGUAGES[1:]:
        if problems := translations.problems(lang):
            print(f"{lang}: not rebuilt, {len(problems)} units have no translation of today's English "
                  f"(python -m translations check --lang {lang})")
        else:
            print(f"{lang}: rebuilt {len(translations.build(lang))} translated notebooks and documents")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # and scripts/ is sys.path[0], for build_site
    raise SystemExit(main())
