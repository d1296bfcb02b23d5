"""The course in a real browser: JupyterLab + headless Chromium (Playwright, sync API).

Starts JupyterLab as ``./course lab`` does (the course's Jupyter configuration from
``jupyter/config`` on JUPYTER_CONFIG_PATH, 127.0.0.1 only) on a free port with a known
token, over a temporary copy of ``notebooks/``, in a 1400x1000 window, and walks through
what a learner does:

1. the server's front page is the index (``README.md``), rendered, not raw markdown, with no
   news pop-up; every chapter link leads to a file; following the widgets demo's link opens it;
2. every cell of the demo runs; each simulator's controls and headline result fit in one
   screen and no label is cut; the temperature slider redraws the distribution;
3. Step, then the playground's Generate on the engine the two share: the stepper redraws
   with what Generate ran (nothing waiting, Step disabled), and a new request steps again;
4. the allocator's "reserve prompt + max tokens" toggle, then Step: the contiguous side
   keeps its reservations and stored tokens;
5. save, shut the kernel down, reload: the file holds no widget views, and each simulator
   cell reads "Run this cell to bring the simulator back", not "Error displaying widget".

Flow 2 also types Korean and an emoji into the token editor: its byte chips show their
bytes and say what a byte-level token is.

Screenshots go to ``test-artifacts/`` (gitignored). JupyterLab and every process it started
are shut down whatever happens. Needs Debian's Chromium at /usr/bin/chromium (``apt-get
install -y chromium``); skipped with a reason without it. Takes one to two minutes on a
2-core CPU (the demo loads the real model, and runs it again after the restart).
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
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
NOTEBOOK = NOTEBOOKS / "widgets_demo.ipynb"
COURSE_CONFIG = REPO / "jupyter" / "config"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
RERUN_NOTE = "Run this cell to bring the simulator back"
SIMULATORS = (".ne-sampling-playground", ".ne-scheduler-stepper", ".ne-block-allocator", ".ne-memory-estimator",
              ".ne-token-editor")
VIEWPORT = {"width": 1400, "height": 1000}
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
        # A user with no Jupyter settings of their own (empty, private directories) ...
        for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                          ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                          ("IPYTHONDIR", "ipython")):
            env[name] = str(home / sub)
        # ... and the course's configuration, exactly as ./course lab passes it
        env["JUPYTER_CONFIG_PATH"] = str(COURSE_CONFIG)
        self.log_path = home / "jupyterlab.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             "--allow-root", f"--ServerApp.token={TOKEN}", "--ServerApp.password=",
             "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
             "--LabApp.default_url=/lab/tree/README.md"],  # as ./course lab, whose root is the repository
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


def _api(lab: JupyterLab, method: str, path: str):
    """Call the server's REST API; returns the decoded JSON (None for an empty answer)."""
    request = urllib.request.Request(f"{lab.url}{path}?token={TOKEN}", method=method)
    with urllib.request.urlopen(request, timeout=20) as response:  # noqa: S310 (local server)
        body = response.read()
    return json.loads(body) if body else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    root = tmp_path_factory.mktemp("lab-root")
    home = tmp_path_factory.mktemp("lab-home")
    (root / "solutions").mkdir()
    for path in [NOTEBOOKS / "README.md", *NOTEBOOKS.glob("*.ipynb"), *NOTEBOOKS.glob("solutions/*.ipynb")]:
        shutil.copy(path, root / path.relative_to(NOTEBOOKS))  # the course's folder, as a learner has it
    shutil.copytree(NOTEBOOKS / "ko", root / "ko")  # the Korean edition, beside it as in the repository
    server = JupyterLab(root, home)
    server.root = root
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert all(not p.is_running() for p in server.descendants.values()), "JupyterLab left processes behind"


@pytest.fixture(scope="module")
def page(lab):
    """One Chromium page for the whole walk-through (the flows follow each other)."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(TIMEOUT_MS)
        page.errors = []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())  # "leave the page?" when reloading
        try:
            yield page
        finally:
            browser.close()


@pytest.fixture(autouse=True)
def _screenshot_on_failure(request, page):
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:  # this test's call failed
        page.screenshot(path=str(ARTIFACTS / f"failure-{request.node.name}.png"))


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
        const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')];
        return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
    }""")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _visible_notebook_height(page) -> float:
    """Height of the notebook's scrolling area: what one screen shows of a notebook."""
    return page.evaluate("""() => {
        const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer')
                   || document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
        return panel.getBoundingClientRect().height;
    }""")


