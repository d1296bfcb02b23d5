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

Every language of the course is built (``--lang`` picks one): English at the site's root, each
translation under its own folder (``site/ko/``) with the same pages at the same paths, staged
from the English notebooks with their markdown translated (``translations``) and the site's own
words in that language (``WORDS``). Every page links to its copy in the other language.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import translations  # noqa: E402  (the repository's; needs only the standard library)

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
LANGUAGES = ("en", "ko")

# The site's own words, per language (the notebooks' and quizzes' words come from translations/).
WORDS = {
    "en": {"Chapters": "Chapters", "Worked solutions": "Worked solutions",
           "Labs and simulators": "Labs and simulators", "quiz": "Quiz: chapter {n}, {title}",
           "simulator": "Simulator", "run live": "Run it live: <code>./course lab</code>, open <code>{path}</code> ({title}) and run the cell.",
           "live questions": "In the notebook the quiz also asks {n} question{s} built from the live engine when the cell "
                             "runs (its numbers come from that run), and checks each answer with an explanation.",
           "checked": "In the notebook each answer is checked, with an explanation.",
           "not stored": "Its live view is not stored in the notebook (scripts/execute_notebooks.py drops widget state); "
                         "the cells around it print what it measured.",
           "no outputs": "This page's notebook is committed without outputs: the simulator exists only in a running kernel.",
           "provenance title": "Where these outputs come from",
           "measured": "Outputs on this page were measured on **{machine}**, on {date} ({time} UTC), at revision "
                       "`{revision}`{seconds}. Run it yourself: `./course lab`, then open `{path}`.",
           "in seconds": ", in {seconds} s",
           "live only": "This page has no saved outputs: every cell is a live simulator on the real engine. "
                        "Run it live: `./course lab`, then open `{path}`.",
           "lab notes": "The lab's notes"},
    "ko": {"Chapters": "장", "Worked solutions": "연습 문제 풀이",
           "Labs and simulators": "실습과 시뮬레이터", "quiz": "퀴즈: {n}장, {title}",
           "simulator": "시뮬레이터", "run live": "직접 실행하기: <code>./course lab --lang ko</code>로 연 뒤 <code>{path}</code>({title})에서 이 셀을 실행한다.",
           "live questions": "노트북에서는 셀을 실행할 때 실제 엔진에서 만든 문제 {n}개를 더 묻고(숫자는 그 실행에서 나온다), "
                             "답마다 설명과 함께 채점한다.",
           "checked": "노트북에서는 답마다 설명과 함께 채점한다.",
           "not stored": "라이브 화면은 노트북에 저장되지 않는다(scripts/execute_notebooks.py가 위젯 상태를 지운다). "
                         "측정한 값은 주변 셀이 출력한다.",
           "no outputs": "이 페이지의 노트북은 출력 없이 커밋된다. 시뮬레이터는 실행 중인 커널 안에만 있다.",
           "provenance title": "이 출력은 어디서 왔나",
           "measured": "이 페이지의 출력은 **{machine}**에서 {date} ({time} UTC)에 리비전 `{revision}`로 측정했다{seconds}. "
                       "직접 실행하기: `./course lab --lang ko`, 그다음 `{path}`를 연다.",
           "in seconds": "(실행 {seconds}초)",
           "live only": "이 페이지에는 저장된 출력이 없다. 모든 셀이 실제 엔진 위의 라이브 시뮬레이터다. "
                        "직접 실행하기: `./course lab --lang ko`, 그다음 `{path}`를 연다.",
           "lab notes": "실습 노트"},
}


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


def _live_line(path: Path, title: str, lang: str = "en") -> str:
    return ("<p class='ne-run-live'>"
            + WORDS[lang]["run live"].format(path=html.escape(str(path)), title=html.escape(title)) + "</p>")


def _rst_code(text: str) -> str:
    """Markdown-ish inline code (``x``/`x`) in docstrings and quiz text, as HTML."""
    return re.sub(r"``?([^`]+)``?", r"<code>\1</code>", html.escape(text))


