"""What a chapter's prose says the engine has, checked against the engine (course v5: drift fails a
test, not a reader). Chapter 11's "What this engine leaves out" table is the first such claim."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from nanoengine import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _engine_column(chapter: str, heading: str) -> dict[str, str]:
    """feature -> this engine's cell, from the markdown table under ``heading`` in ``chapter``."""
    nb = nbformat.read(ROOT / "notebooks" / chapter, as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "markdown" and heading in c.source)
    rows = {}
    for line in source.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] not in ("feature", "---") and not set(cells[0]) <= set("-"):
            rows[cells[0]] = cells[1]
    return rows


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package that does not exist
        return False


def _sampling_field(name: str) -> bool:
    return hasattr(SamplingParams(), name)


# feature row -> does the engine have it?
ENGINE_HAS = {
    "speculative decoding": lambda: _has_module("nanoengine.spec_decode"),
    "structured output (JSON schema, grammars)": lambda: _sampling_field("structured_outputs"),
    "quantized weights and KV cache": lambda: any(_has_module(f"nanoengine.{m}") for m in
                                                  ("quantization", "layers.quantization")),
    "LoRA adapters": lambda: _has_module("nanoengine.lora"),
    "tensor parallelism": lambda: _has_module("nanoengine.distributed.tp_runner"),
    "serving": lambda: _has_module("nanoengine.entrypoints.openai.api_server"),
    "kernels": lambda: any((ROOT / "nanoengine" / "kernels" / "csrc").glob("*.cpp")),
}


@pytest.mark.parametrize("feature", sorted(ENGINE_HAS))
def test_chapter_11s_table_says_what_the_engine_has(feature):
    column = _engine_column("11_benchmarks.ipynb", "## 9. What this engine leaves out")
    assert feature in column, f"chapter 11's table has no row {feature!r}"
    says_no = re.match(r"no\b", column[feature]) is not None
    has = ENGINE_HAS[feature]()
    assert says_no != has, (f"chapter 11 says the engine's {feature!r} is {column[feature]!r}, but the engine "
                            f"{'has' if has else 'does not have'} it")
    if feature == "kernels" and has:
        assert "C++" in column[feature], "the engine has C++ kernels: the table should say so"


# What a chapter names that must exist today: repository paths, `python -m` modules, `./course`
# commands and dotted `nanoengine.*` names, in its prose and in its saved outputs. Paths under
# docs/ are checked only for this repository's own pages (vLLM's docs/... paths are cited too).
_PATH = re.compile(r"(?<![\w/.-])((?:nanoengine|nanobench|widgets|scripts|tests|results|notebooks|labs|jupyter)"
                   r"/[\w./-]*\w|docs/(?:[A-Z]|site_src)[\w./-]*\w)")
_MODULE = re.compile(r"python -m ((?:nanoengine|nanobench|widgets|scripts)[\w.]*)")
_COURSE = re.compile(r"\./course ([\w-]+)")
_NAME = re.compile(r"`((?:nanoengine|nanobench|widgets)(?:\.\w+)+)`")
_CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + \
    sorted((ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb"))


def _texts(path: Path):
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        yield i, cell.source
        for output in cell.get("outputs", []):
            for text in (output.get("text", ""), output.get("data", {}).get("text/plain", "")):
                yield i, "".join(text) if isinstance(text, list) else text


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if not _has_module(module):
            continue
        obj = importlib.import_module(module)
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("chapter", _CHAPTERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_path_command_and_name_a_chapter_gives_exists(chapter):
    course = (ROOT / "course").read_text()
    missing = set()
    for cell, text in _texts(chapter):
        for path in _PATH.findall(text):
            if "*" not in path and not (ROOT / path).exists() and not (ROOT / "notebooks" / path).exists():
                missing.add((cell, "file", path))
        for module in _MODULE.findall(text):
            if not _has_module(module.rstrip(".")):
                missing.add((cell, "python -m", module))
        for command in _COURSE.findall(text):
            if f"  {command})" not in course:
                missing.add((cell, "./course", command))
        for name in _NAME.findall(text):
            if not _resolves(name):
                missing.add((cell, "name", name))
    assert not missing, f"{chapter.name} names what does not exist (cell, kind, name): {sorted(missing)}"


AUTHORING_WORDS = ("+modified", "working-tree", "working tree", "one-off", "dirty", "/tmp/", "this session",
                   "not yet committed", "run once on", "not kept in the repository")


@pytest.mark.parametrize("chapter", _CHAPTERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_output_speaks_of_how_it_was_authored(chapter):
    """A learner reads measurements, not the authors' working state: no saved output names an
    uncommitted revision, a working tree, a scratch path or a script run once (course v5, drift item e)."""
    found = set()
    for i, cell in enumerate(nbformat.read(chapter, as_version=4).cells):
        for output in cell.get("outputs", []):
            for text in (output.get("text", ""), output.get("data", {}).get("text/plain", "")):
                text = "".join(text) if isinstance(text, list) else text
                found |= {(i, word) for word in AUTHORING_WORDS if word in text}
    assert not found, f"{chapter.name} (cell, words): {sorted(found)}"


def test_every_engine_module_says_what_it_is():
    """Chapter 2's map prints each package's and module's docstring first line (drift item c): none
    may be missing, or the map would show a gap where the package tree has a file."""
    import ast
    import pkgutil

    import nanoengine

    silent = [info.name for info in pkgutil.walk_packages(nanoengine.__path__, prefix="nanoengine.")
              if not ast.get_docstring(ast.parse(Path(importlib.util.find_spec(info.name).origin).read_text()))]
    assert not silent, f"modules without a docstring (chapter 2's map would print a gap): {silent}"


def test_every_file_the_architecture_page_names_exists():
    """docs/ARCHITECTURE.md is the map a reader opens before the code: each file it names must be
    there ("Paths are inside nanoengine/, except nanobench/ and widgets/", as the page says)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:[\w-]+/)*[\w-]+\.(?:py|cpp|h))`", text))
    named |= set(re.findall(r"\(((?:[\w-]+/)+[\w-]+\.(?:py|cpp|h))[),]", text))
    assert len(named) > 30, f"the page names only {len(named)} files: the pattern no longer reads it"
    bases = (ROOT, ROOT / "nanoengine", ROOT / "nanobench", ROOT / "widgets")  # nanobench/ names its own files bare
    missing = sorted(n for n in named if not any((base / n).exists() for base in bases))
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
