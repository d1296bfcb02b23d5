"""The course in other languages: translations keyed to their English source, never copied.

A *unit* is one piece of English a learner reads: a notebook's markdown cell (keyed by the
cell's id), a section of a markdown document (keyed by its heading), a quiz's title, question,
option or explanation (keyed by its place in the quiz), or a string a widget or check shows
(``tr("{n} blocks", n=n)``, keyed by the hash of its English template). Each translation file stores,
per unit, the English it translates (``en``), a hash of that English (``sha``) and the
translation. When the English changes, the stored hash no longer matches and
``python -m translations check`` names the unit and shows the English change, so an English
edit lands with its translation (docs/TRANSLATING.md says how a translator updates one).

The translated notebooks are *built*, not executed: ``python -m translations build`` takes the
executed English notebook, keeps its code cells and saved outputs as they are, and replaces each
markdown cell with its translation (relative links re-pointed from ``notebooks/<lang>/``).

Where the files live (``<lang>`` is ``ko`` today)::

    translations/<lang>/GLOSSARY.md            the term choices, checked by tests
    translations/<lang>/notebooks/NN_name.json   a chapter's units and its solution's own units
    translations/<lang>/quizzes/chNN.json        a quiz's units
    translations/<lang>/docs/NAME.json           a markdown document's sections (the index, the
                                                 README, the lab's README, notes and reports)
    translations/<lang>/widgets/MODULE.json      the strings of a widget or check module

This module needs only the standard library: the widgets read their strings and quizzes through
it (``tr``, ``language``, ``translated_quiz``), and the site's build uses it without torch.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
LANGUAGES = ("en", "ko")  # English is the source; the others are translations of it

LAB = "labs/nano-vllm"


def documents() -> list[str]:
    """The markdown documents a learner reads, translated section by section (paths from the
    repository root): the README, the course index, the lab's README, each lab version's notes
    and the v10 reading reports; a starter's notes are its version's, copied."""
    lab = REPO / LAB
    found = ["README.md", "notebooks/README.md", f"{LAB}/README.md"]
    found += sorted(str(p.relative_to(REPO)) for folder in ("versions", "starters") if (lab / folder).is_dir()
                    for p in (lab / folder).glob("v*/*.md") if not is_translation_name(p))
    return found


def is_translation_name(path: Path) -> bool:
    """A translated document's name: ``NAME.<lang>.md``."""
    return any(path.name.endswith(f".{lang}.md") for lang in LANGUAGES[1:])


def sha(text: str) -> str:
    """The hash a unit is keyed by: the first 12 hex digits of SHA-256 of its English text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


@dataclass(frozen=True)
class Unit:
    """One piece of English a learner reads, as it is in the source today."""
    id: str
    en: str


# ----------------------------------------------------------------------------- the English units

def chapter_notebooks() -> list[Path]:
    """The chapters (``notebooks/NN_*.ipynb``), in order."""
    return sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def notebook_units(path: Path) -> list[Unit]:
    """A notebook's markdown cells, keyed by cell id (nbformat 4.5 gives every cell one)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [Unit(c["id"], "".join(c["source"])) for c in cells if c["cell_type"] == "markdown"]


def _headings(text: str) -> list[int]:
    """Line numbers of the markdown headings in ``text`` that are outside code fences."""
    starts, fenced = [], False
    for i, line in enumerate(text.split("\n")):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            starts.append(i)
    return starts


