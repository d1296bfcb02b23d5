"""The Korean edition: every unit translated from today's English, the glossary followed, the
Korean notebooks the English ones with their prose translated, the quizzes as balanced.

The Korean notebooks are never executed (CI runs the English ones): these tests are what
keeps them equal to the English, cell for cell and output for output.
"""

from __future__ import annotations

import collections
import json
import math
import re
import string
import subprocess
from pathlib import Path

import pytest

import translations as tr
from widgets.quiz import load_quiz

REPO = Path(__file__).resolve().parents[2]
HANGUL = re.compile(r"[\uac00-\ud7a3]")
NOTEBOOKS = [p for p, _ in tr.english_sources() if p.suffix == ".ipynb"]
CHAPTERS = range(1, 15)


def test_every_unit_has_a_translation_of_todays_english() -> None:
    problems = tr.problems("ko")
    assert not problems, "\n".join(p.report() for p in problems[:20]) + f"\n({len(problems)} in all)"
    assert not tr.extra_entries("ko")


def test_an_english_edit_is_named_with_its_change(monkeypatch) -> None:
    chapter = REPO / "notebooks" / "05_scheduler.ipynb"
    unit = tr.notebook_units(chapter)[1]
    edited = tr.Unit(unit.id, unit.en.replace("\n", "\nA sentence the author added.\n", 1))
    new = tr.Unit("new-cell", "## A new section")
    monkeypatch.setattr(tr, "english_sources", lambda: [(chapter, [edited, new])])
    found = {p.unit.id: p for p in tr.problems("ko")}
    assert found[unit.id].kind == "stale" and found["new-cell"].kind == "missing"
    report = found[unit.id].report()
    assert "notebooks/05_scheduler.ipynb" in report and unit.id in report
    assert "+A sentence the author added." in report  # the English change, as a diff
    with pytest.raises(KeyError, match=unit.id):  # nothing is built from a stale translation
        tr.translated("ko", chapter, edited)


def test_a_solution_shares_its_chapters_units_and_stores_only_its_own() -> None:
    chapter = REPO / "notebooks" / "08_sampling.ipynb"
    solution = REPO / "notebooks" / "solutions" / chapter.name
    theirs = {u.en for u in tr.notebook_units(chapter)}
    stored = tr.load_units(tr.translation_file("ko", chapter))
    for unit in tr.notebook_units(solution):
        own = f"solutions/{unit.id}" in stored
        assert own != (unit.en in theirs and not own), unit.id
        assert tr.lookup("ko", solution, unit) is not None


def test_the_glossary_is_followed() -> None:
    terms = tr.glossary("ko")
    assert len(terms) >= 50 and len({t.english for t in terms}) == len(terms)
    problems = tr.glossary_problems("ko")
    assert not problems, "\n".join(problems[:30]) + f"\n({len(problems)} in all)"


def test_the_glossary_check_can_fail(monkeypatch) -> None:
    quiz = REPO / "widgets" / "quizzes" / "ch05.json"
    unit = tr.quiz_units(quiz)[1]  # the first question: it speaks of requests
    assert re.search(r"\brequests?\b", unit.en, re.I)
    monkeypatch.setattr(tr, "english_sources", lambda: [(quiz, [unit])])
    monkeypatch.setattr(tr, "lookup", lambda lang, english, u: {"id": u.id, "sha": tr.sha(u.en), "en": u.en,
                                                                "ko": "리퀘스트 몇 개가 스케쥴러에 들어온다."})
    found = "\n".join(tr.glossary_problems("ko"))
    assert "lacks '요청'" in found and "uses '리퀘스트'" in found and "uses '스케쥴러'" in found


