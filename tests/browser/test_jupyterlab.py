"""The simulators in a real browser: JupyterLab + headless Chromium (Playwright, sync API).

Starts JupyterLab on 127.0.0.1 (a free port, a known token, a temporary root holding a copy
of ``notebooks/widgets_demo.ipynb``), opens the notebook, runs every cell, then:

* moves the sampling playground's temperature slider (drag, then keyboard if needed) and
  checks that the distribution redraws;
* clicks the scheduler's Step and checks that the queues change;
* saves screenshots under ``test-artifacts/`` (gitignored).

JupyterLab and every process it started are shut down whatever happens. Needs Debian's
Chromium at /usr/bin/chromium (``apt-get install -y chromium``); skipped with a reason
without it. Takes about a minute on a 2-core CPU (the notebook loads the real model).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "widgets_demo.ipynb"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "nanoengine-browser-test"
TIMEOUT_MS = 60_000

pytestmark = pytest.mark.browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (local server)
        return response.status


class JupyterLab:
    """A JupyterLab server in its own session; ``stop`` ends it and every descendant."""

    def __init__(self, root: Path, home: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                          ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                          ("IPYTHONDIR", "ipython")):
            env[name] = str(home / sub)
        # Do not ask about Jupyter news: the toast would cover part of the page.
        notification = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True, exist_ok=True)
        notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        self.log_path = home / "jupyterlab.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             "--allow-root", f"--ServerApp.token={TOKEN}", "--ServerApp.password=",
             "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.descendants: dict[int, object] = {}

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if _get(f"{self.url}/api/status?token={TOKEN}") == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer in {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def remember_descendants(self) -> None:
        """Note the server's processes (kernels run in their own sessions) to end them later."""
        import psutil

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants[child.pid] = child
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> None:
        import psutil

        self.remember_descendants()
        if self.proc.poll() is None:
            try:  # a clean shutdown also shuts the kernels down
                request = urllib.request.Request(f"{self.url}/api/shutdown?token={TOKEN}", method="POST")
                urllib.request.urlopen(request, timeout=10)  # noqa: S310 (local server)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group we created for it
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
        for child in self.descendants.values():
            try:
                if child.is_running():
                    child.terminate()
                    child.wait(timeout=10)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    root = tmp_path_factory.mktemp("lab-root")
    home = tmp_path_factory.mktemp("lab-home")
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    server = JupyterLab(root, home)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert all(not p.is_running() for p in server.descendants.values()), "JupyterLab left processes behind"


def _wait_for_kernel_idle(page, timeout_ms: int = TIMEOUT_MS) -> None:
    """Wait for a started kernel that is idle.

    The status bar reads "No Kernel | Initializing" before the kernel exists, and the
    toolbar's execution indicator already says "idle" then, so neither alone is enough.
    """
    page.wait_for_function("""() => {
        const bar = document.querySelector('#jp-main-statusbar');
        return bar !== null && /\\(ipykernel\\)\\s*\\|\\s*Idle/.test(bar.innerText);
    }""", timeout=timeout_ms)


def _run_all_cells(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                 "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()


def _all_cells_ran(page) -> bool:
    return page.evaluate("""() => {
        const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
        return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
    }""")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_widgets_demo_runs_and_responds_in_jupyterlab(lab) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        try:
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{lab.url}/lab/tree/{NOTEBOOK.name}?token={TOKEN}", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            _wait_for_kernel_idle(page, 90_000)
            lab.remember_descendants()  # the kernel is up now

            _run_all_cells(page)
            _wait_until(lambda: _all_cells_ran(page), 180, "every cell to run")
            _wait_for_kernel_idle(page, 120_000)
            page.wait_for_selector(".ne-quiz", state="attached")
            outputs_text = page.locator(".jp-OutputArea").all_inner_texts()
            assert not any("Traceback" in t for t in outputs_text), outputs_text
            page.screenshot(path=str(ARTIFACTS / "jupyterlab-after-run-all.png"))

            # --- the sampling playground: move the temperature slider ---------------------
            playground = page.locator(".ne-sampling-playground")
            playground.scroll_into_view_if_needed()
            dist = page.locator(".ne-sampling-dist")
            dist.locator("table.ne-dist").wait_for()
            before = dist.inner_html()
            handle = page.locator(".ne-sampling-temperature .noUi-handle")
            box = handle.bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.down()
            page.mouse.move(box["x"] - 60, box["y"] + box["height"] / 2, steps=8)
            page.mouse.up()
            try:
                _wait_until(lambda: dist.inner_html() != before, 20, "the distribution to redraw after a drag")
            except AssertionError:  # fall back to the keyboard, which noUiSlider also supports
                handle.focus()
                for _ in range(5):
                    page.keyboard.press("ArrowLeft")
                _wait_until(lambda: dist.inner_html() != before, 30, "the distribution to redraw")
            params = page.locator(".ne-dist-params").inner_text()
            assert "T=1 " not in params and "T=" in params, params
            playground.screenshot(path=str(ARTIFACTS / "sampling-playground-after-slider.png"))

            # --- the scheduler: Step moves the queued requests ---------------------------------
            stepper = page.locator(".ne-scheduler-stepper")
            stepper.scroll_into_view_if_needed()
            queues = page.locator(".ne-sched-queues")
            waiting_before = int(queues.locator(".ne-queue-waiting").get_attribute("data-count"))
            running_before = int(queues.locator(".ne-queue-running").get_attribute("data-count"))
            assert waiting_before == 3 and running_before == 0
            queues_before = queues.inner_html()
            stepper.locator(".ne-sched-step").click()
            # a real model step; generous, since a shared 2-core CI machine can be slow
            _wait_until(lambda: queues.inner_html() != queues_before, 150, "the queues to change after Step")
            _wait_until(lambda: int(queues.locator(".ne-queue-running").get_attribute("data-count")) == 3,
                        30, "three running requests")
            assert int(queues.locator(".ne-queue-waiting").get_attribute("data-count")) == 0
            assert "step 0" in page.locator(".ne-sched-batch").inner_text()
            stepper.screenshot(path=str(ARTIFACTS / "scheduler-stepper-after-step.png"))
            allocator = page.locator(".ne-block-allocator")
            allocator.scroll_into_view_if_needed()
            assert allocator.locator(".ne-block.ne-used").count() > 0
            allocator.screenshot(path=str(ARTIFACTS / "block-allocator.png"))
            assert not errors, errors
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "jupyterlab-failure.png"))
            raise
        finally:
            browser.close()
