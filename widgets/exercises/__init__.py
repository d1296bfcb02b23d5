"""Exercise checks: a scaffold cell, a check that says right or not yet, a worked solution.

Every chapter ends with at least three exercises (template v2, docs/CHAPTER_TEMPLATE.md). Each
is two cells in the chapter:

* a **scaffold** the learner edits, with the value or line to change marked ``TODO``;
* a **check** that calls this chapter's check function (``widgets.exercises.chNN``), which
  returns a ``CheckResult`` printed as one line: ``Exercise 4.2: right. <why>`` or
  ``Exercise 4.2: not yet. Hint: <hint>``.

``notebooks/solutions/NN_*.ipynb`` holds the same exercises solved and explained. CI runs
both notebooks, and ``tests/course/test_exercises.py`` requires every check to say "not yet" on
the untouched scaffold and "right" on the solution, so a check that cannot fail, or a
solution that does not pass, is caught.

Checks judge what the learner's change *did* (a measured effect, an engine state, a
computed value), through the engine's public API, never the text of their code.

A check's words go through ``translations.tr`` (English templates with ``{name}`` fields), so a
learner in the Korean notebooks (``notebooks/ko/``) reads its verdict in Korean.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass

from translations import tr

LINE_WIDTH = 96  # a check's verdict is broken into lines this long (JupyterLab would wrap it anywhere)


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one exercise; prints as one line (deterministic: nbval compares it)."""

    exercise: str  # "4.2": chapter 4, exercise 2
    right: bool
    message: str  # why it is right, or a hint towards the answer

    def __str__(self) -> str:
        if self.right:
            return tr("Exercise {exercise}: right. {message}", exercise=self.exercise, message=self.message)
        return tr("Exercise {exercise}: not yet. Hint: {message}", exercise=self.exercise, message=self.message)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows the line, not the dataclass
        printer.text(str(self))


def verdict(exercise: str, right: bool, success: str, hint: str) -> CheckResult:
    """The result of a check: ``success`` explains a right answer, ``hint`` points towards one.

    The message is broken into lines so that the printed verdict, its "Exercise N.k: ..."
    head included, has no line longer than ``LINE_WIDTH`` characters.
    """
    head = str(CheckResult(exercise, bool(right), ""))
    message = success if right else hint
    wrapped = textwrap.fill(head + message, width=LINE_WIDTH)
    return CheckResult(exercise, bool(right), wrapped[len(head):])


def whole(value, low: int, high: int) -> int | None:
    """``value`` as an int if it is a whole number (not a bool) in [low, high], else None."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value) if low <= value <= high else None


def todo(value) -> bool:
    """True while a scaffold value is still the placeholder ``...`` (Ellipsis) or None, or is a
    function whose source still has the scaffold's ``...  # TODO`` line (not filled in yet)."""
    if value is ... or value is None:
        return True
    if not inspect.isfunction(value):
        return False
    try:
        source = inspect.getsource(value)
    except (OSError, TypeError):  # defined where no source is kept
        return False
    return re.search(r"\.\.\.\s*#\s*TODO", source) is not None
