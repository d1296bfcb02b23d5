"""The lab harness: run one version's checks against any copy of that version.

A *copy* is a folder laid out like a snapshot (``sequence.py``, ``scheduler.py``, ...,
``run.py``): the finished snapshot under ``versions/`` (the solution), the stubbed
starter under ``starters/``, or a learner's working copy under ``work/``. The checks
(``test_v01.py`` ... ``test_v09.py``, ``test_v11.py``, ``test_v12.py`` next to this file) never name a folder; they get a
``Lab`` and ask it for modules, so the same check runs against all three.

Used three ways:

- ``./course lab-check v05`` (``lab_check.py``) runs the checks in-process and prints
  PASS/FAIL with a hint for each failure;
- ``pytest labs/nano-vllm/checks/test_v05.py`` runs them as ordinary tests, against the
  folder named by the environment variable ``NANO_VLLM_LAB_DIR`` (default: the solution),
  for full tracebacks;
- ``tests/labs/test_labs.py`` proves that every solution passes and every starter fails.

Snapshot folders are not packages (their modules import each other by plain name, as
scripts do), so ``Lab.load`` puts one folder on ``sys.path`` at a time and removes its
modules from ``sys.modules`` afterwards: versions never see each other's files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import linecache
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Callable, Iterator

CHECKS = Path(__file__).resolve().parent
LAB = CHECKS.parent  # labs/nano-vllm
VERSIONS = LAB / "versions"
STARTERS = LAB / "starters"
WORK = LAB / "work"

V = {
    "v00": "v00_naive_loop",
    "v01": "v01_request_state",
    "v02": "v02_engine_step",
    "v03": "v03_prefill_decode",
    "v04": "v04_continuous_batching",
    "v05": "v05_paged_kv",
    "v06": "v06_model_runner",
    "v07": "v07_prefix_cache",
    "v08": "v08_sampling_params",
    "v09": "v09_tiny_transformer",
    "v11": "v11_speculative_decoding",  # built on v09; v10 is the reading report, not a version with code
    "v12": "v12_structured_output",  # built on v11
}
LAB_VERSIONS = tuple(v for v in V if v != "v00")  # v00 is the specification, not a lab

SIBLING_MODULES = ("toy_model", "sequence", "llm_engine", "scheduler", "block_manager", "model_runner",
                   "sampler", "sampling_params", "tiny_transformer", "ngram_proposer", "rejection_sampler", "structured_output", "run")

# Inputs shared by the checks.
SYSTEM_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]
PROMPTS = [[5, 9, 13, 2, 8], [7, 7, 1], [3, 14, 15, 9, 2, 6, 5], [11, 4],
           SYSTEM_PROMPT + [1, 2, 3], SYSTEM_PROMPT + [9, 9]]
MAX_TOKENS = 6


def version_of(name: str) -> str:
    """'v05', '5', '05' or 'v05_paged_kv' -> 'v05'; ValueError otherwise."""
    text = name.strip().lower().rstrip("/").split("/")[-1]
    digits = text[1:3] if text.startswith("v") else text[:2]
    key = f"v{int(digits):02d}" if digits.isdigit() else ""
    if key not in V:
        raise ValueError(f"unknown version {name!r}; expected one of {', '.join(V)}")
    return key


class Lab:
    """One copy of one version: where its files are, and how to import them in isolation."""

    def __init__(self, folder: Path | str, version: str | None = None) -> None:
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise FileNotFoundError(f"no such folder: {self.folder}")
        self.version = version or version_of(self.folder.name)
        self.solution = VERSIONS / V[self.version]

    def __repr__(self) -> str:
        return f"Lab({self.version}, {self.folder})"

    def load(self, *module_names: str) -> SimpleNamespace:
        """Import modules of this copy by file path, isolated from every other copy."""
        saved = {name: sys.modules.pop(name) for name in SIBLING_MODULES if name in sys.modules}
        sys.path.insert(0, str(self.folder))
        dont_write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep folders clean
        try:
            loaded = {}
            for name in module_names:
                if name not in sys.modules:  # not already imported as another module's dependency
                    path = self.folder / f"{name}.py"
                    spec = importlib.util.spec_from_file_location(name, path)
                    if spec is None or not path.exists():
                        raise FileNotFoundError(f"{path} is missing")
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[name] = module
                    spec.loader.exec_module(module)
                loaded[name] = sys.modules[name]
            return SimpleNamespace(**loaded)
        finally:
            sys.dont_write_bytecode = dont_write_bytecode
            sys.path.remove(str(self.folder))
            for name in SIBLING_MODULES:
                sys.modules.pop(name, None)
            sys.modules.update(saved)

    def run_main(self) -> str:
        """Run this copy's ``run.py`` (its ``main()``) in-process and return what it printed."""
        run = self.load("run").run
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run.main()
        return out.getvalue()

    @property
    def expected_output(self) -> str:
        """The solution's full transcript, ``versions/vNN_*/expected_output.txt``."""
        return (self.solution / "expected_output.txt").read_text()


@lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    run = Lab(VERSIONS / V["v00"]).load("run").run
    return tuple(run.generate(list(prompt), max_tokens))


def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """v00's naive loop (always the solution): the tokens every toy version must reproduce."""
    return list(_reference(tuple(prompt), max_tokens))


def run_to_end(engine) -> list:
    """Step an engine until it is idle; return every StepOutput."""
    steps = []
    while not engine.is_finished():
        steps.append(engine.step())
        assert len(steps) < 1000, "the engine did not finish within 1000 steps"
    return steps


def first_difference(actual: str, expected: str) -> str:
    """A short report of where two transcripts first differ ('' if equal)."""
    if actual == expected:
        return ""
    got, want = actual.splitlines(), expected.splitlines()
    for i, (g, w) in enumerate(zip(got, want), start=1):
        if g != w:
            return f"line {i} differs:\n  expected: {w}\n  printed:  {g}"
    if len(got) != len(want):
        return f"printed {len(got)} lines, expected {len(want)}"
    return "the transcripts differ in whitespace at the end of a line or of the file"


def check_transcript(lab: Lab) -> None:
    """The shared transcript check: ``run.py`` prints exactly the solution's transcript."""
    diff = first_difference(lab.run_main(), lab.expected_output)
    assert not diff, f"run.py output differs from versions/{V[lab.version]}/expected_output.txt: {diff}"


# --------------------------------------------------------------------------- running checks

@dataclass(frozen=True)
class CheckResult:
    name: str  # the check function's name, e.g. test_block_tables_are_consistent
    title: str  # first line of its docstring
    hint: str  # the 'Hint:' paragraph of its docstring
    error: str  # '' when the check passed, else a short explanation
    todo: bool  # the failure is a TODO stub that is still unwritten
    timed_out: bool = False  # stopped at its time limit
    running: str = ""  # when timed out: the function of the copy that was still running, if any
    skipped: bool = False  # not run: an earlier check timed out (the copy loops; later checks would too)

    @property
    def passed(self) -> bool:
        return not self.error


def load_check_module(version: str) -> ModuleType:
    """Import ``test_vNN.py`` (once) as ``lab_checks_vNN``."""
    name = f"lab_checks_{version}"
    if name not in sys.modules:
        if str(CHECKS) not in sys.path:
            sys.path.insert(0, str(CHECKS))
        spec = importlib.util.spec_from_file_location(name, CHECKS / f"test_{version}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def check_functions(version: str) -> list[Callable[[Lab], None]]:
    """The ``test_*`` functions of a version's check module, in the order they are written."""
    module = load_check_module(version)
    functions = [f for name, f in vars(module).items()
                 if name.startswith("test_") and inspect.isfunction(f) and f.__module__ == module.__name__]
    return sorted(functions, key=lambda f: f.__code__.co_firstlineno)


def _doc_parts(function: Callable) -> tuple[str, str]:
    doc = inspect.getdoc(function) or function.__name__
    title = doc.splitlines()[0]
    hint = doc.split("Hint:", 1)[1].strip() if "Hint:" in doc else ""
    return title, " ".join(hint.split())


DEFAULT_TIME_LIMIT_S = 60.0  # per check; every solution's check takes well under a second


Frame = tuple[str, int, str]  # (file, line, qualified function name); stacks list them outermost first
SAMPLES, SAMPLE_GAP_S = 5, 0.02  # a timed-out check's stack is sampled this often before it is stopped


def frame_info(frame) -> Frame:
    code = frame.f_code
    return code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)


