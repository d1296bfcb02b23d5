"""The course index (notebooks/README.md) lists the chapters and their solutions for a learner,
and every link in it leads to a file. (The browser test follows a link for real.)"""

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
    for number in range(1, 15):
        row = re.search(rf"^\| {number} \| (.+) \|$", index, re.M)
        assert row, f"chapter {number} is missing from the index table"
        if number in written:
            assert f"]({written[number]})" in row.group(1) and "coming" not in row.group(1)
        else:
            assert "(coming)" in row.group(1) and "](" not in row.group(1)
    assert "](widgets_demo.ipynb)" in index


def test_the_index_reads_as_a_course_not_a_draft() -> None:
    """What a learner opens first lists every chapter's solutions and says nothing meant for authors
    (the chapter template lives in docs/CHAPTER_TEMPLATE.md, linked from the root README)."""
    index = (NOTEBOOKS / "README.md").read_text()
    for chapter in written_chapters():
        assert f"](solutions/{chapter.name})" in index, chapter.name
    for draft in ("Written today", "For authors", "chapter template", "NBVAL"):
        assert draft not in index, draft
    assert "](docs/CHAPTER_TEMPLATE.md)" in (REPO / "README.md").read_text()
    assert (REPO / "docs" / "CHAPTER_TEMPLATE.md").is_file()
