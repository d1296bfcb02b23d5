"""Auto-checked chapter quizzes (every chapter's questionnaire, see COURSE.md).

Questions live in data files, one per chapter: ``widgets/quizzes/chNN.json``::

    {"chapter": 4, "title": "PagedAttention",
     "questions": [{"question": "...", "applies": true,
                    "options": [{"text": "...", "correct": false, "explanation": "..."}, ...]}]}

``applies`` marks a question that applies an idea to a new case (a scenario with numbers,
a configuration to predict) rather than asking for a definition; at least half of the
course's written questions do (``tests/course/test_quiz_balance.py``).

Every option carries its own explanation, so a reader who picks a wrong answer learns why
it is wrong, not just which one was right. ``load_quiz`` validates a file (exactly one
correct option per question, an explanation for each option, at least four questions).

A quiz must not be passable by pattern (COURSE.md, item 6). Two habits of hand-written
quizzes give answers away: the correct option is the longest, carefully qualified one, and
the correct positions follow a rotation. Wrong options are real misconceptions, and the
files are written so that the correct option's length rank (longest ... shortest) is spread
evenly over the course (``tests/course/test_quiz_balance.py`` checks every question in display
order, live ones included), and the order a reader sees comes from ``shuffle_options``: options are put in a
canonical order, then shuffled by a generator seeded from the chapter and the question
text, and a chapter's correct answers are spread evenly over the positions in a seeded
order (``answer_positions``). The order is the same on every run and in CI, yet unrelated
to how the file was written.

Live questions (``widgets/live_questions.py``) are computed from the engine when the cell
runs, e.g. "which KV slot does position 20 of this request use?" from its block table.
A notebook passes them to ``Quiz(chapter, live=[...])``; they are checked and scored like
the file's questions and shuffled the same way, their correct options placed where the
chapter's positions stay balanced (``live_answer_positions``). ``make_question`` builds one from a
computed answer and plausible wrong computations.

In a translated notebook (``notebooks/ko/``) the quiz speaks its language: ``load_quiz`` reads
the English file, shuffles it as above (the seeds come from the English text, so every
language shows the same order), then swaps each text for its translation
(``translations.translated_quiz``). Live questions are built in the notebook's language too
(``widgets/live_questions.py``), and shuffled by their own text.

``QuizController`` is the testable part; ``Quiz`` draws radio buttons, a Check button per
question and a running score. A quiz is for learning, and its score for honesty: a wrong
answer shows why *that* option is wrong (its own explanation, never the right option) and
the learner tries again; once right, every option's explanation is shown. The score counts
each question's FIRST checked answer only, so trying options until one is green earns
nothing (a perfect score after a wrong try is impossible).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, replace
from typing import Sequence
from pathlib import Path

import ipywidgets as W

import translations
from translations import tr
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
    attempt: int = 1  # 1 for the first check of this question, 2 for the second, ...


def quiz_path(chapter: int) -> Path:
    return QUIZ_DIR / f"ch{chapter:02d}.json"


def shuffle_seed(chapter: int, question: str) -> int:
    """A seed that depends only on the chapter and the question's text (not on Python's
    per-process string hashing), so a question's option order is reproducible anywhere."""
    digest = hashlib.sha256(f"nanoengine quiz|{chapter}|{question}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def shuffle_options(question: Question, chapter: int, answer_at: int | None = None) -> Question:
    """``question`` with its options in the order a reader sees them.

    The options are first sorted by text (so the result does not depend on the order in
    which a file or a builder listed them), then shuffled with ``shuffle_seed(chapter,
    question text)``. ``answer_at`` then swaps the correct option into that position
    (``load_quiz`` uses it to spread a chapter's answers evenly). Calling it again on its
    own result gives the same order.
    """
    options = sorted(question.options, key=lambda o: o.text)
    random.Random(shuffle_seed(chapter, question.question)).shuffle(options)
    if answer_at is not None:
        check_int("answer_at", answer_at, 0, len(options) - 1)
        right = next(i for i, o in enumerate(options) if o.correct)
        options[right], options[answer_at] = options[answer_at], options[right]
    return replace(question, options=tuple(options))


def answer_positions(chapter: int, num_options: Sequence[int]) -> list[int]:
    """Where each question of a chapter shows its correct option.

    Independent shuffles can, by chance, put four answers of a six-question quiz in the
    first place, which a reader notices. So the positions are balanced (each used
    ``len // k`` or one more times, k = the fewest options of any question; which places get
    the one more rotates with the chapter) and their order is a seeded shuffle: no position
    dominates, in a chapter or over the course, and no rotation can be read off.
    """
    k = min(num_options)
    rng = random.Random(shuffle_seed(chapter, "answer positions"))
    rounds, extra = divmod(len(num_options), k)
    # The leftover places rotate with the chapter number, so that over the whole course no
    # position collects more leftovers than another (independent draws would pile up).
    slots = list(range(k)) * rounds + [(chapter * extra + i) % k for i in range(extra)]
    rng.shuffle(slots)
    return slots


def quarter_shares(position: int, num_options: int) -> list[float]:
    """How much of each quarter of the option list (first ... last) a position covers.

    Position p of k options covers the stretch [p/k, (p+1)/k) of the list; the shares say
    how that stretch splits over the quarters [0, 1/4), [1/4, 1/2), ... They add up to 1,
    and a question of any size spreads one unit evenly when its answer is placed at random:
    the common scale on which questions with 4, 5 or 6 options can be balanced together.
    """
    if not 0 <= position < num_options:
        raise ValueError(f"position {position} is outside 0..{num_options - 1}")
    low, high = position / num_options, (position + 1) / num_options
    return [max(0.0, min(high, (q + 1) / 4) - max(low, q / 4)) * num_options for q in range(4)]


def live_answer_positions(chapter: int, shown: Sequence[tuple[int, int]], num_options: Sequence[int]) -> list[int]:
    """Where each live question shows its correct option, given the chapter's other questions.

    ``shown`` holds (position of the correct option, number of options) for the questions
    already placed. Live questions are added to a chapter whose file questions already use
    balanced positions; left to their own shuffles they would pile up by chance. Each one
    takes the place that keeps the chapter's use of the option list's quarters most even
    (``quarter_shares``; ties drawn by a generator seeded from the chapter), so the order
    is the same on every run and no part of the list collects the answers.
    """
    rng = random.Random(shuffle_seed(chapter, "live answer positions"))
    used = [0.0] * 4
    for position, k in shown:
        used = [u + x for u, x in zip(used, quarter_shares(position, k))]
    slots = []
    for k in num_options:
        if k < 1:
            raise ValueError(f"a question needs options, got {k}")
        cost = {p: round(sum((u + x) ** 2 for u, x in zip(used, quarter_shares(p, k))), 9) for p in range(k)}
        slot = rng.choice([p for p in range(k) if cost[p] == min(cost.values())])
        used = [u + x for u, x in zip(used, quarter_shares(slot, k))]
        slots.append(slot)
    return slots


def make_question(question: str, correct: tuple[str, str], wrong: Sequence[tuple[str, str]],
                  chapter: int = 0) -> Question:
    """A question from a computed answer: ``correct`` and each of ``wrong`` are (text, explanation).

    Wrong options whose text equals the correct one or an earlier wrong one are dropped
    (two different mistakes can give the same number), so every option shown is distinct
    and exactly one is right. The options come back shuffled by ``shuffle_options``.
    """
    text, why = correct
    options, seen = [Option(str(text), True, str(why))], {str(text)}
    for wrong_text, wrong_why in wrong:
        if str(wrong_text) not in seen:
            seen.add(str(wrong_text))
            options.append(Option(str(wrong_text), False, str(wrong_why)))
    built = Question(question, tuple(options))
    check_question(built, "live question")
    return shuffle_options(built, chapter)


def check_question(question: Question, where: str) -> None:
    """Raise ValueError unless ``question`` has two or more distinct options, exactly one
    correct, and an explanation for each."""
    options = question.options
    if not question.question.strip():
        raise ValueError(f"{where}: the question text is empty")
    if len(options) < 2:
        raise ValueError(f"{where}: needs at least two options, has {len(options)}")
    if sum(o.correct for o in options) != 1:
        raise ValueError(f"{where}: needs exactly one correct option, has {sum(o.correct for o in options)}")
    if any(not o.explanation.strip() for o in options):
        raise ValueError(f"{where}: every option needs an explanation")
    if len({o.text for o in options}) != len(options):
        raise ValueError(f"{where}: two options have the same text")


def load_quiz(chapter: int | str | Path, shuffle: bool = True, lang: str | None = None) -> QuizData:
    """Read and validate a chapter's quiz (a chapter number or a path to a JSON file).

    With ``shuffle`` (the default) options come in display order (``shuffle_options``);
    ``shuffle=False`` keeps the file's order, for authors and tests. ``lang`` (default: the
    notebook's, ``translations.language()``) translates the texts after the shuffle.
    """
    path = Path(chapter) if isinstance(chapter, (str, Path)) else quiz_path(check_int("chapter", chapter, 1, 99))
    if not path.is_file():
        raise ValueError(f"no quiz file {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    english = _questions(data, path)
    number = int(data["chapter"])
    if shuffle:
        slots = answer_positions(number, [len(q.options) for q in english])
        order = [shuffle_options(q, number, at) for q, at in zip(english, slots)]
    else:
        order = english
    lang = lang or translations.language()
    if lang != "en":
        data = translations.translated_quiz(lang, data, path)
        theirs = _questions(data, path)
        order = [_in_order_of(shown, written, their) for shown, written, their in zip(order, english, theirs)]
    return QuizData(number, str(data["title"]), tuple(order))


def _questions(data: dict, path: Path) -> list[Question]:
    questions = []
    for i, q in enumerate(data.get("questions", [])):
        options = tuple(Option(str(o["text"]), bool(o["correct"]), str(o.get("explanation", ""))) for o in q["options"])
        question = Question(str(q["question"]), options)
        check_question(question, f"{path.name} question {i + 1}")
        questions.append(question)
    if len(questions) < MIN_QUESTIONS:
        raise ValueError(f"{path.name}: needs at least {MIN_QUESTIONS} questions, has {len(questions)}")
    return questions


def _in_order_of(shown: Question, written: Question, translated: Question) -> Question:
    """``translated`` (options in the file's order, like ``written``) with its options in the
    order ``shown`` puts ``written``'s."""
    place = {o.text: i for i, o in enumerate(written.options)}
    return replace(translated, options=tuple(translated.options[place[o.text]] for o in shown.options))


class QuizController:
    """Answers chosen, answers checked, and the score (first answers only)."""

    def __init__(self, quiz: QuizData) -> None:
        self.quiz = quiz
        self.chosen: dict[int, int] = {}
        self.checked: dict[int, Feedback] = {}  # the latest verdict of each question
        self.first_answers: dict[int, Feedback] = {}  # the verdict that counts for the score
        self.attempts: dict[int, int] = {}
        self.solved: set[int] = set()  # questions answered right at some try

    def select(self, question: int, option: int | None) -> None:
        q = self._question(question)
        if option is None:
            self.chosen.pop(question, None)
        else:
            self.chosen[question] = check_int("option", option, 0, len(q.options) - 1)
        self.checked.pop(question, None)  # a new choice must be checked again

    def check(self, question: int) -> Feedback:
        """Check the chosen option; the first check of each question is the one scored."""
        q = self._question(question)
        if question not in self.chosen:
            raise ValueError(tr("question {n}: choose an answer first", n=question + 1))
        chosen = self.chosen[question]
        attempt = self.attempts.get(question, 0) + 1
        feedback = Feedback(question, chosen, chosen == q.answer, q.options[chosen].explanation, attempt)
        self.attempts[question] = attempt
        self.checked[question] = feedback
        self.first_answers.setdefault(question, feedback)
        if feedback.correct:
            self.solved.add(question)
        return feedback

    @property
    def score(self) -> int:
        """Questions whose first checked answer was right."""
        return sum(f.correct for f in self.first_answers.values())

    @property
    def num_answered(self) -> int:
        return len(self.first_answers)

    @property
    def num_solved(self) -> int:
        """Questions answered right at some try (shown to the learner, never scored)."""
        return len(self.solved)

    @property
    def num_questions(self) -> int:
        return len(self.quiz.questions)

    def _question(self, index: int) -> Question:
        check_int("question", index, 0, self.num_questions - 1)
        return self.quiz.questions[index]


def render_feedback(question: Question, feedback: Feedback) -> str:
    """The verdict and why.

    Wrong: only the chosen option's explanation (why this one is wrong), and an invitation to
    try again; the right option is not revealed, so the next try still needs thought. Right:
    the chosen option's explanation, then every other option's, since comparing the
    mistakes is part of the lesson.
    """
    chosen = question.options[feedback.chosen]
    if not feedback.correct:
        again = (tr("Try another option: the score keeps your first answer, but the explanation of the right one "
                    "is worth reading.") if feedback.attempt == 1 else tr("Try another option."))
        return (f'<div class="ne-feedback" data-correct="false" style="font-size:13px">'
                f'<b style="color:#c62828">{tr("Not quite.")}</b> <b>✘ {escape(chosen.text)}</b> '
                f'{tr("(your answer)")}: '
                f'{escape(chosen.explanation)}<div style="margin-top:4px;color:#555">{again}</div></div>')
    verdict = (tr("Correct.") if feedback.attempt == 1 else
               tr("Correct (on try {n}; the score counts your first answer).", n=feedback.attempt))
    items = [f'<li class="ne-right"><b>✔ {escape(chosen.text)}</b> {tr("(your answer)")}: '
             f'{escape(chosen.explanation)}</li>']
    for i, o in enumerate(question.options):
        if i != feedback.chosen:
            items.append(f'<li class="ne-wrong"><b>✘ {escape(o.text)}</b>: {escape(o.explanation)}</li>')
    return (f'<div class="ne-feedback" data-correct="true" style="font-size:13px">'
            f'<b style="color:#2e7d32">{escape(verdict)}</b><ul style="margin:4px 0">{"".join(items)}</ul></div>')


class Quiz(W.VBox):
    """One chapter's quiz: radio options, a Check button per question, a score.

    ``live`` adds questions computed from the engine when the cell runs (see
    ``widgets/live_questions.py``), after the file's questions and shuffled the same way::

        Quiz(4, live=[kv_slot_question(engine.snapshot(), "req-0", position=20)])
    """

    def __init__(self, chapter: int | str | Path | QuizData, live: Sequence[Question] = ()) -> None:
        quiz = chapter if isinstance(chapter, QuizData) else load_quiz(chapter)
        for i, q in enumerate(live):
            if not isinstance(q, Question):
                raise TypeError(f"live[{i}] must be a widgets.quiz.Question, got {type(q).__name__}")
            check_question(q, f"live question {i + 1}")
        if live:
            slots = live_answer_positions(quiz.chapter, [(q.answer, len(q.options)) for q in quiz.questions],
                                          [len(q.options) for q in live])
            quiz = replace(quiz, questions=quiz.questions + tuple(
                shuffle_options(q, quiz.chapter, at) for q, at in zip(live, slots)))
        self.controller = QuizController(quiz)
        self.score_label = W.HTML()
        self.radios: list[W.RadioButtons] = []
        self.check_buttons: list[W.Button] = []
        self.feedback: list[W.HTML] = []
        boxes = []
        for i, q in enumerate(quiz.questions):
            radio = W.RadioButtons(options=[(o.text, j) for j, o in enumerate(q.options)], value=None,
                                   layout=W.Layout(width="auto"))
            button = W.Button(description=tr("Check"))
            feedback = W.HTML()
            radio.observe(self._on_select(i), names="value")
            button.on_click(self._on_check(i))
            self.radios.append(radio)
            self.check_buttons.append(button)
            self.feedback.append(feedback)
            boxes.append(W.VBox([W.HTML(f'<div style="font-size:14px;margin-top:8px"><b>{i + 1}.</b> '
                                        f'{escape(q.question)}</div>'), radio, button, feedback]))
        heading = tr("Quiz: chapter {chapter}, {title}", chapter=quiz.chapter, title=quiz.title)
        super().__init__([W.HTML(f"<h4>{escape(heading)}</h4>"), *boxes,
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
        self.score_label.value = (
            '<div class="ne-score" style="font-size:14px">'
            + tr("Score: <b>{score}</b> / {total} (first answers; {answered} answered, {solved} solved)",
                 score=c.score, total=c.num_questions, answered=c.num_answered, solved=c.num_solved)
            + '</div>')