def quiz_view(chapter: int, source: str, path: Path, title: str, root: Path = ROOT, lang: str = "en") -> str:
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
    if lang != "en":
        quiz = translations.translated_quiz(lang, quiz, file)
    words = WORDS[lang]
    parts = [f"<div class='ne-static ne-static-quiz'><p class='ne-static-title'>"
             + words["quiz"].format(n=chapter, title=html.escape(quiz.get("title", title))) + "</p><ol>"]
    for question in quiz["questions"]:
        texts = sorted((o["text"] for o in question["options"]), key=str.casefold)
        options = "".join(f"<li>{_rst_code(text)}</li>" for text in texts)
        parts.append(f"<li><p>{_rst_code(question['question'])}</p><ul class='ne-quiz-options'>{options}</ul></li>")
    parts.append("</ol>")
    live = len(re.findall(r"_question\(", source))
    if "live=" in source and live:
        parts.append("<p>" + words["live questions"].format(n=live, s="s" * (live > 1)) + "</p>")
    else:
        parts.append("<p>" + words["checked"] + "</p>")
    parts.append(_live_line(path, title, lang) + "</div>")
    return "".join(parts)


def simulator_view(name: str, docs: dict[str, str], path: Path, title: str, saved: bool, lang: str = "en") -> str:
    """A static card for a live simulator whose view the notebook does not keep."""
    about = docs.get(name, "an interactive view over the live engine")
    state = WORDS[lang]["not stored" if saved else "no outputs"]
    return (f"<div class='ne-static ne-static-simulator'><p class='ne-static-title'>{WORDS[lang]['simulator']}: "
            f"<code>{html.escape(name)}</code></p><p>{_rst_code(about)}</p><p>{state}</p>"
            f"{_live_line(path, title, lang)}</div>")


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


def stage_notebook(root: Path, path: Path, docs: dict[str, str], lang: str = "en") -> dict:
    """The notebook as the site shows it: provenance line, static widget views, plotly as HTML
    (in ``lang``: its markdown translated, links kept as the English page has them)."""
    nb = (json.loads((root / path).read_text(encoding="utf-8")) if lang == "en" or path in LIVE_ONLY
          else translations.build_notebook(lang, root / path, repoint=False))
    shown = path if lang == "en" or path in LIVE_ONLY else translations.translated_path(lang, root / path).relative_to(root)
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
                    outputs.append(_html_output(quiz_view(int(match.group(1)), source, shown, title, root, lang)))
                elif name in docs:
                    outputs.append(_html_output(simulator_view(name, docs, shown, title, saved, lang)))
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
                    outputs.append(_html_output(quiz_view(int(quiz.group(1)), source, shown, title, root, lang)))
                elif name in docs:
                    outputs.append(_html_output(simulator_view(name, docs, shown, title, saved, lang)))
        cell["outputs"] = outputs
    words = WORDS[lang]
    if saved:
        note = words["measured"].format(
            machine=meta["machine"], date=meta["executed"][:10], time=meta["executed"][11:16],
            revision=meta.get("revision", "?")[:10], path=shown,
            seconds=words["in seconds"].format(seconds=meta["seconds"]) if "seconds" in meta else "")
    else:
        note = words["live only"].format(path=shown)
    admonition = f"\n:::{{admonition}} {words['provenance title']}\n:class: ne-provenance\n{note}\n:::\n"
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


def _html_anchors_as_targets(text: str) -> str:
    """A translated page keeps the English heading's anchor as ``<a id="..."></a>`` before its
    own heading (GitHub and JupyterLab link to it); Sphinx knows only MyST targets: ``(...)=``."""
    return re.sub(r'^<a id="([\w-]+)"></a>$', r"(\1)=", text, flags=re.M)