def _cut_labels(page) -> list[str]:
    """Text of every simulator label, button or dropdown option that does not fit its box."""
    return page.evaluate("""(roots) => {
        const cut = [];
        const ctx = document.createElement('canvas').getContext('2d');
        for (const root of document.querySelectorAll(roots.join(','))) {
            for (const el of root.querySelectorAll('label, .widget-label, .widget-label-basic, button')) {
                if (el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1) {
                    cut.push(`${root.classList[root.classList.length - 1]}: ${el.textContent.trim()}`);
                }
            }
            for (const sel of root.querySelectorAll('select')) {
                const style = getComputedStyle(sel);
                ctx.font = `${style.fontSize} ${style.fontFamily}`;
                const room = sel.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
                for (const option of sel.options) {
                    if (ctx.measureText(option.text).width > room) {
                        cut.push(`${root.classList[root.classList.length - 1]}: ${option.text}`);
                    }
                }
            }
        }
        return cut;
    }""", list(SIMULATORS))


def _span(page, top_selector: str, bottom_selectors: list[str]) -> float:
    """Pixels from the top of ``top_selector`` to the lowest bottom among ``bottom_selectors``."""
    top = page.locator(top_selector).first.bounding_box()["y"]
    bottom = max(box["y"] + box["height"] for box in
                 (page.locator(s).first.bounding_box() for s in bottom_selectors) if box is not None)
    return bottom - top


def _count(locator) -> int:
    return int(locator.get_attribute("data-count"))


# ---------------------------------------------------------------------------------------
# The walk-through (the tests run in this order and share one page)
# ---------------------------------------------------------------------------------------


def test_1_the_index_opens_rendered_and_its_links_open_chapters(lab, page) -> None:
    page.goto(f"{lab.url}/?token={TOKEN}", wait_until="domcontentloaded")  # the server's front door
    rendered = page.locator(".jp-RenderedMarkdown", has_text="Every chapter comes with worked solutions")
    rendered.wait_for(timeout=90_000)
    assert page.locator(".jp-FileEditor").count() == 0, "the index opened in the text editor"
    time.sleep(3)  # the news question, when asked, comes a moment after start-up
    assert page.locator(".Toastify__toast").count() == 0, page.locator(".Toastify__toast").all_inner_texts()
    page.screenshot(path=str(ARTIFACTS / "index-rendered.png"))

    # JupyterLab resolves a relative link to the file's /files/ URL, and a click on it opens
    # the file inside JupyterLab (checked below by following one)
    hrefs = rendered.locator("a[href]").evaluate_all("links => links.map(a => a.href)")
    targets = [urllib.parse.unquote(urllib.parse.urlparse(h).path.split("/files/", 1)[1]) for h in hrefs
               if "/files/" in h]
    chapters = [t for t in targets if t.endswith(".ipynb")]
    assert {"01_what_is_llm_inference.ipynb", "04_paged_attention.ipynb", "widgets_demo.ipynb"} <= set(chapters)
    assert all((lab.root / t).is_file() for t in chapters), chapters

    rendered.get_by_role("link", name="widgets demo").first.click()  # follow a link, as a learner does
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(timeout=90_000)
    assert "widgets_demo.ipynb" in page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").first.inner_text()
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownOutput",
                 has_text="The course's simulators").first.wait_for(timeout=60_000)


def test_2_the_demo_runs_fits_the_screen_and_responds(lab, page) -> None:
    _wait_for_kernel_idle(page, 90_000)
    lab.remember_descendants()  # the kernel is up now
    _run_all_cells(page)
    _wait_until(lambda: _all_cells_ran(page), 180, "every cell to run")
    _wait_for_kernel_idle(page, 120_000)
    page.wait_for_selector(".ne-quiz", state="attached")
    outputs_text = page.locator(".jp-OutputArea").all_inner_texts()
    assert not any("Traceback" in t for t in outputs_text), outputs_text
    page.screenshot(path=str(ARTIFACTS / "jupyterlab-after-run-all.png"))

    # no label, button or dropdown option is cut ("this machine's RAM (23.5…")
    assert _cut_labels(page) == []

    # each simulator's controls and headline result fit in one screen
    screen = _visible_notebook_height(page)
    page.locator(".ne-sampling-sample").click()
    page.locator(".ne-hist-text").wait_for()
    spans = {
        "sampling playground": _span(page, ".ne-sampling-playground",
                                     [".ne-sampling-dist", ".ne-sampling-histogram", ".ne-sampling-generate"]),
        "scheduler stepper": _span(page, ".ne-scheduler-stepper", [".ne-sched-queues"]),
        "block allocator": _span(page, ".ne-block-allocator", [".ne-alloc-headline"]),
        "memory estimator": _span(page, ".ne-memory-estimator", [".ne-mem-summary"]),
        "token editor": _span(page, ".ne-token-editor", [".ne-byte-note"]),
    }
    for selector in SIMULATORS:  # what each one looks like, for a person to check
        page.locator(selector).screenshot(path=str(ARTIFACTS / f"layout-{selector.strip('.')}.png"))
    too_tall = {name: round(px) for name, px in spans.items() if px > screen}
    assert not too_tall, f"taller than one screen ({screen:.0f} px): {too_tall}"

    # the token editor: Korean and an emoji become byte chips that say what they are
    editor = page.locator(".ne-token-editor")
    editor.scroll_into_view_if_needed()
    editor.locator("input").fill("LLM 추론 😀")
    _wait_until(lambda: "F0 9F 98 80" in editor.inner_text(), 30, "the emoji's bytes under its chips")
    assert "byte-level tokens" in editor.inner_text() and "\ufffd" not in editor.inner_text()
    editor.screenshot(path=str(ARTIFACTS / "token-editor-korean-emoji.png"))

    # the sampling playground: move the temperature slider
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
    page.screenshot(path=str(ARTIFACTS / "sampling-playground-after-slider.png"))
    assert not page.errors, page.errors


