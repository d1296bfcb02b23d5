"""Tests for widgets.quiz and the eleven chapter quiz files."""

from __future__ import annotations

import collections
import json
import math

import pytest

from widgets.quiz import MIN_QUESTIONS, Quiz, load_quiz, quiz_path

CHAPTERS = range(1, 12)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_a_valid_quiz(chapter: int) -> None:
    raw = json.loads(quiz_path(chapter).read_text(encoding="utf-8"))
    assert raw["chapter"] == chapter and raw["title"]
    assert len(raw["questions"]) >= MIN_QUESTIONS
    for q in raw["questions"]:
        assert q["question"].strip()
        assert sum(1 for o in q["options"] if o["correct"] is True) == 1
        assert all(o["correct"] in (True, False) for o in q["options"])
        assert all(o["explanation"].strip() and o["text"].strip() for o in q["options"])
        assert len({o["text"] for o in q["options"]}) == len(q["options"])
    quiz = load_quiz(chapter)
    assert quiz.chapter == chapter and len(quiz.questions) == len(raw["questions"])


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_correct_answers_are_spread_over_positions(chapter: int) -> None:
    quiz = load_quiz(chapter)
    n = len(quiz.questions)
    num_options = max(len(q.options) for q in quiz.questions)
    positions = collections.Counter(q.answer for q in quiz.questions)
    assert len(positions) > 1, positions
    assert max(positions.values()) <= math.ceil(n / num_options) + 1, positions


def test_answering_checking_and_scoring() -> None:
    view = Quiz(5)
    quiz = view.controller.quiz
    assert "Score: <b>0</b> / 5" in view.score_label.value
    view.check_buttons[0].click()
    assert "choose an answer first" in view.feedback[0].value
    q0, q1 = quiz.questions[0], quiz.questions[1]
    view.radios[0].value = q0.answer
    view.check_buttons[0].click()
    assert 'data-correct="true"' in view.feedback[0].value
    for option in q0.options:  # every option's explanation is shown
        assert option.explanation.replace("'", "&#x27;") in view.feedback[0].value
    wrong = (q1.answer + 1) % len(q1.options)
    view.radios[1].value = wrong
    view.check_buttons[1].click()
    assert 'data-correct="false"' in view.feedback[1].value and "(your answer)" in view.feedback[1].value
    assert "Score: <b>1</b> / 5 (2 checked)" in view.score_label.value
    view.radios[1].value = q1.answer  # a new choice clears the old verdict until checked
    assert view.feedback[1].value == "" and "(1 checked)" in view.score_label.value
    view.check_buttons[1].click()
    assert "Score: <b>2</b> / 5" in view.score_label.value


def test_invalid_quiz_files_are_refused(tmp_path) -> None:
    def write(questions):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"chapter": 99, "title": "bad", "questions": questions}))
        return path

    option = {"text": "a", "correct": False, "explanation": "why"}
    good = {"question": "q", "options": [dict(option, correct=True), dict(option, text="b")]}
    with pytest.raises(ValueError, match="at least 4 questions"):
        load_quiz(write([good] * 3))
    two_right = {"question": "q", "options": [dict(option, correct=True), dict(option, text="b", correct=True)]}
    with pytest.raises(ValueError, match="exactly one correct"):
        load_quiz(write([good] * 3 + [two_right]))
    unexplained = {"question": "q", "options": [dict(option, correct=True), dict(option, explanation=" ")]}
    with pytest.raises(ValueError, match="explanation"):
        load_quiz(write([good] * 3 + [unexplained]))
    with pytest.raises(ValueError, match="no quiz file"):
        load_quiz(42)
