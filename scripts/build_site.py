"""Build the course as a static website in ``site/``, from the committed, executed notebooks.

    .venv/bin/python scripts/build_site.py            # what ./course site runs
    .venv/bin/python scripts/build_site.py --serve    # then serve it on http://127.0.0.1:8000

Nothing is executed: every output on the site is the one saved in the notebook by
``scripts/execute_notebooks.py``, with the machine and date it was measured on. The tool is
Sphinx with MyST-NB (``nb_execution_mode = "off"``) and the Sphinx Book Theme, the stack
Jupyter Book 1 is built on; docs/SITE.md says why, and what each kind of output becomes.

The build runs in four steps, and the first one can stop it before anything is written:

1. **Collect** the pages in reading order, from the course index (``notebooks/README.md``):
   the chapters in the order of its table, their worked solutions, the nano-vLLM lab's README
   (with its versions' and starters' notes) and the widgets demo. A chapter or solution that
   was never executed, or whose outputs were stripped, stops the build here with its name
   and the command that executes it.
2. **Stage** a Sphinx source tree in a temporary directory: the index becomes the home page
   (its links re-rooted), each notebook gets a line naming where its outputs come from, every
   live widget output (whose view does not exist outside a kernel) becomes a static view,
   and every plotly figure becomes HTML that draws it with the plotly.js shipped in the
   plotly package (no CDN: the site works offline).
3. **Build** with Sphinx into a temporary directory next to ``site/``.
4. **Swap** the new build in place of ``site/`` only once it is complete: a failed build
   leaves the previous site as it was.

The site's own packages (``requirements-site.txt``) are installed into ``.venv`` on first
use, with ``requirements.txt`` as constraints so that nothing the course pins moves, and a
stamp (``.venv/.requirements-site.sha``) so that later builds skip the step.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE_SRC = ROOT / "docs" / "site_src"  # conf.py and the site's static files
INDEX = Path("notebooks/README.md")
LABS = Path("labs/nano-vllm")
# Committed without outputs on purpose (tests/course/test_widgets_notebook.py): every cell is a live
# simulator, so the page shows static views of them and says how to run them.
LIVE_ONLY = {Path("notebooks/widgets_demo.ipynb")}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"
MIN_PYTHON = (3, 11)  # Sphinx 9, MyST-Parser 5 and the book theme require it
EXECUTE = "PYTHONPATH=$PWD .venv/bin/python scripts/execute_notebooks.py"


class SiteError(Exception):
    """Bad input: the message says what is wrong and how to fix it; nothing was built."""


@dataclass(frozen=True)
class Page:
    path: Path  # relative to the repository root
    section: str  # the sidebar caption it is listed under


# ---------------------------------------------------------------------------------------
# 1. collect


def _index_links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s#]+\.ipynb)\)", text)


def collect_pages(root: Path = ROOT) -> list[Page]:
    """The site's pages in reading order, read from the course index.

    Raises ``SiteError`` naming every chapter or solution that cannot be published as it is
    (missing, never executed, outputs stripped), and how to execute it.
    """
    index = root / INDEX
    if not index.is_file():
        raise SiteError(f"{INDEX} not found: the site's home page and table of contents come from it")
    links = _index_links(index.read_text(encoding="utf-8"))
    chapters = [link for link in links if re.fullmatch(r"\d\d_[\w-]+\.ipynb", link)]
    solutions = [link for link in links if re.fullmatch(r"solutions/\d\d_[\w-]+\.ipynb", link)]
    others = [link for link in links if link not in chapters and link not in solutions]
    if not chapters:
        raise SiteError(f"{INDEX} links to no chapter (a link such as [title](01_name.ipynb)): nothing to publish")
    pages = [Page(Path("notebooks") / c, "Chapters") for c in dict.fromkeys(chapters)]
    pages += [Page(Path("notebooks") / s, "Worked solutions") for s in sorted(set(solutions))]
    if (root / LABS / "README.md").is_file():
        pages.append(Page(LABS / "README.md", "Labs and simulators"))
    pages += [Page(Path("notebooks") / o, "Labs and simulators") for o in dict.fromkeys(others)]
    problems = [problem for page in pages if (problem := notebook_problem(root, page.path))]
    if problems:
        raise SiteError("cannot build the site, nothing was built (site/ is unchanged):\n"
                        + "\n".join(f"  - {p}" for p in problems))
    return pages


def notebook_problem(root: Path, path: Path) -> str | None:
    """Why ``path`` cannot be published with its saved outputs, or None when it can."""
    if path.suffix != ".ipynb":
        return None
    how = f"execute it with `{EXECUTE} {path}` (commit first), then run ./course site again"
    if not (root / path).is_file():
        return f"{path}: linked from {INDEX} but not found"
    try:
        nb = json.loads((root / path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path}: not a readable notebook ({exc})"
    if path in LIVE_ONLY:
        return None
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    meta = nb.get("metadata", {}).get("nanoengine") or {}
    if not meta.get("executed") or not meta.get("machine"):
        return f"{path}: never executed by scripts/execute_notebooks.py (no metadata.nanoengine): {how}"
    unrun = [i for i, c in enumerate(code, 1) if c.get("execution_count") is None]
    if code and (unrun or not any(c.get("outputs") for c in code)):
        what = "has no saved outputs" if len(unrun) == len(code) else f"has code cells with no saved run ({len(unrun)} of {len(code)}, first: code cell {unrun[0]})"
        return f"{path}: {what}, its outputs were stripped or it was not run to the end: {how}"
    return None


# ---------------------------------------------------------------------------------------
# 2. stage


def _widget_docs(root: Path) -> dict[str, str]:
    """First paragraph of each widget class's docstring, read from widgets/*.py without
    importing them (the reader sees what the simulator is, in the words of its source)."""
    docs: dict[str, str] = {}
    for source in sorted((root / "widgets").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and (doc := ast.get_docstring(node)):
                docs.setdefault(node.name, " ".join(doc.split("\n\n")[0].split()))
    return docs


def _live_line(path: Path, title: str) -> str:
    return (f"<p class='ne-run-live'>Run it live: <code>./course lab</code>, open "
            f"<code>{html.escape(str(path))}</code> ({html.escape(title)}) and run the cell.</p>")


def _rst_code(text: str) -> str:
    """Markdown-ish inline code (``x``/`x`) in docstrings and quiz text, as HTML."""
    return re.sub(r"``?([^`]+)``?", r"<code>\1</code>", html.escape(text))


def quiz_view(chapter: int, source: str, path: Path, title: str, root: Path = ROOT) -> str:
    """The chapter's quiz, read from ``widgets/quizzes/chNN.json``: every question and its
    options, with no answer marked and no explanation (they would give it away).

    Options are listed in alphabetical order: the file's own order is the author's, and a
    position could hint at the answer. (The widget shuffles them with a seed of its own,
    ``widgets.quiz.shuffle_options``; calling it would import the engine and torch, which
    the site's build does not need.)
    """
    file = root / "widgets" / "quizzes" / f"ch{chapter:02d}.json"
    try:
        quiz = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SiteError(f"{path}: its quiz cell reads {file.relative_to(root)}, which cannot be read ({exc})") from exc
    parts = [f"<div class='ne-static ne-static-quiz'><p class='ne-static-title'>Quiz: chapter {chapter}, "
             f"{html.escape(quiz.get('title', title))}</p><ol>"]
    for question in quiz["questions"]:
        texts = sorted((o["text"] for o in question["options"]), key=str.casefold)
        options = "".join(f"<li>{_rst_code(text)}</li>" for text in texts)
        parts.append(f"<li><p>{_rst_code(question['question'])}</p><ul class='ne-quiz-options'>{options}</ul></li>")
    parts.append("</ol>")
    live = len(re.findall(r"_question\(", source))
    if "live=" in source and live:
        parts.append(f"<p>In the notebook the quiz also asks {live} question{'s' * (live > 1)} built from the live "
                     "engine when the cell runs (its numbers come from that run), and checks each answer with an "
                     "explanation.</p>")
    else:
        parts.append("<p>In the notebook each answer is checked, with an explanation.</p>")
    parts.append(_live_line(path, title) + "</div>")
    return "".join(parts)


def simulator_view(name: str, docs: dict[str, str], path: Path, title: str, saved: bool) -> str:
    """A static card for a live simulator whose view the notebook does not keep."""
    about = docs.get(name, "an interactive view over the live engine")
    state = ("Its live view is not stored in the notebook (scripts/execute_notebooks.py drops widget state); "
             "the cells around it print what it measured." if saved else
             "This page's notebook is committed without outputs: the simulator exists only in a running kernel.")
    return (f"<div class='ne-static ne-static-simulator'><p class='ne-static-title'>Simulator: "
            f"<code>{html.escape(name)}</code></p><p>{_rst_code(about)}</p><p>{state}</p>{_live_line(path, title)}</div>")


def other_widget_note(output: dict) -> str:
    """One line for a widget that is not the course's (a library's progress bar, most often):
    its saved text is its state when it appeared (a progress bar at 0%), so it is not shown."""
    text = output.get("data", {}).get("text/plain", "")
    text = ("".join(text) if isinstance(text, list) else text).strip()
    bar = re.match(r"(.*?):?\s*\d+%\|", text)
    what = f"a progress bar ({html.escape(bar.group(1).strip())})" if bar else "a live widget"
    return f"<p class='ne-widget-note'><em>[{what} showed here while the cell ran]</em></p>"


def _html_output(text: str) -> dict:
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": text}}


def plotly_html(figure: dict, div_id: str) -> str:
    """A plotly figure as a div plus the call that draws it (plotly.js is loaded by the page)."""
    spec = json.dumps({"data": figure.get("data", []), "layout": figure.get("layout", {}),
                       "config": {"responsive": True}}, separators=(",", ":")).replace("</", "<\\/")
    return (f"<div id='{div_id}' class='ne-plotly'></div><script>(function(){{var s={spec};"
            f"Plotly.newPlot('{div_id}',s.data,s.layout,s.config);}})();</script>")


def widget_name(output: dict) -> str:
    """A widget view's class: recorded by scripts/execute_notebooks.py, else read from its repr
    (``Quiz(children=...)``); "widget" for one whose repr names none (a progress bar's)."""
    if output.get("metadata", {}).get("nanoengine_widget"):
        return output["metadata"]["nanoengine_widget"]
    text = output.get("data", {}).get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    match = re.match(r"\s*([A-Za-z_]\w*)\(", text)
    return match.group(1) if match else "widget"


def _chapter_title(nb: dict, path: Path) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            match = re.search(r"^#\s+(.+)$", "".join(cell["source"]), re.M)
            if match:
                return match.group(1).strip()
    return path.stem


def stage_notebook(root: Path, path: Path, docs: dict[str, str]) -> dict:
    """The notebook as the site shows it: provenance line, static widget views, plotly as HTML."""
    nb = json.loads((root / path).read_text(encoding="utf-8"))
    title = _chapter_title(nb, path)
    meta = nb.get("metadata", {}).get("nanoengine") or {}
    saved = path not in LIVE_ONLY
    for n, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        outputs = []
        for k, output in enumerate(cell.get("outputs", [])):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                name = widget_name(output)
                match = re.search(r"\bQuiz\(\s*(\d+)", source)
                if name == "Quiz" and match:
                    outputs.append(_html_output(quiz_view(int(match.group(1)), source, path, title, root)))
                elif name in docs:
                    outputs.append(_html_output(simulator_view(name, docs, path, title, saved)))
                else:  # not a course simulator: a progress bar (tqdm) or another library's widget
                    outputs.append(_html_output(other_widget_note(output)))
            elif PLOTLY in data:
                outputs.append(_html_output(plotly_html(data[PLOTLY], f"ne-plotly-{path.stem}-{n}-{k}")))
            else:
                outputs.append(output)
        if not saved and not outputs:
            # the demo's cells: a static view wherever the cell ends in a simulator
            last = source.strip().splitlines()[-1] if source.strip() else ""
            match = re.match(r"\s*(?:(\w+)\s*$|([A-Z]\w*)\()", last)
            if match:
                name = match.group(2) or _variable_class(source, match.group(1))
                quiz = re.search(r"\bQuiz\(\s*(\d+)", last)
                if name == "Quiz" and quiz:
                    outputs.append(_html_output(quiz_view(int(quiz.group(1)), source, path, title, root)))
                elif name in docs:
                    outputs.append(_html_output(simulator_view(name, docs, path, title, saved)))
        cell["outputs"] = outputs
    if saved:
        note = (f"Outputs on this page were measured on **{meta['machine']}**, on {meta['executed'][:10]} "
                f"({meta['executed'][11:16]} UTC), at revision `{meta.get('revision', '?')[:10]}`"
                + (f", in {meta['seconds']} s" if "seconds" in meta else "") + ". "
                f"Run it yourself: `./course lab`, then open `{path}`.")
    else:
        note = ("This page has no saved outputs: every cell is a live simulator on the real engine. "
                f"Run it live: `./course lab`, then open `{path}`.")
    admonition = f"\n:::{{admonition}} Where these outputs come from\n:class: ne-provenance\n{note}\n:::\n"
    for cell in nb["cells"]:  # right under the chapter's title
        if cell["cell_type"] == "markdown" and re.search(r"^#\s", text := "".join(cell["source"]), re.M):
            cell["source"] = re.sub(r"^(#\s.*)$", lambda m: m.group(1) + "\n" + admonition, text, count=1, flags=re.M)
            break
    else:
        nb["cells"].insert(0, {"cell_type": "markdown", "id": "ne-site-provenance", "metadata": {},
                               "source": f"# {title}\n{admonition}"})
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def _variable_class(source: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}\s*=\s*([A-Z]\w*)\(", source, re.M)
    return match.group(1) if match else ""


def _reroot_links(text: str, prefix: str) -> str:
    """Relative markdown links of a page moved up from ``prefix``/ to the site's root."""
    def fix(match: re.Match) -> str:
        target = match.group(1)
        if re.match(r"[a-z]+:|#|/", target):
            return match.group(0)
        return f"]({prefix}/{target})"
    return re.sub(r"\]\(([^)\s]+)\)", fix, text)


def _fix_dir_links(text: str, here: Path) -> str:
    """Links to a folder (``versions/``) point to its notes page; a folder with none keeps its
    text without a link (a static site has no folder listings)."""
    def fix(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"[a-z]+:|#", target) or not target.endswith("/"):
            return match.group(0)
        for name in ("NOTES.md", "README.md"):
            if (here / target / name).is_file():
                return f"[{label}]({target}{name})"
        return label
    return re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", fix, text)


def toctree(caption: str, entries: list[str]) -> str:
    body = "\n".join(entries)
    return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{body}\n```\n"


def stage(root: Path, pages: list[Page], src: Path) -> None:
    """Write the Sphinx source tree for ``pages`` into ``src``."""
    shutil.copytree(SITE_SRC, src, dirs_exist_ok=True)
    static = src / "_static"
    static.mkdir(exist_ok=True)
    import plotly

    shutil.copy2(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", static / "plotly.min.js")
    docs = _widget_docs(root)
    for page in pages:
        target = src / page.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if page.path.suffix == ".ipynb":
            target.write_text(json.dumps(stage_notebook(root, page.path, docs), indent=1), encoding="utf-8")
    # the lab: its README and every notes page under it, as pages below it in the sidebar
    lab_pages = sorted(p.relative_to(root) for p in (root / LABS).rglob("*.md")
                       if "work" not in p.relative_to(root / LABS).parts) if (root / LABS).is_dir() else []
    for md in lab_pages:
        target = src / md
        target.parent.mkdir(parents=True, exist_ok=True)
        text = _fix_dir_links(md_text(root / md), (root / md).parent)
        if md == LABS / "README.md":
            children = [str(p.relative_to(LABS).with_suffix("")) for p in lab_pages if p != md]
            text += toctree("The lab's notes", children)
        target.write_text(text, encoding="utf-8")
        # files the notes link to (sources, tests): shipped as downloads so each link resolves
        for link in re.findall(r"\]\(([^)\s#]+)\)", text):
            linked = (root / md).parent / link
            if not re.match(r"[a-z]+:", link) and linked.is_file() and linked.suffix != ".md":
                dest = target.parent / link
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(linked, dest)
    index = _reroot_links(md_text(root / INDEX), "notebooks")
    sections: dict[str, list[str]] = {}
    for page in pages:
        sections.setdefault(page.section, []).append(str(page.path.with_suffix("")))
    index += "".join(toctree(caption, entries) for caption, entries in sections.items())
    (src / "index.md").write_text(index, encoding="utf-8")


def md_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------
# 3. build, 4. swap


def ensure_packages() -> None:
    """Install requirements-site.txt into this Python's environment once (stamped)."""
    if sys.version_info < MIN_PYTHON:
        raise SiteError(f"the site's build needs Python {'.'.join(map(str, MIN_PYTHON))} or newer (Sphinx 9 and the "
                        f"book theme do), and {sys.executable} is {sys.version.split()[0]}: recreate .venv with a "
                        "newer Python (PYTHON=python3.11 ./course site, after removing .venv)")
    stamp = Path(sys.prefix) / ".requirements-site.sha"
    want = hashlib.sha256((ROOT / "requirements-site.txt").read_bytes() + (ROOT / "requirements.txt").read_bytes()
                          ).hexdigest()
    if stamp.is_file() and stamp.read_text().strip() == want:
        return
    print("[site] installing the site's packages (requirements-site.txt, constrained by requirements.txt)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-c", str(ROOT / "requirements.txt"), "-r", str(ROOT / "requirements-site.txt")], check=True)
    stamp.write_text(want + "\n")


def build(out: Path, root: Path = ROOT, quiet: bool = True) -> Path:
    """Build the site into ``out``; ``out`` is replaced only by a complete build."""
    pages = collect_pages(root)  # bad input stops here, before anything is written
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
    try:
        src, html_dir = work / "src", work / "html"
        stage(root, pages, src)
        from sphinx.cmd.build import build_main

        args = ["-b", "html", "-E", "-W", "--keep-going", "-j", "1", str(src), str(html_dir),
                "-d", str(work / "doctrees")]
        if build_main(args + (["-q"] if quiet else [])) != 0:
            raise SiteError("Sphinx reported problems (above); nothing was built, site/ is unchanged")
        (html_dir / ".nojekyll").touch()
        old = out.with_name(f".{out.name}-old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        html_dir.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def serve(directory: Path, port: int) -> None:
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        print(f"[site] serving {directory} on http://127.0.0.1:{port}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "site", help="where the site goes (default: site/)")
    parser.add_argument("--serve", action="store_true", help="then serve it on 127.0.0.1")
    parser.add_argument("--serve-only", action="store_true", help="serve the site already built, build nothing")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--verbose", action="store_true", help="show Sphinx's progress")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: a TCP port is 1-65535")
    if args.serve_only:
        if not (args.out / "index.html").is_file():
            print(f"[site] no site in {args.out}: build it first with ./course site", file=sys.stderr)
            return 2
        serve(args.out, args.port)
        return 0
    try:
        collect_pages(ROOT)  # before installing anything: bad input is reported at once
        ensure_packages()
        start = time.perf_counter()
        out = build(args.out, quiet=not args.verbose)
    except SiteError as exc:
        print(f"[site] {exc}", file=sys.stderr)
        return 2
    print(f"[site] built {out} in {time.perf_counter() - start:.0f} s; open {out / 'index.html'}, "
          "or serve it: ./course site --serve")
    if args.serve:
        serve(out, args.port)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