@pytest.mark.parametrize("english", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO / "notebooks")))
def test_each_korean_notebook_is_its_english_one_with_the_prose_translated(english: Path) -> None:
    copy = tr.translated_path("ko", english)
    assert copy.is_file(), f"{copy.relative_to(REPO)} missing: python -m translations build"
    ours, theirs = (json.loads(p.read_text(encoding="utf-8")) for p in (english, copy))
    assert [c["id"] for c in ours["cells"]] == [c["id"] for c in theirs["cells"]]
    for mine, translated in zip(ours["cells"], theirs["cells"]):
        assert mine["cell_type"] == translated["cell_type"]
        if mine["cell_type"] == "code":  # same code, same saved outputs: nothing executed twice
            assert translated == mine
        elif re.search(r"[A-Za-z]{3}", tr.prose("".join(mine["source"]))):
            assert HANGUL.search("".join(translated["source"])), f"{copy.name} cell {mine['id']} is not translated"
    assert theirs["metadata"]["nanoengine"]["language"] == "ko"
    assert theirs == tr.build_notebook("ko", english), "stale: run python -m translations build"


@pytest.mark.parametrize("english", tr.documents())
def test_the_korean_documents_are_built_from_todays_translations(english: str) -> None:
    copy = tr.translated_path("ko", REPO / english)
    assert copy.read_text(encoding="utf-8") == tr.build_document("ko", REPO / english)
    assert HANGUL.search(copy.read_text(encoding="utf-8"))


def test_relative_links_of_the_korean_pages_resolve() -> None:
    pages = [tr.translated_path("ko", p) for p, _ in tr.english_sources() if p.suffix in (".ipynb", ".md")]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if page.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "markdown")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:|#|/", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
    index = tr.translated_path("ko", REPO / "notebooks" / "README.md").read_text(encoding="utf-8")
    assert "](01_what_is_llm_inference.ipynb)" in index  # the Korean index opens the Korean chapters


def test_repoint_links_sends_translated_pages_to_their_copy_and_the_rest_to_the_english_file() -> None:
    english = REPO / "notebooks" / "03_kv_cache.ipynb"
    copy = tr.translated_path("ko", english)
    text = ("[4장](04_paged_attention.ipynb) [풀이](solutions/03_kv_cache.ipynb) [결과](../results/README.md) "
            "[데모](widgets_demo.ipynb) [vLLM](https://github.com/vllm-project/vllm) [위](#top)")
    assert tr.repoint_links(text, english, copy, "ko") == (
        "[4장](04_paged_attention.ipynb) [풀이](solutions/03_kv_cache.ipynb) [결과](../../results/README.md) "
        "[데모](../widgets_demo.ipynb) [vLLM](https://github.com/vllm-project/vllm) [위](#top)")


def _longest_is_correct(question) -> bool:
    return len(question.options[question.answer].text) == max(len(o.text) for o in question.options)


def _length_rank(question) -> int:
    lengths = [len(o.text) for o in question.options]
    return 1 + sum(1 for n in lengths if n > lengths[question.answer])


def test_the_korean_quizzes_give_nothing_away_by_length() -> None:
    """The same bar as the English (tests/course/test_widgets_quiz.py, test_quiz_balance.py) on
    the written questions: the correct option is the longest in at most a third of a chapter's
    questions, and over the course each length rank holds about a quarter of the answers."""
    ranks = collections.Counter()
    for chapter in CHAPTERS:
        questions = load_quiz(chapter, shuffle=False, lang="ko").questions
        longest = sum(map(_longest_is_correct, questions))
        assert longest <= math.ceil(len(questions) / 3), f"ch{chapter:02d}: the longest option is right in {longest}"
        ranks.update(_length_rank(q) for q in questions)
    total = sum(ranks.values())
    assert all(abs(ranks[r] - total / 4) <= max(4, 0.25 * total / 4) for r in range(1, 5)), sorted(ranks.items())


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_korean_quiz_is_its_english_one_in_the_same_order(chapter: int) -> None:
    english, korean = load_quiz(chapter, lang="en"), load_quiz(chapter, lang="ko")
    assert [q.answer for q in korean.questions] == [q.answer for q in english.questions]
    for mine, theirs in zip(english.questions, korean.questions):
        assert HANGUL.search(theirs.question) and len(theirs.options) == len(mine.options)
        assert [o.correct for o in theirs.options] == [o.correct for o in mine.options]


