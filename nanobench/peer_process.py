"""A peer engine run as a long-lived subprocess that answers JSON lines: the driver's side.

The engines the course races against cannot share its ``.venv``: vLLM pins its own torch
and web stack, llama-cpp-python is a native build of its own. Each gets a virtualenv of its
own (``./course vllm-setup``, ``./course llamacpp-setup``) and a small *runner* script
beside this file, executed by that virtualenv's Python: it loads its engine once, answers
``{"event": "ready", ...}``, then takes one command per line on its standard input and
answers one JSON object per line on its standard output (``{"event": "error", "message":
...}`` when a command fails). Everything the engine itself prints goes to a log file,
whose last lines come with any error.

Why a process that stays up rather than one per run: loading can take a minute and more
(vLLM compiles its model), and the benchmark alternates systems run by run (engine, peer,
engine, ...) so that a slow spell of a shared machine hits every system alike.

:class:`RunnerProcess` is that protocol, with nothing engine-specific: a subclass says how
its runner is started (:meth:`RunnerProcess.runner_arguments`,
:meth:`RunnerProcess.runner_environment`) and which commands it sends
(``nanobench/vllm_peer.py``, ``nanobench/llamacpp_peer.py``).
"""

from __future__ import annotations

import json
import queue
import subprocess
import tempfile
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 30


class PeerRunnerError(RuntimeError):
    """A peer's runner answered an error, or stopped, or did not answer in time."""


class PeerSetupError(FileNotFoundError):
    """A peer's virtualenv is missing: its ``./course <peer>-setup`` makes it."""


def virtualenv_python(venv: Path | str, error_class: type[PeerSetupError], needed_by: str, setup_command: str,
                      what_setup_does: str) -> Path:
    """The interpreter of a peer's virtualenv, checked to exist (nothing is started); if it does
    not, ``error_class`` saying who needs it (``needed_by``) and which command makes it."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise error_class(f"{needed_by} at {venv}, which is missing: run `{setup_command}` first ({what_setup_does})")
    return python


class RunnerProcess:
    """One runner, started once, taking commands one at a time.

    ``settings``: the peer's settings, with ``runner_config()`` (the JSON the runner is
    started with) and ``venv`` (its virtualenv). ``python`` and ``runner``: the interpreter
    and the script, by default the virtualenv's (:meth:`virtualenv_python`) and the
    subclass's ``default_runner``; the tests give a stand-in that speaks the same protocol.
    Subclasses also set ``label`` (the engine's name in messages), ``error_class``,
    ``log_prefix`` and the default timeouts.
    """

    label = "the peer"
    error_class: type[PeerRunnerError] = PeerRunnerError
    log_prefix = "peer-runner-"
    default_runner: Path
    default_load_timeout_s = 600.0
    default_run_timeout_s = 1800.0

    def __init__(self, settings, python: Path | str | None = None, runner: Path | str | None = None,
                 load_timeout_s: float | None = None, run_timeout_s: float | None = None) -> None:
        self.settings = settings
        self.python = Path(python) if python is not None else self.virtualenv_python(settings.venv)
        self.runner = Path(runner) if runner is not None else self.default_runner
        self.load_timeout_s = self.default_load_timeout_s if load_timeout_s is None else load_timeout_s
        self.run_timeout_s = self.default_run_timeout_s if run_timeout_s is None else run_timeout_s
        self.process: subprocess.Popen | None = None
        self.ready: dict | None = None
        self._lines: queue.Queue = queue.Queue()
        self.log_path: Path | None = None

    # ------------------------------------------------------- what subclasses say
    def virtualenv_python(self, venv: Path | str) -> Path:
        """The peer's interpreter in ``venv``, checked to exist (an error naming its set-up if not)."""
        raise NotImplementedError

    def runner_arguments(self) -> list[str]:
        """The runner's command-line arguments (after the script's path): its config, as JSON."""
        return [json.dumps(self.settings.runner_config())]

    def runner_environment(self) -> dict:
        """The runner's environment variables (all of them: it gets exactly these)."""
        raise NotImplementedError

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the runner; it loads its engine in the background (``wait_ready`` waits for it)."""
        if self.process is not None:
            raise RuntimeError(f"this {self.label} peer is already started")
        log = tempfile.NamedTemporaryFile("w", prefix=self.log_prefix, suffix=".log", delete=False)
        self.log_path = Path(log.name)
        command = [str(self.python), str(self.runner), *self.runner_arguments()]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                        env=self.runner_environment(), cwd=str(REPO_ROOT))
        log.close()  # the child holds its own descriptor
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the runner closed its side: it exited

    def wait_ready(self) -> dict:
        """Block until the engine is loaded; its ``ready`` message (versions, settings, environment)."""
        if self.ready is None:
            if self.process is None:
                self.start()
            message = self._answer(self.load_timeout_s, f"loading {self.label}")
            if message.get("event") != "ready":
                raise self._error(f"the runner sent {message!r} instead of 'ready'")
            self.ready = message
        return self.ready

    def close(self) -> None:
        """Ask the runner to quit; kill it if it does not within a minute."""
        if self.process is None:
            return
        process, self.process = self.process, None
        try:
            if process.poll() is None:
                process.stdin.write(json.dumps({"command": "quit"}) + "\n")
                process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ the protocol
    def _ask(self, command: dict, event: str, doing: str) -> dict:
        """Send one command and wait for its answer, which must be ``event``."""
        self.wait_ready()
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._error(f"could not send {doing} to the runner ({exc})") from exc
        message = self._answer(self.run_timeout_s, doing)
        if message.get("event") != event:
            raise self._error(f"the runner sent {message!r} instead of a {event} answer")
        return message

    def _answer(self, timeout_s: float, doing: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise self._error(f"no answer from the runner after {timeout_s:.0f} s of {doing}") from None
        if line is None:
            code = self.process.wait() if self.process is not None else None
            raise self._error(f"the runner exited (code {code}) during {doing}")
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise self._error(f"the runner sent a line that is not JSON: {line[:200]!r}") from None
        if message.get("event") == "error":
            raise self._error(f"the runner failed during {doing}: {message.get('message')}")
        return message

    def _error(self, what: str) -> PeerRunnerError:
        tail = ""
        if self.log_path is not None and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            tail = f"\nlast lines of its log ({self.log_path}):\n" + "\n".join(lines)
        return self.error_class(what + tail)


__all__ = ["PeerRunnerError", "PeerSetupError", "REPO_ROOT", "RunnerProcess", "virtualenv_python"]