def document_units(path: Path) -> list[Unit]:
    """A markdown document cut at its headings; a section's id is its heading (``#2`` for a
    second section with the same heading, ``(top)`` for text before the first heading)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    cuts = _headings("\n".join(lines))
    if not cuts or cuts[0] != 0:
        cuts = [0] + cuts
    units, seen = [], {}
    for start, end in zip(cuts, cuts[1:] + [len(lines)]):
        body = "\n".join(lines[start:end])
        head = lines[start].lstrip("#").strip() if re.match(r"#{1,6} ", lines[start]) else "(top)"
        seen[head] = seen.get(head, 0) + 1
        units.append(Unit(head if seen[head] == 1 else f"{head} #{seen[head]}", body))
    return units


def quiz_units(path: Path) -> list[Unit]:
    """A quiz's title, and each question's text, options and explanations, keyed by place
    (``q3``, ``q3.o2``, ``q3.o2.why``, counting from 1 in the file's order)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    units = [Unit("title", data["title"])]
    for i, q in enumerate(data["questions"], 1):
        units.append(Unit(f"q{i}", q["question"]))
        for j, o in enumerate(q["options"], 1):
            units += [Unit(f"q{i}.o{j}", o["text"]), Unit(f"q{i}.o{j}.why", o["explanation"])]
    return units


def string_units(module: Path) -> list[Unit]:
    """The strings a widget or check module shows a learner: the first argument of each
    ``tr("...")`` call (a template whose ``{name}`` fields ``tr`` fills), keyed by its hash."""
    text = module.read_text(encoding="utf-8")
    if "tr(" not in text:
        return []
    units: dict[str, Unit] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tr":
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                where = module.relative_to(REPO) if module.is_relative_to(REPO) else module
                raise ValueError(f"{where}:{node.lineno}: tr() takes the English as a string "
                                 "literal (fields as keywords: tr(\"{n} blocks\", n=n)), so it can be looked up")
            units.setdefault(sha(first.value), Unit(sha(first.value), first.value))
    return list(units.values())


# ----------------------------------------------------------------------------- translation files

def translation_file(lang: str, english: Path) -> Path:
    """Where the translation of an English source file lives. A copy (a solution notebook, a
    starter's notes) shares its original's file."""
    rel = english.resolve().relative_to(REPO)
    if rel.parts[0] == "notebooks" and rel.suffix == ".ipynb":
        return HERE / lang / "notebooks" / (rel.stem + ".json")
    if rel.parts[:2] == ("widgets", "quizzes"):
        return HERE / lang / "quizzes" / rel.name
    if rel.suffix == ".py":
        return HERE / lang / rel.with_suffix(".json")
    rel = Path(str(rel).replace(f"{LAB}/starters/", f"{LAB}/versions/"))
    return HERE / lang / "docs" / (str(rel).replace("/", "__") + ".json")


def load_units(path: Path) -> dict[str, dict]:
    """A translation file's units by id (``{}`` when there is no file)."""
    if not path.is_file():
        return {}
    return {u["id"]: u for u in json.loads(path.read_text(encoding="utf-8"))["units"]}


def write_units(path: Path, source: str, units: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"source": source, "units": units}, ensure_ascii=False, indent=1)
    path.write_text(text + "\n", encoding="utf-8")


def english_sources(only: str = "") -> list[tuple[Path, list[Unit]]]:
    """Every English source that is translated (those whose path contains ``only``), with its
    units. A solution notebook shares the units its chapter has (same cell, same text); its own
    cells are stored in the chapter's file too, under ``solutions/<cell id>``."""
    paths = []
    for nb in chapter_notebooks():
        paths += [nb] + [s for s in [nb.parent / "solutions" / nb.name] if s.is_file()]
    paths += sorted((REPO / "widgets" / "quizzes").glob("ch[0-9][0-9].json"))
    paths += [REPO / doc for doc in documents()]
    paths += sorted((REPO / "widgets").rglob("*.py"))
    sources = []
    for path in paths:
        if only not in str(path.relative_to(REPO)):
            continue
        if path.suffix == ".ipynb":
            sources.append((path, notebook_units(path)))
        elif path.suffix == ".json":
            sources.append((path, quiz_units(path)))
        elif path.suffix == ".md":
            sources.append((path, document_units(path)))
        elif units := string_units(path):
            sources.append((path, units))
    return sources


