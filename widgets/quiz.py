"""Auto-checked chapter quizzes (every chapter's questionnaire, see COURSE.md).

Questions live in data files, one per chapter: ``widgets/quizzes/chNN.json``::

    {"chapter": 4, "title": "PagedAttention",
     "questions": [{"question": "...",
                    "options": [{"text": "...", "correct": false, "explanation": "..."}, ...]}]}

Every option carries its own explanation, so a reader who picks a wrong answer learns why
it is wrong, not just which one was right. ``load_quiz`` validates a file (exactly one
correct option per question, an explanation for each option, at least four questions).

``QuizController`` is the testable part; ``Quiz`` draws radio buttons, a Check button per
question and a running score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as W

from widgets._common import check_int, escape

QUIZ_DIR = Path(__file__).parent / "quizzes"
MIN_QUESTIONS = 4


@dataclass(frozen=True)
class Option:
    text: str
    correct: bool
    explanation: str


@dataclass(frozen=True)
class Question:
    question: str
    options: tuple[Option, ...]

    @property
    def answer(self) -> int:
        """Index of the one correct option."""
        return next(i for i, o in enumerate(self.options) if o.correct)


@dataclass(frozen=True)
class QuizData:
    chapter: int
    title: str
    questions: tuple[Question, ...]


@dataclass(frozen=True)
class Feedback:
    question: int
    chosen: int
    correct: bool
    explanation: str  # of the chosen option


def quiz_path(chapter: int) -> Path:
    return QUIZ_DIR / f"ch{chapter:02d}.json"


def load_quiz(chapter: int | str | Path) -> QuizData:
    """Read and validate a chapter's quiz (a chapter number or a path to a JSON file)."""
    path = Path(chapter) if isinstance(chapter, (str, Path)) else quiz_path(check_int("chapter", chapter, 1, 99))
    if not path.is_file():
        raise ValueError(f"no quiz file {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    questions = []
    for i, q in enumerate(data.get("questions", [])):
        options = tuple(Option(str(o["text"]), bool(o["correct"]), str(o.get("explanation", ""))) for o in q["options"])
        where = f"{path.name} question {i + 1}"
        if len(options) < 2:
            raise ValueError(f"{where}: needs at least two options")
        if sum(o.correct for o in options) != 1:
            raise ValueError(f"{where}: needs exactly one correct option, has {sum(o.correct for o in options)}")
        if any(not o.explanation.strip() for o in options):
            raise ValueError(f"{where}: every option needs an explanation")
        questions.append(Question(str(q["question"]), options))
    if len(questions) < MIN_QUESTIONS:
        raise ValueError(f"{path.name}: needs at least {MIN_QUESTIONS} questions, has {len(questions)}")
    return QuizData(int(data["chapter"]), str(data["title"]), tuple(questions))


class QuizController:
    """Answers chosen, answers checked, and the score."""

    def __init__(self, quiz: QuizData) -> None:
        self.quiz = quiz
        self.chosen: dict[int, int] = {}
        self.checked: dict[int, Feedback] = {}

    def select(self, question: int, option: int | None) -> None:
        q = self._question(question)
        if option is None:
            self.chosen.pop(question, None)
        else:
            self.chosen[question] = check_int("option", option, 0, len(q.options) - 1)
        self.checked.pop(question, None)  # a new choice must be checked again

    def check(self, question: int) -> Feedback:
        q = self._question(question)
        if question not in self.chosen:
            raise ValueError(f"question {question + 1}: choose an answer first")
        chosen = self.chosen[question]
        feedback = Feedback(question, chosen, chosen == q.answer, q.options[chosen].explanation)
        self.checked[question] = feedback
        return feedback

    @property
    def score(self) -> int:
        return sum(f.correct for f in self.checked.values())

    @property
    def num_questions(self) -> int:
        return len(self.quiz.questions)

    def _question(self, index: int) -> Question:
        check_int("question", index, 0, self.num_questions - 1)
        return self.quiz.questions[index]


def render_feedback(question: Question, feedback: Feedback) -> str:
    """The verdict, then every option's explanation (the right one marked)."""
    verdict = ('<b style="color:#2e7d32">Correct.</b>' if feedback.correct
               else '<b style="color:#c62828">Not quite.</b>')
    items = []
    for i, o in enumerate(question.options):
        mark = "✔" if o.correct else "✘"
        chosen = " (your answer)" if i == feedback.chosen else ""
        items.append(f'<li class="{"ne-right" if o.correct else "ne-wrong"}"><b>{mark} {escape(o.text)}</b>'
                     f'{chosen}: {escape(o.explanation)}</li>')
    return (f'<div class="ne-feedback" data-correct="{str(feedback.correct).lower()}" style="font-size:13px">'
            f'{verdict}<ul style="margin:4px 0">{"".join(items)}</ul></div>')


class Quiz(W.VBox):
    """One chapter's quiz: radio options, a Check button per question, a score."""

    def __init__(self, chapter: int | str | Path | QuizData) -> None:
        quiz = chapter if isinstance(chapter, QuizData) else load_quiz(chapter)
        self.controller = QuizController(quiz)
        self.score_label = W.HTML()
        self.radios: list[W.RadioButtons] = []
        self.check_buttons: list[W.Button] = []
        self.feedback: list[W.HTML] = []
        boxes = []
        for i, q in enumerate(quiz.questions):
            radio = W.RadioButtons(options=[(o.text, j) for j, o in enumerate(q.options)], value=None,
                                   layout=W.Layout(width="auto"))
            button = W.Button(description="Check")
            feedback = W.HTML()
            radio.observe(self._on_select(i), names="value")
            button.on_click(self._on_check(i))
            self.radios.append(radio)
            self.check_buttons.append(button)
            self.feedback.append(feedback)
            boxes.append(W.VBox([W.HTML(f'<div style="font-size:14px;margin-top:8px"><b>{i + 1}.</b> '
                                        f'{escape(q.question)}</div>'), radio, button, feedback]))
        super().__init__([W.HTML(f"<h4>Quiz: chapter {quiz.chapter}, {escape(quiz.title)}</h4>"), *boxes,
                          self.score_label])
        self.add_class("ne-quiz")
        self._update_score()

    def _on_select(self, i: int):
        def handler(change):
            self.controller.select(i, change["new"])
            self.feedback[i].value = ""
            self._update_score()
        return handler

    def _on_check(self, i: int):
        def handler(_):
            try:
                feedback = self.controller.check(i)
            except ValueError as exc:
                self.feedback[i].value = f'<div style="color:#b26a00;font-size:13px">{escape(exc)}</div>'
                return
            self.feedback[i].value = render_feedback(self.controller.quiz.questions[i], feedback)
            self._update_score()
        return handler

    def _update_score(self) -> None:
        c = self.controller
        self.score_label.value = (f'<div class="ne-score" style="font-size:14px">Score: <b>{c.score}</b> / '
                                  f'{c.num_questions} ({len(c.checked)} checked)</div>')