def _fields(template: str) -> list[str]:
    return sorted(f"{name}:{spec}!{conv}" for _, name, spec, conv in string.Formatter().parse(template) if name is not None)


def test_a_translated_string_has_the_fields_of_its_english() -> None:
    """tr() fills the same keyword fields into either language: a field renamed, dropped or given
    another format in the Korean would raise, or print something else, only when it ran."""
    wrong = []
    for path in sorted((tr.HERE / "ko" / "widgets").rglob("*.json")):
        for entry in tr.load_units(path).values():
            if entry.get("ko") and _fields(entry["ko"]) != _fields(entry["en"]):
                wrong.append(f"{path.relative_to(REPO)} {entry['id']}: {_fields(entry['en'])} vs {_fields(entry['ko'])}")
    assert not wrong, "\n".join(wrong)


def test_every_tr_call_is_a_literal_the_catalog_can_find(tmp_path) -> None:
    units = [u for p, units in tr.english_sources() if p.suffix == ".py" for u in units]
    assert len(units) >= 14  # the exercise checks' verdict lines and chapter 3's checks at least
    bad = tmp_path / "bad.py"
    bad.write_text("from translations import tr\nname = 'x'\ntr(f'{name} blocks')\n")
    with pytest.raises(ValueError, match=r"bad.py:3: tr\(\) takes the English as a string literal"):
        tr.string_units(bad)


def test_tr_speaks_the_notebooks_language(monkeypatch) -> None:
    from widgets.exercises import verdict

    monkeypatch.setenv("NANOENGINE_LANG", "en")
    assert str(verdict("3.1", False, "", "a hint.")) == "Exercise 3.1: not yet. Hint: a hint."
    assert tr.tr("{n} blocks", n=3) == "3 blocks" and tr.tr("{no fields}") == "{no fields}"
    monkeypatch.setenv("NANOENGINE_LANG", "ko")
    assert str(verdict("3.1", True, "좋다.", "")) == "연습 문제 3.1: 정답. 좋다."
    assert tr.tr("a string nobody translated: {n}", n=1) == "a string nobody translated: 1"  # English until it is


def test_the_language_comes_from_the_notebooks_folder_or_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("NANOENGINE_LANG", raising=False)
    monkeypatch.chdir(REPO / "notebooks")
    assert tr.language() == "en"
    (REPO / "notebooks" / "ko").mkdir(exist_ok=True)
    monkeypatch.chdir(REPO / "notebooks" / "ko")
    assert tr.language() == "ko"
    (tmp_path / "ko" / "solutions").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "ko" / "solutions")  # a copy of the course elsewhere
    assert tr.language() == "ko"
    monkeypatch.chdir(tmp_path)
    assert tr.language() == "en"
    monkeypatch.setenv("NANOENGINE_LANG", "ko")
    assert tr.language() == "ko"
    monkeypatch.setenv("NANOENGINE_LANG", "fr")
    with pytest.raises(ValueError, match="the course has en, ko"):
        tr.language()


def test_course_lab_refuses_an_unknown_language_before_setting_anything_up() -> None:
    done = subprocess.run([str(REPO / "course"), "lab", "--lang", "fr"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "'fr' is not a language of the course (en, ko)" in done.stderr


def test_a_string_shared_by_two_modules_has_one_translation() -> None:
    """The catalog is keyed by the English's hash across all widgets: two modules that show the
    same English must agree on its Korean, or which one a learner sees depends on file order."""
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted((tr.HERE / "ko" / "widgets").rglob("*.json")):
        for entry in tr.load_units(path).values():
            seen[entry["sha"]].add(entry["ko"])
    assert not {sha: texts for sha, texts in seen.items() if len(texts) > 1}