def _copy_kind(english: Path) -> str:
    """"solutions" for a solution notebook, "starter" for a lab starter's notes, else ""."""
    rel = english.resolve().relative_to(REPO)
    if english.parent.name == "solutions":
        return "solutions"
    return "starter" if str(rel).startswith(f"{LAB}/starters/") else ""


def stored_id(english: Path, unit: Unit) -> str:
    """A unit's id in its translation file: a copy's own units are prefixed with its kind."""
    kind = _copy_kind(english)
    return f"{kind}/{unit.id}" if kind else unit.id


def lookup(lang: str, english: Path, unit: Unit) -> dict | None:
    """The stored translation of ``unit`` (the stored entry with its id, else, for a copy, the
    original's unit with the same English), or None."""
    stored = load_units(translation_file(lang, english))
    entry = stored.get(stored_id(english, unit))
    if entry is None and _copy_kind(english):
        entry = next((e for e in stored.values() if e["sha"] == sha(unit.en)), None)
    return entry


@dataclass(frozen=True)
class Problem:
    """A unit whose translation is missing, empty or made from other English."""
    english: Path
    unit: Unit
    kind: str  # "missing", "empty" or "stale"
    stored_en: str = ""

    def report(self) -> str:
        where = f"{self.english.relative_to(REPO)} unit {self.unit.id!r}"
        if self.kind == "missing" and self.stored_en:  # a string keyed by its hash: edited, so a new key
            where += " (the English changed: a translated string like it is left over)"
        elif self.kind != "stale":
            text = self.unit.en if len(self.unit.en) <= 300 else self.unit.en[:300] + " ..."
            return f"{where}: translation {self.kind}" + (f":\n{text}" if self.kind == "missing" else "")
        diff = difflib.unified_diff(self.stored_en.split("\n"), self.unit.en.split("\n"),
                                    "translated English", "English today", lineterm="", n=1)
        return f"{where}: the English changed since it was translated:\n" + "\n".join(diff)


def problems(lang: str) -> list[Problem]:
    """Every English unit without a translation that matches its English today."""
    found = []
    for english, units in english_sources():
        for unit in units:
            entry = lookup(lang, english, unit)
            if entry is None:
                found.append(Problem(english, unit, "missing", _closest_left_over(lang, english, units, unit)))
            elif entry["sha"] != sha(unit.en) or entry["sha"] != sha(entry["en"]):
                found.append(Problem(english, unit, "stale", entry["en"]))
            elif not entry.get(lang, "").strip():
                found.append(Problem(english, unit, "empty"))
    return found


def _closest_left_over(lang: str, english: Path, units: list[Unit], unit: Unit) -> str:
    """For a unit with no translation, the English of the most similar stored entry that no
    unit of the source uses any more (the unit before an edit, when its id is its hash)."""
    ids = {stored_id(english, u) for u in units}
    left = [e["en"] for uid, e in load_units(translation_file(lang, english)).items() if uid not in ids]
    close = difflib.get_close_matches(unit.en, left, n=1, cutoff=0.6)
    return close[0] if close else ""


def extra_entries(lang: str) -> list[str]:
    """Stored units no English source has any more (left behind by a deleted cell or section)."""
    wanted: dict[Path, set[str]] = {}
    for english, units in english_sources():
        wanted.setdefault(translation_file(lang, english), set()).update(stored_id(english, u) for u in units)
    extra = []
    for path in sorted((HERE / lang).rglob("*.json")):
        for uid in load_units(path):
            if uid not in wanted.get(path, set()):
                extra.append(f"{path.relative_to(REPO)}: {uid}")
    return extra


# ----------------------------------------------------------------------------- reading and building

def translated(lang: str, english: Path, unit: Unit) -> str:
    """The translation of ``unit``; KeyError naming the unit when it has none for today's English."""
    entry = lookup(lang, english, unit)
    if entry is None or entry["sha"] != sha(unit.en) or not entry.get(lang, "").strip():
        raise KeyError(f"{english.relative_to(REPO)} unit {unit.id!r} has no up-to-date {lang} translation "
                       f"(python -m translations check)")
    return entry[lang]


