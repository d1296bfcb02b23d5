"""The learner's commands: start a lab, check it.

    ./course lab-start v05          copy starters/v05_paged_kv to work/v05_paged_kv (yours to edit)
    ./course lab-check v05          run v05's checks on work/v05_paged_kv; say what fails, with hints
    ./course lab-check v05 --solution   the same checks on the finished snapshot (they all pass)
    ./course lab-check v05 --dir PATH   ... on any copy of v05
    ./course lab-check v05 --time-limit 120   give each check up to 120 s (default 60; 0 = none)

(``./course`` calls this file with ``.venv/bin/python``; ``python lab_check.py lab-start|lab-check
...`` works the same, and so do the short names ``start`` / ``check``.) Each check prints its
line as soon as it finishes. A check that runs past its time limit (a loop in your copy that
never ends) fails with a message naming the function of your copy that was still running,
and the run stops there: the later checks would loop too, so they are listed as not run
(SKIP) instead of each waiting out its own limit. Should your code swallow the stop (an
``except BaseException`` in the loop), a watchdog ends the run a few seconds later with the
same verdict. The exit status is 0 only when every check passes. For full tracebacks run the
same checks under pytest::

    NANO_VLLM_LAB_DIR=labs/nano-vllm/work/v05_paged_kv python -m pytest labs/nano-vllm/checks/test_v05.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab_harness import (  # noqa: E402
    DEFAULT_TIME_LIMIT_S, LAB, LAB_VERSIONS, STARTERS, V, VERSIONS, WORK, CheckResult, check_functions, iter_checks,
    SAMPLES, live_stack, looping_function, sampled_stacks, skipped_result, timed_out_result, timeout_message,
    version_of)
from lab_tasks import PARTS, TASKS  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tiny tensors: sleeping threads are faster


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(LAB.parents[1]))
    except ValueError:
        return str(path)


READING_REPORT = VERSIONS / "v10_mapping"


def _lab_list() -> str:
    """'v01 ... v09, v11 and v12': the labs, with the gap where v10, the reading report, sits."""
    before = [v for v in LAB_VERSIONS if v < "v10"]
    after = [v for v in LAB_VERSIONS if v > "v10"]
    listed = [f"{before[0]} ... {before[-1]}", *after]
    return ", ".join(listed[:-1]) + f" and {listed[-1]}"


def _lab_version(name: str) -> str:
    text = name.strip().lower().rstrip("/").split("/")[-1]
    if text in ("v10", "10") or text.startswith("v10_"):
        raise SystemExit(f"v10 is not a lab to build: it is the reading report that maps every snapshot onto "
                         f"the original nano-vLLM and onto nanoengine. Read {_rel(READING_REPORT / 'MAPPING.md')} "
                         f"and {_rel(READING_REPORT / 'CODE_MAP.md')}, starting from {_rel(READING_REPORT / 'NOTES.md')}. "
                         f"The labs are {_lab_list()}.")
    try:
        version = version_of(name)
    except ValueError:
        raise ValueError(f"unknown version {name!r}: the labs are {_lab_list()} "
                         "(v10 is the reading report)") from None
    if version not in LAB_VERSIONS:
        raise SystemExit(f"{version} has no lab: v00 is the specification every version must match; "
                         f"the labs are {_lab_list()}")
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
    results: list[CheckResult] = []
    watchdog = _Watchdog(version, Path(folder).resolve(), limit, results, sys.stdout) if limit else None
    checks = iter_checks(version, folder, limit)
    try:
        while True:
            if watchdog:
                watchdog.arm()
            result = next(checks, None)  # runs the next check (print each as soon as it has run)
            if watchdog:
                watchdog.disarm()
            if result is None:
                break
            results.append(result)
            _print_result(result, version, results, sys.stdout)
    finally:
        if watchdog:
            watchdog.close()
    return _print_summary(results, version, sys.stdout)


WIDTH = 96


def _print_result(result: CheckResult, version: str, results: list[CheckResult], out) -> None:
    if result.skipped:
        if not results[-2].skipped:  # the first one not run: say why once
            stuck = f" (your copy was stuck in {results[-2].running})" if results[-2].running else ""
            print(textwrap.fill(f"the checks below were not run: the one above timed out{stuck}, and they "
                                f"would loop too. Fix that loop, then run ./course lab-check {version} again.",
                                WIDTH, initial_indent="  ", subsequent_indent="  "), file=out)
        print(f"  SKIP  {result.title}", file=out)
        out.flush()
        return
    print(f"  {'PASS' if result.passed else 'FAIL'}  {result.title}", file=out)
    if not result.passed:
        for line in result.error.splitlines():
            print(textwrap.fill(line, WIDTH, initial_indent="        ", subsequent_indent="          "), file=out)
        if result.hint:
            print(textwrap.fill(f"hint: {result.hint}", WIDTH, initial_indent="        ",
                                subsequent_indent="              "), file=out)
    out.flush()


def _next_step(version: str) -> str:
    """What to do after ``version`` passes: the next lab, and the reading report where it falls."""
    following = [v for v in LAB_VERSIONS if v > version]
    if not following:
        return f"That was the last lab: read the reading report {_rel(READING_REPORT)} next, if you have not yet."
    if version < "v10" < following[0]:
        return (f"Next: ./course lab-start {following[0]} (it builds on this one), and the reading report "
                f"{_rel(READING_REPORT)} maps everything so far onto nano-vLLM and nanoengine.")
    return f"Next: ./course lab-start {following[0]}"


def _print_summary(results: list[CheckResult], version: str, out) -> int:
    passed = sum(r.passed for r in results)
    print(f"{passed}/{len(results)} checks pass.", end=" ", file=out)
    if passed == len(results):
        print(f"{version} is done. {_next_step(version)}", file=out)
        out.flush()
        return 0
    skipped = sum(r.skipped for r in results)
    failed = len(results) - passed - skipped
    todo = sum(r.todo for r in results if not r.passed)
    print(f"{failed} fail" + (f" ({todo} on unwritten TODO({version}) stubs)" if todo else "")
          + (f", {skipped} not run (a check timed out)" if skipped else "")
          + ". Start with the first FAIL above.", file=out)
    out.flush()
    return 1


class _Watchdog:
    """The hard stop behind each check's time limit.

    The limit normally stops a check by raising inside it (``lab_harness.time_limit``). Code
    that catches that (``except BaseException`` in a loop), or one C call that never returns,
    would still hang the run; so a thread watches each check, and ``grace`` seconds after
    its limit it samples the stack of the main thread (where the check runs), prints the
    same verdict as a timeout (naming the copy's function still running), the later checks
    as not run and the summary, and ends the process with status 1."""

    def __init__(self, version: str, folder: Path, limit: float, results: list[CheckResult], out) -> None:
        self.version, self.folder, self.limit, self.results, self.out = version, folder, limit, results, out
        self.grace = min(10.0, max(1.0, limit / 2))
        self.functions = check_functions(version)
        self.main = threading.main_thread().ident
        self.deadline: float | None = None
        self.lock = threading.Lock()
        self.closed = threading.Event()
        threading.Thread(target=self._watch, name="lab-check watchdog", daemon=True).start()

    def close(self) -> None:
        self.closed.set()

    def arm(self) -> None:
        with self.lock:
            self.deadline = time.monotonic() + self.limit + self.grace

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None

    def _watch(self) -> None:
        while not self.closed.wait(0.2):
            with self.lock:
                overdue = self.deadline is not None and time.monotonic() > self.deadline
            if overdue:
                self._stop()

    def _stop(self) -> None:
        samples = []
        for _ in range(SAMPLES):  # the main thread's stack, where the check runs (see lab_harness.time_limit)
            frame = sys._current_frames().get(self.main)
            if frame is not None:
                samples.append(live_stack(frame))
            time.sleep(0.05)
        running, callers = looping_function(*sampled_stacks(samples), self.folder)
        with self.lock:
            if self.deadline is None:  # the check ended while its stack was sampled
                return
        index = len(self.results)
        function = self.functions[index]
        limit = f"did not finish within {self.limit:g} s (nor {self.grace:g} s after being told to stop)"
        stuck = timed_out_result(function, timeout_message(limit, running, callers), running)
        self.results.append(stuck)
        _print_result(stuck, self.version, self.results, self.out)
        for later in self.functions[index + 1:]:
            self.results.append(skipped_result(later, stuck))
            _print_result(self.results[-1], self.version, self.results, self.out)
        _print_summary(self.results, self.version, self.out)
        os._exit(1)


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
    p_start.add_argument("version", help="v01 ... v09, v11, v12")
    p_start.add_argument("--force", action="store_true", help="overwrite an existing working copy")
    p_start.set_defaults(run=start, parser=p_start)
    p_check = sub.add_parser("lab-check", aliases=["check"], help="run a version's checks on a copy")
    p_check.add_argument("version", help="v01 ... v09, v11, v12")
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