def toctree(caption: str, entries: list[str]) -> str:
    body = "\n".join(entries)
    return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{body}\n```\n"


def stage(root: Path, pages: list[Page], src: Path, lang: str = "en") -> None:
    """Write the Sphinx source tree for ``pages`` into ``src``, in ``lang``."""
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
            target.write_text(json.dumps(stage_notebook(root, page.path, docs, lang), indent=1), encoding="utf-8")
    # the lab: its README and every notes page under it, as pages below it in the sidebar
    lab_pages = sorted(p.relative_to(root) for p in (root / LABS).rglob("*.md")
                       if "work" not in p.relative_to(root / LABS).parts
                       and not translations.is_translation_name(p)) if (root / LABS).is_dir() else []
    for md in lab_pages:
        target = src / md
        target.parent.mkdir(parents=True, exist_ok=True)
        english = lang == "en" or str(md) not in translations.documents()
        text = md_text(root / md) if english else translations.build_document(lang, root / md, repoint=False)
        text = _fix_dir_links(_html_anchors_as_targets(text), (root / md).parent)
        if md == LABS / "README.md":
            children = [str(p.relative_to(LABS).with_suffix("")) for p in lab_pages if p != md]
            text += toctree(WORDS[lang]["lab notes"], children)
        target.write_text(text, encoding="utf-8")
        # files the notes link to (sources, tests): shipped as downloads so each link resolves
        for link in re.findall(r"\]\(([^)\s#]+)\)", text):
            linked = (root / md).parent / link
            if not re.match(r"[a-z]+:", link) and linked.is_file() and linked.suffix != ".md":
                dest = target.parent / link
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(linked, dest)
    index = md_text(root / INDEX) if lang == "en" else translations.build_document(lang, root / INDEX, repoint=False)
    index = _reroot_links(index, "notebooks")
    sections: dict[str, list[str]] = {}
    for page in pages:
        sections.setdefault(WORDS[lang][page.section], []).append(str(page.path.with_suffix("")))
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


def translation_problems(root: Path, languages: tuple[str, ...]) -> list[str]:
    """Why a translated site cannot be built: units with no translation of today's English."""
    if root != ROOT:  # a scratch copy of the notebooks (tests): translations are read for this repository only
        return []
    found = []
    for lang in languages:
        if lang != "en" and (problems := translations.problems(lang)):
            found.append(f"{lang}: {len(problems)} units have no translation of today's English, first "
                         f"{problems[0].english.relative_to(ROOT)} unit {problems[0].unit.id!r}: "
                         f"python -m translations check --lang {lang} lists them (docs/TRANSLATING.md)")
    return found


def build(out: Path, root: Path = ROOT, quiet: bool = True, languages: tuple[str, ...] = LANGUAGES) -> Path:
    """Build the site into ``out`` (each translation into ``out/<lang>/``); ``out`` is replaced
    only by a complete build."""
    pages = collect_pages(root)  # bad input stops here, before anything is written
    languages = tuple(lang for lang in languages if lang == "en" or root == ROOT)
    if problems := translation_problems(root, languages):
        raise SiteError("cannot build the site, nothing was built (site/ is unchanged):\n"
                        + "\n".join(f"  - {p}" for p in problems))
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
    try:
        html_dir = work / "html"
        from sphinx.cmd.build import build_main

        for lang in languages:
            src = work / f"src-{lang}"
            stage(root, pages, src, lang)
            where = html_dir if lang == "en" else html_dir / lang
            args = ["-b", "html", "-E", "-W", "--keep-going", "-j", "1", "-D", f"language={lang}",
                    "-D", f"ne_languages={','.join(languages)}", str(src), str(where),
                    "-d", str(work / f"doctrees-{lang}")]
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
    parser.add_argument("--lang", choices=LANGUAGES, help="build only this language (default: every one)")
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
        languages = (args.lang,) if args.lang else LANGUAGES
        collect_pages(ROOT)  # before installing anything: bad input is reported at once
        if problems := translation_problems(ROOT, languages):
            raise SiteError("cannot build the site:\n" + "\n".join(f"  - {p}" for p in problems))
        ensure_packages()
        start = time.perf_counter()
        out = build(args.out, quiet=not args.verbose, languages=languages)
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
