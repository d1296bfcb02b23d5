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