def translated_path(lang: str, english: Path) -> Path:
    """Where the translated copy of an English notebook or document is built."""
    rel = english.resolve().relative_to(REPO)
    if rel.suffix == ".md":
        if str(rel) == "notebooks/README.md":
            return REPO / "notebooks" / lang / "README.md"
        return REPO / rel.with_name(f"{rel.stem}.{lang}.md")
    return REPO / "notebooks" / lang / rel.relative_to("notebooks")


LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def repoint_links(text: str, english: Path, copy: Path, lang: str) -> str:
    """Relative links in text moved from ``english`` to ``copy``: a link to a translated page
    goes to its translation, any other relative link to the same file as before."""
    def move(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"[a-z]+:|#|/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        source = (english.parent / path).resolve()
        if source.suffix in (".ipynb", ".md") and source.is_file():
            candidate = translated_path(lang, source) if _is_translated(source) else source
        else:
            candidate = source
        new = os.path.relpath(candidate, copy.parent).replace(os.sep, "/") + (f"#{anchor}" if anchor else "")
        return match.group(1) + new + match.group(3)
    return LINK.sub(move, text)


def _is_translated(path: Path) -> bool:
    rel = str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else ""
    return rel in documents() or bool(re.fullmatch(r"notebooks/(solutions/)?\d\d_[^/]+\.ipynb", rel))


def build_notebook(lang: str, english: Path, repoint: bool = True) -> dict:
    """The translated notebook: the executed English notebook with each markdown cell replaced
    by its translation; code cells, outputs and attachments untouched. ``repoint=False`` keeps
    the links as the English page has them (the site puts each language's pages at the same paths)."""
    notebook = json.loads(english.read_text(encoding="utf-8"))
    copy = translated_path(lang, english)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            text = translated(lang, english, Unit(cell["id"], "".join(cell["source"])))
            text = repoint_links(text, english, copy, lang) if repoint else text
            cell["source"] = text.splitlines(keepends=True)
    meta = notebook["metadata"].setdefault("nanoengine", {})
    meta["language"] = lang
    meta["translated_from"] = str(english.relative_to(REPO))
    return notebook


def build_document(lang: str, english: Path, repoint: bool = True) -> str:
    """The translated markdown document (see ``build_notebook`` for ``repoint``)."""
    text = "\n".join(translated(lang, english, u) for u in document_units(english))
    return repoint_links(text, english, translated_path(lang, english), lang) if repoint else text


def build(lang: str) -> list[Path]:
    """Write every translated notebook and document; returns the paths written."""
    written = []
    for english, _ in english_sources():
        if english.suffix == ".ipynb":
            copy = translated_path(lang, english)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(json.dumps(build_notebook(lang, english), ensure_ascii=False, indent=1) + "\n",
                            encoding="utf-8")
            written.append(copy)
        elif english.suffix == ".md":
            copy = translated_path(lang, english)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(build_document(lang, english), encoding="utf-8")
            written.append(copy)
    return written


def translated_quiz(lang: str, quiz: dict, english: Path) -> dict:
    """A quiz's data with its text in ``lang`` (the structure and the answers are the English file's)."""
    def text(uid: str, en: str) -> str:
        return translated(lang, english, Unit(uid, en))
    out = dict(quiz, title=text("title", quiz["title"]), questions=[])
    for i, q in enumerate(quiz["questions"], 1):
        options = [dict(o, text=text(f"q{i}.o{j}", o["text"]), explanation=text(f"q{i}.o{j}.why", o["explanation"]))
                   for j, o in enumerate(q["options"], 1)]
        out["questions"].append(dict(q, question=text(f"q{i}", q["question"]), options=options))
    return out


_CATALOGS: dict[str, dict[str, str]] = {}


def catalog(lang: str) -> dict[str, str]:
    """Every translated string of the widgets in ``lang``, by the hash of its English (read once)."""
    if lang not in _CATALOGS:
        merged = {}
        for path in sorted((HERE / lang / "widgets").rglob("*.json")):
            for entry in load_units(path).values():
                if entry.get(lang, "").strip() and entry["sha"] == sha(entry["en"]):
                    merged[entry["sha"]] = entry[lang]
        _CATALOGS[lang] = merged
    return _CATALOGS[lang]


def tr(template: str, /, **fields) -> str:
    """``template``, a string a widget shows, in the notebook's language (``language()``), with
    its ``{name}`` fields filled from ``fields`` (``str.format``; only when fields are given, so
    a template without fields keeps its braces). A string not yet translated shows in English;
    ``python -m translations check`` names it."""
    lang = language()
    if lang != "en":
        template = catalog(lang).get(sha(template), template)
    return english(template, **fields)


def english(template: str, /, **fields) -> str:
    """``tr`` without the translation: the template filled as the English notebooks show it
    (for text that code reads back, such as a log that a chapter filters by its English words)."""
    return template.format(**fields) if fields else template


def language() -> str:
    """The language a notebook's widgets speak: ``NANOENGINE_LANG`` when set, else the language
    folder the notebook runs from (a kernel starts in its notebook's folder: ``notebooks/ko/``
    and ``notebooks/ko/solutions/`` give ``ko``, in the repository or a copy of it), else English."""
    chosen = os.environ.get("NANOENGINE_LANG", "")
    if not chosen:
        here = Path.cwd()
        folder = here.parent.name if here.name == "solutions" else here.name
        chosen = folder if folder in LANGUAGES[1:] else ""
    if chosen and chosen not in LANGUAGES:
        raise ValueError(f"NANOENGINE_LANG={chosen!r}: the course has {', '.join(LANGUAGES)}")
    return chosen or "en"


# ----------------------------------------------------------------------------- the glossary

@dataclass(frozen=True)
class Term:
    english: str
    translated: str
    avoid: tuple[str, ...]


def glossary(lang: str) -> list[Term]:
    """The term table of ``translations/<lang>/GLOSSARY.md`` (rows of ``| English | term | avoid |``)."""
    terms = []
    for line in (HERE / lang / "GLOSSARY.md").read_text(encoding="utf-8").split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and line.startswith("|") and cells[0] not in ("English", "") and not set(cells[0]) <= set("-"):
            terms.append(Term(cells[0], cells[1], tuple(a.strip() for a in cells[2].split(",") if a.strip())))
    return terms


def prose(text: str) -> str:
    """Markdown without its code (fences and inline), link targets, URLs and HTML tags."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"https?://\S+|<[^>]+>", " ", text)
    return text


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def glossary_problems(lang: str, only: str = "") -> list[str]:
    """Translated units that break the glossary: the English uses a term whose chosen
    translation the unit lacks, or the unit uses a word the glossary says to avoid."""
    terms = glossary(lang)
    patterns = [(t, re.compile(r"\b" + r"[\s-]+".join(map(re.escape, t.english.split())) + r"(s|es)?\b", re.I))
                for t in terms]
    found = []
    for english, units in english_sources():
        rel = str(english.relative_to(REPO))
        if only not in rel:
            continue
        for unit in units:
            entry = lookup(lang, english, unit)
            if not entry or not entry.get(lang, "").strip():
                continue
            theirs = _squeeze(prose(entry[lang]))
            mine = prose(unit.en)
            for term, pattern in patterns:
                if pattern.search(mine) and _squeeze(term.translated) not in theirs:
                    found.append(f"{rel} unit {unit.id!r}: the English says {term.english!r}, "
                                 f"the translation lacks {term.translated!r}")
                for word in term.avoid:
                    if _squeeze(word) in theirs:
                        found.append(f"{rel} unit {unit.id!r}: uses {word!r}; the glossary says {term.translated!r}")
    return found
