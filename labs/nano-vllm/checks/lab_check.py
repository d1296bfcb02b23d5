"""The learner's commands: start a lab, check it.

    ./course lab-start v05          copy starters/v05_paged_kv to work/v05_paged_kv (yours to edit)
    ./course lab-check v05          run v05's checks on work/v05_paged_kv; say what fails, with hints
    ./course lab-check v05 --solution   the same checks on the finished snapshot (they all pass)
    ./course lab-check v05 --dir PATH   ... on any copy of v05
    ./course lab-check v05 --time-limit 120   give each check up to 120 s (default 60; 0 = none)

(``./course`` calls this file with ``.venv/bin/python``; ``python lab_check.py lab-start|lab-check
...`` works the same, and so do the short names ``start`` / ``check``.) Each check prints its
line as soon as it finishes, and a check that runs past its time limit (a loop in your copy
that never ends) fails with a message instead of hanging. The exit status is 0 only when
every check passes. For full tracebacks run the same checks under pytest::

    NANO_VLLM_LAB_DIR=labs/nano-vllm/work/v05_paged_kv python -m pytest labs/nano-vllm/checks/test_v05.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab_harness import (  # noqa: E402
    DEFAULT_TIME_LIMIT_S, LAB, LAB_VERSIONS, STARTERS, V, VERSIONS, WORK, iter_checks, version_of)
from lab_tasks import PARTS, TASKS  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tiny tensors: sleeping threads are faster


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(LAB.parents[1]))
    except ValueError:
        return str(path)


READING_REPORT = VERSIONS / "v10_mapping"


def _lab_version(name: str) -> str:
    text = name.strip().lower().rstrip("/").split("/")[-1]
    if text in ("v10", "10") or text.startswith("v10_"):
        raise SystemExit(f"v10 is not a lab to build: it is the reading report that maps every snapshot onto "
                         f"the original nano-vLLM and onto nanoengine. Read {_rel(READING_REPORT / 'MAPPING.md')} "
                         f"and {_rel(READING_REPORT / 'CODE_MAP.md')}, starting from {_rel(READING_REPORT / 'NOTES.md')}. "
                         f"Labs are {LAB_VERSIONS[0]}-{LAB_VERSIONS[-1]}.")
    try:
        version = version_of(name)
    except ValueError:
        raise ValueError(f"unknown version {name!r}: the labs are {LAB_VERSIONS[0]} ... {LAB_VERSIONS[-1]} "
                         "(v10 is the reading report)") from None
    if version not in LAB_VERSIONS:
        raise SystemExit(f"{version} has no lab: v00 is the specification every version must match; "
                         f"labs are {LAB_VERSIONS[0]}-{LAB_VERSIONS[-1]}")
    return version


def start(args: argparse.Namespace) -> int:
    version = _lab_version(args.version)
    source, target = STARTERS / V[version], WORK / V[version]
    if target.exists() and not args.force:
        print(f"{_rel(target)} already exists - it is your work, so it is left alone.\n"
              f"Check it with: ./course lab-check {version}   (start over with --force)")
        return 1
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"Copied the {version} starter to {_rel(target)}. Your task:")
    for stub in TASKS[version]:
        print(f"  - {stub.file} :: {stub.qualname}")
    print(f"Read {_rel(VERSIONS / V[version] / 'NOTES.md')} ('Your task'), write the stubs marked "
          f"TODO({version}), then run: ./course lab-check {version}")
    return 0


def check(args: argparse.Namespace) -> int:
    version = _lab_version(args.version)
    if args.solution:
        folder = VERSIONS / V[version]
    elif args.starter:
        folder = STARTERS / V[version]
    else:
        folder = Path(args.dir) if args.dir else WORK / V[version]
    if not folder.is_dir():
        print(f"No copy of {version} at {_rel(folder)}. Make one with: ./course lab-start {version}")
        return 2
    limit = args.time_limit
    print(f"lab-check {version} on {_rel(folder)}" + (f" (each check stops after {limit:g} s)" if limit else ""),
          flush=True)
    parts = PARTS.get(version, {})
    if parts:
        print("  this version has parts: " + "; ".join(f"{k} = {v}" for k, v in parts.items()), flush=True)
    width = 96
    results = []
    for result in iter_checks(version, folder, limit):  # print each check as soon as it has run
        results.append(result)
        print(f"  {'PASS' if result.passed else 'FAIL'}  {result.title}")
        if not result.passed:
            for line in result.error.splitlines():
                print(textwrap.fill(line, width, initial_indent="        ", subsequent_indent="          "))
            if result.hint:
                print(textwrap.fill(f"hint: {result.hint}", width, initial_indent="        ",
                                    subsequent_indent="              "))
        sys.stdout.flush()
    passed = sum(r.passed for r in results)
    print(f"{passed}/{len(results)} checks pass.", end=" ")
    if passed == len(results):
        following = [v for v in LAB_VERSIONS if v > version]
        print(f"{version} is done." + (f" Next: ./course lab-start {following[0]}" if following else
                                       " That was the last lab: read versions/v10_mapping next."))
        return 0
    todo = sum(r.todo for r in results if not r.passed)
    print(f"{len(results) - passed} fail" + (f" ({todo} on unwritten TODO({version}) stubs)" if todo else "")
          + ". Start with the first FAIL above.")
    return 1


def _time_limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be seconds >= 0 (0 = no limit), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./course", description="Start or check a nano-vLLM lab.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{lab-start,lab-check}")
    p_start = sub.add_parser("lab-start", aliases=["start"], help="copy a starter to labs/nano-vllm/work/")
    p_start.add_argument("version", help="v01 ... v09")
    p_start.add_argument("--force", action="store_true", help="overwrite an existing working copy")
    p_start.set_defaults(run=start, parser=p_start)
    p_check = sub.add_parser("lab-check", aliases=["check"], help="run a version's checks on a copy")
    p_check.add_argument("version", help="v01 ... v09")
    where = p_check.add_mutually_exclusive_group()
    where.add_argument("--dir", help="the copy to check (default: labs/nano-vllm/work/vNN_*)")
    where.add_argument("--solution", action="store_true", help="check the finished snapshot")
    where.add_argument("--starter", action="store_true", help="check the untouched starter")
    p_check.add_argument("--time-limit", type=_time_limit, default=DEFAULT_TIME_LIMIT_S, metavar="SECONDS",
                         help=f"stop a check after this long (default {DEFAULT_TIME_LIMIT_S:g}; 0 = no limit)")
    p_check.set_defaults(run=check, parser=p_check)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:  # an unknown version name
        args.parser.error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