def test_3_generate_on_the_shared_engine_then_step(page) -> None:
    stepper = page.locator(".ne-scheduler-stepper")
    queues = page.locator(".ne-sched-queues")
    assert "shared with the sampling playground" in stepper.locator(".ne-shared-engine").inner_text()
    assert "shared with the scheduler stepper" in page.locator(".ne-sampling-playground .ne-shared-engine").inner_text()
    stepper.scroll_into_view_if_needed()
    assert _count(queues.locator(".ne-queue-waiting")) == 3 and _count(queues.locator(".ne-queue-running")) == 0
    queues_before = queues.inner_html()
    stepper.locator(".ne-sched-step").click()
    # a real model step; generous, since a shared 2-core CI machine can be slow
    _wait_until(lambda: queues.inner_html() != queues_before, 150, "the queues to change after Step")
    _wait_until(lambda: _count(queues.locator(".ne-queue-running")) == 3, 30, "three running requests")
    assert _count(queues.locator(".ne-queue-waiting")) == 0
    assert "step 0" in page.locator(".ne-sched-batch").inner_text()
    stepper.screenshot(path=str(ARTIFACTS / "scheduler-stepper-after-step.png"))

    # Generate steps the shared engine until its own request finishes: the stepper's three too
    playground = page.locator(".ne-sampling-playground")
    playground.scroll_into_view_if_needed()
    playground.locator(".ne-sampling-generate").click()
    page.locator(".ne-gen").wait_for(timeout=150_000)
    assert "other request(s) on this engine" in playground.locator(".ne-msg").inner_text()
    playground.screenshot(path=str(ARTIFACTS / "sampling-playground-after-generate.png"))
    span = _span(page, ".ne-sampling-playground", [".ne-gen", ".ne-sampling-histogram"])
    assert span <= _visible_notebook_height(page), f"Generate's result is {span:.0f} px below the playground's top"
    stepper.scroll_into_view_if_needed()
    _wait_until(lambda: _count(queues.locator(".ne-queue-finished")) == 4, 30,
                "the stepper to show the four finished requests")
    assert _count(queues.locator(".ne-queue-waiting")) == 0 and _count(queues.locator(".ne-queue-running")) == 0
    status = stepper.locator(".ne-sched-status").inner_text()
    assert "every request has finished" in status and "engine step 0" not in status, status
    assert "ran outside this stepper" in stepper.locator(".ne-msg").inner_text()
    step_button = stepper.locator("button.ne-sched-step")
    assert step_button.is_disabled(), "Step is offered although the stepper shows nothing to step"
    stepper.screenshot(path=str(ARTIFACTS / "scheduler-stepper-after-generate.png"))

    # a new request brings Step back, and Step runs it
    stepper.locator("button.ne-sched-add").click()
    _wait_until(lambda: _count(queues.locator(".ne-queue-waiting")) == 1, 30, "the new request to wait")
    assert step_button.is_enabled()
    step_button.click()
    _wait_until(lambda: _count(queues.locator(".ne-queue-running")) == 1, 150, "the new request to run")
    assert "ran step" in stepper.locator(".ne-msg").inner_text()
    assert not page.errors, page.errors


