"""A results file's provenance as a reader uses it today: the command that repeats the run, and
the engine revision it ran, in words (the chapters, the README's tables and ``peer_report`` print
them through here)."""

from __future__ import annotations

import re


def command_today(command: str) -> str:
    """A results file's recorded command as a reader runs it today.

    The measuring modules moved from ``nanoengine.measure`` to ``nanobench`` after some files were
    written: ``python -m nanoengine.measure.gpu_check`` is ``python -m nanobench.gpu_check`` now. The
    ``--out`` path is left out (the authors' scratch path; the file is the one in results/). A
    command that is not the repository's own (a script run once and not kept) is said to be one.
    """
    command = re.sub(r"python -m nanoengine\.measure\.(\w+)", r"python -m nanobench.\1", command)
    command = re.sub(r" --out \S+", "", command)  # where that run wrote its file: the file is in results/ now
    if command and not command.startswith(("python -m ", "./course ")):
        return "a script run once on that machine, not kept in the repository"
    return command


def revision_today(revision: str) -> str:
    """The engine revision a results file names, in words: ``e1a12bb+modified`` (or an older file's
    ``main at e1a12bb (working-tree copy)``) ran that commit with changes not yet committed."""
    match = re.fullmatch(r"(?:\w+ at )?([0-9a-f]{7,40})(\+modified| \(working-tree copy\))?", revision.strip())
    if not match:
        return revision
    return match.group(1) + (" with changes not yet committed" if match.group(2) else "")