def live_stack(frame) -> list:
    """The frame objects of a live stack ending at ``frame``, outermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def sampled_stacks(samples: list[list]) -> tuple[list[Frame], list[Frame]]:
    """From stacks of one thread sampled a few ms apart: (the frames in every sample, the last stack).

    A loop's own frame stays on the stack from sample to sample, while the short calls it
    makes come and go: the frames common to every sample (the same frame objects, not just
    the same function) end at the loop, the last stack ends wherever it happened to be."""
    common = []
    for frames in zip(*samples):
        if any(f is not frames[0] for f in frames):
            break
        common.append(frames[0])
    return [frame_info(f) for f in common], [frame_info(f) for f in samples[-1]] if samples else []


class CheckTimeout(BaseException):
    """A check ran past its time limit (raised inside the check by ``time_limit``).

    A BaseException, like KeyboardInterrupt, so that an ``except Exception`` in the
    learner's code cannot swallow it and keep looping. ``stack``: the frames that stayed
    on the stack while it was sampled (they end at the loop); ``last``: the last sample."""

    def __init__(self, message: str, stack: list[Frame] = (), last: list[Frame] = ()) -> None:
        super().__init__(message)
        self.stack, self.last = list(stack), list(last)


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``CheckTimeout`` inside the block once ``seconds`` have passed.

    An infinite loop in a learner's copy (a scheduler that waits for a free block that
    never comes) must end the check, not the session. On Unix, in the main thread, a
    real-time timer delivers SIGALRM and its handler raises; elsewhere a timer thread
    interrupts the main thread (``_thread.interrupt_main``) and the KeyboardInterrupt is
    turned into ``CheckTimeout``. Either way the stack is first sampled ``SAMPLES`` times,
    ``SAMPLE_GAP_S`` apart (so the message can name the loop, not whatever short call it
    was making), and the check stops at its next Python bytecode; a single C call that
    never returns (one huge tensor op) cannot be interrupted. ``None`` or 0 means no limit.
    """
    if not seconds:
        yield
        return
    if seconds < 0:
        raise ValueError(f"a time limit must be positive seconds (or 0/None for none), got {seconds}")
    message = f"did not finish within {seconds:g} s"
    samples: list[list] = []
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        def on_alarm(signum, frame):
            samples.append(live_stack(frame))
            if len(samples) < SAMPLES:
                signal.setitimer(signal.ITIMER_REAL, SAMPLE_GAP_S)
                return
            raise CheckTimeout(message, *sampled_stacks(samples))
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            samples.clear()  # frame objects: let them go
        return
    import _thread
    import time
    fired = threading.Event()
    checked = threading.get_ident()

    def interrupt() -> None:
        for _ in range(SAMPLES):
            frame = sys._current_frames().get(checked)
            if frame is not None:
                samples.append(live_stack(frame))
            time.sleep(SAMPLE_GAP_S)
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(seconds, interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if fired.is_set():
            raise CheckTimeout(message, *sampled_stacks(samples)) from None
        raise
    finally:
        timer.cancel()
        samples.clear()


def traceback_frames(tb) -> list[Frame]:
    """The frames of a traceback, outermost first."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)))
        tb = tb.tb_next
    return frames


def still_running(frames: list[Frame], folder: Path) -> tuple[str, str]:
    """(the innermost function of the copy in ``frames``, the copy's calls that led to it).

    E.g. ``("Scheduler.schedule (scheduler.py:74)", "LLMEngine.step (llm_engine.py:40)")``;
    ``("", "")`` when no frame is in the copy (the check itself was running)."""
    mine = [f"{name} ({Path(file).name}:{line})" for file, line, name in frames
            if Path(file).resolve().parent == folder]
    if not mine:
        return "", ""
    return mine[-1], " < ".join(reversed(mine[:-1]))


def looping_function(stack: list[Frame], last: list[Frame], folder: Path) -> tuple[str, str]:
    """``still_running`` of the frames common to every sample, else of the last sample."""
    found = still_running(stack, folder)
    return found if found[0] else still_running(last, folder)


def timeout_message(limit: str, running: str, callers: str) -> str:
    """What a learner reads when a check ran out of time."""
    if not running:
        return (f"timed out: the check {limit}, stopped inside the check, not in your files "
                "(a step that never finishes the requests?).")
    called = f", called from {callers}" if callers else ""
    return (f"timed out: the check {limit}; your code was still running {running}{called}. "
            "A loop there is waiting for something that nothing inside the loop changes.")


def _failed_line(exc: BaseException) -> str:
    """The source line of the innermost frame that raised (for an assertion without a message)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()


def _timed_out_in(exc: CheckTimeout, folder: Path) -> tuple[str, str]:
    last = exc.last or traceback_frames(exc.__traceback__)
    return looping_function(exc.stack, last, folder)


def _explain(exc: BaseException, folder: Path) -> tuple[str, bool]:
    """One readable paragraph for a failed check, pointing into the copy's own files."""
    message = str(exc).strip()
    is_todo = isinstance(exc, NotImplementedError) and message.startswith("TODO(")
    if is_todo:
        return f"not written yet: {message}", True
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).resolve().parent == folder:
            where = f" (at {Path(frame.filename).name}:{frame.lineno}, in {frame.name})"
            break
    if isinstance(exc, CheckTimeout):
        return timeout_message(message, *_timed_out_in(exc, folder)), False
    kind = "check failed" if isinstance(exc, AssertionError) else type(exc).__name__
    if not message:
        line = _failed_line(exc)
        message = f"this condition is false: {line}" if line else "(the check gave no reason)"
    lines = message.splitlines()
    short = "\n".join(lines[:8]) + ("\n..." if len(lines) > 8 else "")
    return f"{kind}{where}: {short}", False


def run_check(function: Callable[[Lab], None], lab: Lab,
              time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> CheckResult:
    """Run one check on one copy, stopped after ``time_limit_s`` seconds (None: no limit)."""
    title, hint = _doc_parts(function)
    try:
        with time_limit(time_limit_s):
            function(lab)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - pytest.raises failures are BaseExceptions
        error, todo = _explain(exc, lab.folder)
        if isinstance(exc, CheckTimeout):
            return timed_out_result(function, error, _timed_out_in(exc, lab.folder)[0])
        return CheckResult(function.__name__, title, hint, error, todo)
    return CheckResult(function.__name__, title, hint, "", False)


def timed_out_result(function: Callable[[Lab], None], error: str, running: str) -> CheckResult:
    """A check stopped at its time limit while ``running`` (a function of the copy, or '')."""
    title, hint = _doc_parts(function)
    return CheckResult(function.__name__, title, hint, error, False, timed_out=True, running=running)


def skipped_result(function: Callable[[Lab], None], stuck: CheckResult) -> CheckResult:
    """A check not run because ``stuck``, an earlier one, timed out."""
    title, hint = _doc_parts(function)
    where = f" in {stuck.running}" if stuck.running else ""
    return CheckResult(function.__name__, title, hint, f"not run: an earlier check timed out{where}", False,
                       skipped=True)


def iter_checks(version: str, folder: Path | str,
                time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> Iterator[CheckResult]:
    """Every check of ``version`` against the copy in ``folder``, in order, each as it finishes.

    The first check that runs out of time ends the run: a copy that loops in one check
    (a scheduler waiting for a block nobody frees) loops in the later ones too, and each
    would wait out its own limit. The later checks come back ``skipped``, not run."""
    lab = Lab(folder, version)
    functions = check_functions(version)
    for i, function in enumerate(functions):
        result = run_check(function, lab, time_limit_s)
        yield result
        if result.timed_out:
            for later in functions[i + 1:]:
                yield skipped_result(later, result)
            return


def run_checks(version: str, folder: Path | str,
               time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> list[CheckResult]:
    """Every check of ``version`` against the copy in ``folder``, in order."""
    return list(iter_checks(version, folder, time_limit_s))