def test_4_the_reserve_toggle_then_step_keeps_the_contiguous_side(page) -> None:
    allocator = page.locator(".ne-block-allocator")
    allocator.scroll_into_view_if_needed()
    headline = allocator.locator(".ne-alloc-headline")
    contiguous = allocator.locator(".ne-contiguous").locator("xpath=..")
    assert "3 reservations" in contiguous.inner_text()
    allocator.locator("button", has_text="reserve prompt + max tokens").click()
    _wait_until(lambda: "reserving prompt + max tokens" in headline.inner_text(), 30, "the headline to change")
    assert "3 reservations" in contiguous.inner_text(), contiguous.inner_text()
    waste = float(allocator.locator(".ne-waste-contiguous").inner_text().rstrip("%"))
    assert 0 < waste < 100, waste
    assert allocator.locator(".ne-headline-placed-contiguous").inner_text() == "3 / 0"
    stored = allocator.locator("table.ne-report tr", has_text="stored KV").locator("td").nth(1).inner_text()
    assert not stored.startswith("0 slots"), stored
    allocator.screenshot(path=str(ARTIFACTS / "block-allocator-reserve-request.png"))

    message = allocator.locator(".ne-msg")
    allocator.locator("button.ne-alloc-step").click()
    _wait_until(lambda: "ran engine step" in message.inner_text(), 60, "the allocator's step")
    assert "3 reservations" in contiguous.inner_text()
    assert allocator.locator(".ne-headline-placed-contiguous").inner_text() == "3 / 0"
    assert float(allocator.locator(".ne-waste-contiguous").inner_text().rstrip("%")) < 100
    assert allocator.locator(".ne-block.ne-used").count() > 0
    allocator.screenshot(path=str(ARTIFACTS / "block-allocator-after-step.png"))
    assert not page.errors, page.errors


def test_5_save_restart_reopen_shows_how_to_bring_the_simulators_back(lab, page) -> None:
    saved = lab.root / NOTEBOOK.name
    mtime = saved.stat().st_mtime
    page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
    page.locator("li.lm-Menu-item[data-command='docmanager:save']").first.click()

    def saved_notebook() -> dict | None:
        if saved.stat().st_mtime == mtime:
            return None
        try:
            return json.loads(saved.read_text())
        except json.JSONDecodeError:  # the server is still writing it
            return None

    _wait_until(lambda: saved_notebook() is not None, 30, "the notebook to be saved")
    nb = saved_notebook()
    assert WIDGET_VIEW not in json.dumps(nb) and "widgets" not in nb["metadata"]
    widget_cells = [c for c in nb["cells"] if RERUN_NOTE in json.dumps(c.get("outputs", []))]
    assert len(widget_cells) == 6  # playground, stepper, allocator, estimator, token editor, quiz

    for session in _api(lab, "GET", "/api/sessions"):  # shut the kernel down: a restart
        _api(lab, "DELETE", f"/api/sessions/{session['id']}")
    page.reload(wait_until="domcontentloaded")
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    panel.locator(".jp-Cell").first.wait_for(timeout=90_000)
    _wait_until(lambda: panel.locator(".jp-OutputArea-output", has_text=RERUN_NOTE).count() == 6, 60,
                "the six rerun notes")
    text = panel.inner_text()
    assert "Error displaying widget" not in text and "model not found" not in text
    panel.locator(".jp-OutputArea-output", has_text=RERUN_NOTE).first.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "reopened-after-restart.png"))
    lab.remember_descendants()
    assert not page.errors, page.errors


def test_6_a_notebook_in_the_korean_folder_gets_a_korean_quiz(lab, page) -> None:
    """The widgets read the language from the folder the kernel starts in (``ko/``): a quiz run
    from there shows chapter 14's questions and its buttons in Korean, with no setting at all."""
    import translations

    english = REPO / "widgets" / "quizzes" / "ch14.json"
    korean = translations.translated_quiz("ko", json.loads(english.read_text(encoding="utf-8")), english)
    cell = {"cell_type": "code", "execution_count": None, "id": "quiz", "metadata": {}, "outputs": [],
            "source": "from widgets import Quiz\nQuiz(14)"}
    notebook = {"cells": [cell], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "ko" / "quiz_language.ipynb").write_text(json.dumps(notebook))
    page.goto(f"{lab.url}/lab/tree/ko/quiz_language.ipynb?token={TOKEN}", wait_until="domcontentloaded")
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    panel.locator(".jp-Cell").first.wait_for(timeout=90_000)
    _wait_for_kernel_idle(page, 120_000)
    for _ in range(3):  # a run sent before the new kernel is connected is dropped: send it again
        page.locator(".cm-content", has_text="Quiz(14)").first.click()
        page.keyboard.press("Shift+Enter")
        try:
            _wait_until(lambda: panel.locator(".jp-OutputArea-output").count() > 0, 20, "the quiz cell's output")
            break
        except AssertionError:
            continue
    first = korean["questions"][0]["question"][:12]
    panel.locator(".jp-OutputArea-output", has_text=first).first.wait_for(timeout=120_000)
    assert panel.get_by_role("button", name="확인").count() >= 1, "the quiz's Check buttons are not in Korean"
    page.screenshot(path=str(ARTIFACTS / "korean-quiz.png"))
    lab.remember_descendants()
    assert not page.errors, page.errors
