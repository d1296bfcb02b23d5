"""The course index (notebooks/README.md) and the root README say which chapters exist today,
and every link in the index leads to a file. (The browser test follows a link for real.)"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def written_chapters() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_chapters_are_numbered_from_one_without_gaps() -> None:
    numbers = [int(p.name[:2]) for p in written_chapters()]
    assert numbers and numbers == list(range(1, len(numbers) + 1))


def test_every_link_in_the_index_leads_to_a_file() -> None:
    index = (NOTEBOOKS / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", index)
    assert links
    for link in links:
        assert (NOTEBOOKS / link).is_file(), link


def test_the_index_table_links_written_chapters_and_marks_the_others_coming() -> None:
    index = (NOTEBOOKS / "README.md").read_text()
    written = {int(p.name[:2]): p.name for p in written_chapters()}
    for number in range(1, 14):
        row = re.search(rf"^\| {number} \| (.+) \|$", index, re.M)
        assert row, f"chapter {number} is missing from the index table"
        if number in written:
            assert f"]({written[number]})" in row.group(1) and "coming" not in row.group(1)
        else:
            assert "(coming)" in row.group(1) and "](" not in row.group(1)
    assert "](widgets_demo.ipynb)" in index


def test_both_readmes_say_which_chapters_are_written_today() -> None:
    phrase = f"Written today: chapters 1-{len(written_chapters())}"
    assert phrase in (NOTEBOOKS / "README.md").read_text()
    assert phrase in (REPO / "README.md").read_text()
