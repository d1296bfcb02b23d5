"""Exercises (template v2): every chapter's checks fail on its scaffolds and pass on its solutions.

CI executes each chapter and its worked solution (``notebooks/solutions/``) under nbval,
so the saved outputs read here are what the checks print today. A chapter needs at least
three exercises; each check line in the chapter must say "not yet" (the untouched
scaffold), and the same exercise in the solution must say "right".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
VERDICT = re.compile(r"Exercise (\d+\.\d+): (right\.|not yet\.)")


def verdicts(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            texts = [output.get("text", "")] + [output.get("data", {}).get("text/plain", "")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                for exercise, verdict in VERDICT.findall(text):
                    found.setdefault(exercise, []).append(verdict)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_check_fails_on_the_scaffold_and_passes_on_the_solution(chapter: Path):
    number = int(chapter.name[:2])
    found = verdicts(chapter)
    assert len(found) >= 3, f"{chapter.name} has {len(found)} checked exercises; template v2 asks for 3"
    assert all(e.startswith(f"{number}.") for e in found), f"{chapter.name} checks another chapter's exercises"
    assert all(v == ["not yet."] for v in found.values()), \
        f"{chapter.name}: every check must say 'not yet' on the untouched scaffold: {found}"
    solutions = list((ROOT / "notebooks" / "solutions").glob(f"{chapter.name[:2]}_*.ipynb"))
    assert len(solutions) == 1, f"no worked solution notebooks/solutions/{chapter.name[:2]}_*.ipynb"
    solved = verdicts(solutions[0])
    assert set(solved) == set(found), f"the solution solves {sorted(solved)}, the chapter asks {sorted(found)}"
    assert all(v and set(v) == {"right."} for v in solved.values()), f"a solution does not pass: {solved}"


RAW_ERRORS = ("Error", "got None", "unsupported operand", "Traceback", "object is not")


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_a_hint_on_the_untouched_scaffold_says_what_to_fill_in(chapter: Path):
    """The first thing a learner sees from a check is what to do, never an exception's text."""
    for cell in json.loads(chapter.read_text())["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            if "not yet." in text:
                assert not any(raw in text for raw in RAW_ERRORS), f"{chapter.name}: {text.strip()[:300]}"


def test_a_scaffold_function_is_still_todo_until_its_placeholder_is_filled(tmp_path):
    import importlib.util

    from widgets.exercises import todo

    source = tmp_path / "scaffolds.py"
    source.write_text("def untouched(x):\n    noise = ...  # TODO: noise\n    return x + noise\n\n"
                      "def filled(x):\n    noise = 2 * x  # TODO: noise\n    return x[..., 0] + noise\n")
    spec = importlib.util.spec_from_file_location("scaffolds", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert todo(...) and todo(None) and todo(module.untouched)
    assert not todo(module.filled) and not todo(print) and not todo(0)
