"""Generate the learner's starters from the finished snapshots.

    python labs/nano-vllm/checks/make_starters.py          # (re)write labs/nano-vllm/starters/
    python labs/nano-vllm/checks/make_starters.py --check  # exit 1 if starters/ is stale

For each lab version (v01-v09, v11 and v12) the starter is a copy of ``versions/vNN_*/`` (its ``.py`` files,
its ``NOTES.md`` and its ``expected_output.txt``) in which every function listed in ``lab_tasks.TASKS`` keeps its signature and docstring
but loses its body. The body becomes a comment saying what to write, and::

    raise NotImplementedError("TODO(vNN): write Class.method (see NOTES.md)")

The replacement works on the source text, guided by ``ast`` line numbers, so everything
else in the file - comments, spacing, the other functions - stays byte for byte as in
the snapshot. The snapshots stay the single source of truth: never edit a starter by
hand, edit the snapshot (or the task table) and regenerate.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab_harness import LAB_VERSIONS, STARTERS, V, VERSIONS  # noqa: E402
from lab_tasks import TASKS, Stub  # noqa: E402


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(node.body for node in scope if isinstance(node, ast.ClassDef) and node.name == owner)
    for node in scope:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"{qualname} not found")


def stub_source(source: str, version: str, stubs: list[Stub], file_name: str) -> str:
    """Replace the bodies of ``stubs`` in one file's source; everything else is untouched."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for stub in stubs:
        node = _find(tree, stub.qualname)
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        if has_doc and len(body) == 1:
            raise ValueError(f"{file_name}:{stub.qualname} has only a docstring")
        first = body[1] if has_doc else body[0]
        start = (body[0].end_lineno + 1) if has_doc else first.lineno  # 1-based, first replaced line
        indent = " " * first.col_offset
        comment = textwrap.wrap(f"TODO({version}): {stub.todo}", width=92 - len(indent) - 2,
                                break_on_hyphens=False)
        new = [f"{indent}# {line}\n" for line in comment]
        new.append(f'{indent}raise NotImplementedError("TODO({version}): write {stub.qualname} '
                   f'(see NOTES.md)")\n')
        edits.append((start, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = new
    return "".join(lines)


COPIED = ("NOTES.md", "NOTES.ko.md", "expected_output.txt")  # travel with the starter, unchanged (where present)


def starter_files(version: str) -> dict[str, str]:
    """File name -> text of one version's starter: its stubbed ``.py`` files, its notes
    (the task; ``NOTES.ko.md`` in Korean, built by ``python -m translations build``) and its
    transcript (what ``run.py`` must print)."""
    solution = VERSIONS / V[version]
    files = {name: (solution / name).read_text() for name in COPIED if (solution / name).is_file()}
    for path in sorted(solution.glob("*.py")):
        stubs = [s for s in TASKS[version] if s.file == path.name]
        text = path.read_text()
        files[path.name] = stub_source(text, version, stubs, path.name) if stubs else text
    missing = {s.file for s in TASKS[version]} - set(files)
    if missing:
        raise FileNotFoundError(f"{version}: task names files that do not exist: {sorted(missing)}")
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether starters/ is up to date")
    args = parser.parse_args()
    stale = []
    for version in LAB_VERSIONS:
        folder = STARTERS / V[version]
        wanted = starter_files(version)
        present = {p.name for p in folder.iterdir() if p.is_file()} if folder.is_dir() else set()
        for name, text in wanted.items():
            path = folder / name
            if not path.exists() or path.read_text() != text:
                stale.append(path)
                if not args.check:
                    folder.mkdir(parents=True, exist_ok=True)
                    path.write_text(text)
        for name in present - set(wanted):
            stale.append(folder / name)
            if not args.check:
                (folder / name).unlink()
    for path in stale:
        print(("stale: " if args.check else "wrote: ") + str(path.relative_to(VERSIONS.parent)))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
