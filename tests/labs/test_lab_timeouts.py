"""``./course lab-check`` on a copy that loops forever: one verdict within one time limit.

A scheduler that waits for a free block nobody frees loops in every later check too. The run
stops at the first check that runs out of time, names the function of the learner's copy
that was still running, and lists the later checks as not run, instead of waiting out each
check's own limit (three minutes at the default 60 s). A loop that swallows the stop
(``except BaseException``) is ended by the watchdog a little later, with the same verdict.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "labs" / "nano-vllm" / "checks"
sys.path.insert(0, str(CHECKS))

import lab_check  # noqa: E402
import lab_harness as H  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # each waits out a time limit

LIMIT_S = 3.0
# The solution's eviction loop in v05's Scheduler.schedule, replaced by a wait for a block
# that nothing inside the wait frees: fine in a roomy pool, endless in a tight one.
EVICTION = """            while not self.block_manager.can_append(seq):
                victim = self.running.pop() if self.running else seq  # the newest request
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
"""
WAITING = """            self._wait_for_a_free_block(seq)
            self.block_manager.may_append(seq)
            scheduled.append(seq)
"""
WAIT = """
    def _wait_for_a_free_block(self, seq: Sequence) -> None:
        while not self.block_manager.can_append(seq):
            pass
"""
WAIT_SWALLOWING_THE_STOP = """
    def _wait_for_a_free_block(self, seq: Sequence) -> None:
        while True:
            try:
                while not self.block_manager.can_append(seq):
                    pass
                return
            except BaseException:  # the learner's catch-all also catches the time limit's stop
                continue
"""
LATER_CHECKS = ["test_c_the_victim_is_the_newest_running_request", "test_generate_reproduces_the_naive_loop",
                "test_run_prints_the_expected_transcript"]


def looping_copy(tmp_path: Path, wait: str) -> Path:
    copy = tmp_path / H.V["v05"]
    shutil.copytree(H.VERSIONS / H.V["v05"], copy, ignore=shutil.ignore_patterns("__pycache__"))
    scheduler = copy / "scheduler.py"
    text = scheduler.read_text()
    assert text.count(EVICTION) == 1, "v05's Scheduler.schedule changed: update EVICTION"
    text = text.replace(EVICTION, WAITING)
    text = text.replace("\n    def _preempt(", wait + "\n    def _preempt(", 1)
    scheduler.write_text(text)
    return copy


def titles(names: list[str]) -> list[str]:
    functions = {f.__name__: f for f in H.check_functions("v05")}
    return [H._doc_parts(functions[name])[0] for name in names]


def test_a_looping_scheduler_stops_the_run_at_the_first_timeout(tmp_path, capsys, monkeypatch) -> None:
    copy = looping_copy(tmp_path, WAIT)
    started = []  # the checks that ran, counted rather than timed (a busy machine makes any time limit flaky)
    run_check = H.run_check
    monkeypatch.setattr(H, "run_check", lambda function, *args: started.append(function.__name__)
                        or run_check(function, *args))
    code = lab_check.main(["check", "v05", "--dir", str(copy), "--time-limit", f"{LIMIT_S:g}"])
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the messages are wrapped
    assert code == 1, out
    all_checks = [f.__name__ for f in H.check_functions("v05")]
    assert started == all_checks[:-len(LATER_CHECKS)] and all_checks[-len(LATER_CHECKS):] == LATER_CHECKS, \
        started  # none of the later checks started, so none waited out a limit of its own
    assert out.count("did not finish within") == 1 and out.count("  FAIL  ") == 1, out  # one waited out its limit
    assert "your code was still running Scheduler._wait_for_a_free_block (scheduler.py:" in flat, out
    assert "called from Scheduler.schedule (scheduler.py:" in flat, out
    assert "not run" in out and out.count("  SKIP  ") == len(LATER_CHECKS), out
    for title in titles(LATER_CHECKS):
        assert f"  SKIP  {title}" in out, (title, out)
    assert "4/8 checks pass. 1 fail, 3 not run (a check timed out)." in out, out


def test_the_harness_reports_the_later_checks_as_skipped(tmp_path) -> None:
    copy = looping_copy(tmp_path, WAIT)
    results = H.run_checks("v05", copy, LIMIT_S)
    stuck = [r for r in results if r.timed_out]
    assert len(stuck) == 1 and stuck[0].name == "test_c_a_tight_pool_preempts_and_recomputes_exactly"
    assert stuck[0].running.startswith("Scheduler._wait_for_a_free_block (scheduler.py:")
    assert [r.name for r in results if r.skipped] == LATER_CHECKS
    assert all(not r.passed and "not run" in r.error for r in results if r.skipped)
    assert all(r.passed for r in results[:4])


# starts a process that waits out a limit and the grace after it (slow, as the whole module)
def test_a_loop_that_swallows_the_stop_is_ended_by_the_watchdog(tmp_path) -> None:
    copy = looping_copy(tmp_path, WAIT_SWALLOWING_THE_STOP)
    limit = 2.0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, str(CHECKS / "lab_check.py"), "check", "v05", "--dir", str(copy),
                           "--time-limit", f"{limit:g}"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    flat = " ".join(out.split())
    assert "nor 1 s after being told to stop" in flat, out  # the watchdog's verdict, grace = 1 s at a 2 s limit
    assert "your code was still running Scheduler._wait_for_a_free_block (scheduler.py:" in flat, out
    assert out.count("  SKIP  ") == len(LATER_CHECKS) and "3 not run" in out, out
