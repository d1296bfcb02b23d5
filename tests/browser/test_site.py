"""The course's website in a real browser: headless Chromium (Playwright) over a local server.

The session fixture builds the site with ``scripts/build_site.py`` (as ``./course site``
does, into a temporary directory, from the committed notebooks) and serves it from a static
HTTP server on 127.0.0.1. Then a crawler starts at the home page and follows every link
inside the site, and on every page it finds checks that:

* the page loads with no console error, no uncaught exception and no failed request;
* every internal link resolves (the file is served) and every ``#anchor`` exists on its page;
* every image has loaded (a decoded width), and every plotly figure has drawn its SVG;
* no widget cell is an error or blank: each static view names how to run it live.

Other tests: the pages come in the course's order with previous/next links, every notebook
page names the machine and date from its metadata, chapter 7's quiz shows its questions and
options with no answer marked, search finds a word of chapter 7, and the crawler does
report a broken link and a missing anchor on a small site made broken on purpose.

Needs Debian's Chromium at /usr/bin/chromium (skipped with a reason without it). The build
takes under a minute on 2 cores, the crawl one to two.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import sys
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 1000}
TIMEOUT_MS = 60_000

# the theme and MyST call Sphinx APIs that Sphinx 11 will remove: their warnings, not ours
pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore:.*is deprecated. Check CHANGES for Sphinx API")]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test reports failures itself
        pass


class StaticServer:
    """``directory`` over HTTP on 127.0.0.1 (a free port), in a daemon thread."""

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_Quiet, directory=str(directory))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# Module scope, not session: Playwright's sync API keeps an event loop running in this thread
# while it is open, and every later test that calls asyncio.run() (the server's, the widgets'
# redraw tests) would fail with "cannot be called from a running event loop".
@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory, build_site) -> Path:
    if sys.version_info < build_site.MIN_PYTHON:
        pytest.skip(f"the site's build needs Python {build_site.MIN_PYTHON}+ (Sphinx 9)")
    build_site.ensure_packages()
    return build_site.build(tmp_path_factory.mktemp("website") / "site")


@pytest.fixture(scope="module")
def server(site):
    served = StaticServer(site)
    yield served
    served.stop()


@dataclass
class Crawl:
    pages: dict[str, dict] = field(default_factory=dict)  # url -> what the page showed
    problems: list[str] = field(default_factory=list)


# What each page reports about itself, gathered in the page once it has settled.
PAGE_REPORT = """() => {
  const imgs = [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}));
  const plots = [...document.querySelectorAll('.ne-plotly')].map(d => ({id: d.id,
      drawn: !!d.querySelector('svg.main-svg') && d.getBoundingClientRect().height > 50}));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id);
  const statics = [...document.querySelectorAll('.ne-static')].map(e => e.innerText);
  const outputs = [...document.querySelectorAll('.cell_output')].map(e => e.innerText.trim());
  return {imgs, plots, links, ids, statics, outputs, title: document.title, text: document.body.innerText};
}"""


def crawl(browser, start: str) -> Crawl:
    """Visit every page reachable from ``start`` inside its site; check links and anchors."""
    result = Crawl()
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    base = start.rsplit("/", 1)[0] + "/"
    queue, anchors, others = [start], [], set()
    try:
        while queue:
            url = queue.pop(0)
            if url in result.pages:
                continue
            errors.clear()
            response = page.goto(url, wait_until="load")
            if response is None or response.status != 200:
                result.problems.append(f"{url}: HTTP {response.status if response else 'no response'}")
                result.pages[url] = {}
                continue
            if page.locator(".ne-plotly").count():
                page.wait_for_function("[...document.querySelectorAll('.ne-plotly')].every("
                                       "d => d.querySelector('svg.main-svg'))", timeout=TIMEOUT_MS)
            page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
            report = page.evaluate(PAGE_REPORT)
            result.pages[url] = report
            result.problems += [f"{url}: {e}" for e in errors]
            result.problems += [f"{url}: image did not load: {i['src']}" for i in report["imgs"] if not i["ok"]]
            result.problems += [f"{url}: plotly figure {p['id']} did not draw" for p in report["plots"] if not p["drawn"]]
            for text in report["statics"]:
                if "./course lab" not in text:
                    result.problems.append(f"{url}: a widget's static view does not say how to run it: {text[:80]!r}")
            for text in report["outputs"]:
                if "Error displaying widget" in text or re.search(r"\w+\(children=\(", text):
                    result.problems.append(f"{url}: a widget output renders as an error or a repr: {text[:80]!r}")
            for link in report["links"]:
                target, _, anchor = link.partition("#")
                if not target.startswith(base):
                    continue  # outside the site (there should be none; see test_no_external_resources)
                if target.endswith(".html") or target.endswith("/"):
                    queue.append(target)
                    if anchor:
                        anchors.append((url, target, urllib.parse.unquote(anchor)))
                else:
                    others.add((url, target))
    finally:
        page.close()
    for url, target, anchor in anchors:
        if target in result.pages and result.pages[target] and anchor not in result.pages[target]["ids"]:
            result.problems.append(f"{url}: link to #{anchor} on {target}, which has no such anchor")
    for url, target in sorted(others):  # downloads, sources: served?
        try:
            with urllib.request.urlopen(target, timeout=10) as response:  # noqa: S310 (local server)
                status = response.status
        except OSError as exc:
            status = exc
        if status != 200:
            result.problems.append(f"{url}: link to {target}: {status}")
    return result


@pytest.fixture(scope="module")
def crawled(browser, server) -> Crawl:
    return crawl(browser, server.url + "index.html")


@pytest.fixture(scope="module")
def pages(build_site) -> list:
    """The build script's pages (chapters, solutions, lab, demo), in the course's order."""
    return build_site.collect_pages(REPO)


def _url(server, path: Path) -> str:
    return server.url + str(path.with_suffix(".html"))


def test_every_page_loads_links_resolve_images_and_figures_draw(crawled, server, pages) -> None:
    assert not crawled.problems, "\n".join(crawled.problems)
    for page in pages:
        assert _url(server, page.path) in crawled.pages, f"{page.path} is not reachable from the home page"
    plots = sum(len(report.get("plots", [])) for report in crawled.pages.values())
    images = sum(len(report.get("imgs", [])) for report in crawled.pages.values())
    assert plots >= 10 and images >= 10, (plots, images)  # the chapters have dozens of both


def test_home_page_is_the_course_index_and_pages_come_in_order(browser, server, pages) -> None:
    index = (REPO / "notebooks" / "README.md").read_text(encoding="utf-8")
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(server.url, wait_until="load")
        heading = re.search(r"^# (.+)$", index, re.M).group(1)
        assert page.locator("h1").first.inner_text().strip().rstrip("#").strip() == heading
        sidebar = [urllib.parse.urljoin(page.url, href) for href in page.eval_on_selector_all(
            "nav.bd-links a.reference.internal", "els => els.map(e => e.getAttribute('href'))")]
        wanted = [_url(server, p.path) for p in pages]
        listed = [u for u in sidebar if u in wanted]
        assert listed == wanted, "the sidebar lists the pages out of the course's order"
        # previous/next: walking "next" from the home page visits every page in that order
        seen = []
        while page.locator("a.right-next").count() and len(seen) < 200:
            page.goto(urllib.parse.urljoin(page.url, page.locator("a.right-next").first.get_attribute("href")),
                      wait_until="domcontentloaded")
            seen.append(page.url.split("#")[0])
            assert page.locator("a.left-prev").count() == 1, f"{page.url} has no link to the previous page"
        assert [u for u in seen if u in wanted] == wanted
    finally:
        page.close()


def test_every_notebook_page_names_its_machine_and_date(crawled, server, pages) -> None:
    for page in pages:
        if page.path.suffix != ".ipynb":
            continue
        text = crawled.pages[_url(server, page.path)]["text"]
        meta = json.loads((REPO / page.path).read_text(encoding="utf-8"))["metadata"].get("nanoengine")
        if meta:
            assert meta["machine"] in text and meta["executed"][:10] in text, page.path
        else:  # the live-only demo says so
            assert "no saved outputs" in text and "./course lab" in text, page.path


def _quiz_view(report: dict, heading: str, quiz: dict) -> str:
    """The page's one static quiz card (its text starts with ``heading``), checked to show every
    question and option of ``quiz`` and no explanation (explanations tell the answer)."""
    views = [text for text in report["statics"] if text.startswith(heading)]
    assert len(views) == 1
    view = " ".join(views[0].split())
    for question in quiz["questions"]:
        assert " ".join(question["question"].replace("`", "").split()) in view
        for option in question["options"]:
            assert " ".join(option["text"].replace("`", "").split()) in view
            assert " ".join(option["explanation"].replace("`", "").split()) not in view
    return view


def test_chapter_7_quiz_shows_questions_and_options_without_the_answer(crawled, server) -> None:
    quiz = json.loads((REPO / "widgets" / "quizzes" / "ch07.json").read_text(encoding="utf-8"))
    view = _quiz_view(crawled.pages[server.url + "notebooks/07_prefix_caching.html"], "Quiz", quiz)
    assert "open notebooks/07_prefix_caching.ipynb" in view


def test_search_finds_a_term_from_chapter_7(browser, server) -> None:
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(server.url + "search.html?q=digest", wait_until="load")
        results = page.locator("#search-results ul.search li a")
        results.first.wait_for(timeout=TIMEOUT_MS)
        hrefs = [urllib.parse.urljoin(page.url, h) for h in results.evaluate_all("els => els.map(e => e.getAttribute('href'))")]
        assert any(h.startswith(server.url + "notebooks/07_prefix_caching.html") for h in hrefs), hrefs
    finally:
        page.close()


def test_no_external_resources(site) -> None:
    """The site works offline: no page loads a script, style or image from elsewhere."""
    pattern = re.compile(r"<(?:script|link|img)\b[^>]*(?:src|href)=[\"'](?:https?:)?//", re.I)
    offenders = [str(p.relative_to(site)) for p in site.rglob("*.html") if pattern.search(p.read_text(encoding="utf-8"))]
    assert not offenders, offenders


def test_the_crawler_reports_a_broken_link_and_a_missing_anchor(browser, tmp_path) -> None:
    (tmp_path / "index.html").write_text("<html><head><link rel='icon' href='data:,'></head><body>"
                                         "<a href='b.html#there'>b</a> <a href='gone.html'>x</a></body></html>")
    (tmp_path / "b.html").write_text("<html><head><link rel='icon' href='data:,'></head><body><p id='here'>b</p>"
                                     "<img src='missing.png'></body></html>")
    served = StaticServer(tmp_path)
    try:
        problems = "\n".join(crawl(browser, served.url + "index.html").problems)
    finally:
        served.stop()
    assert "gone.html: HTTP 404" in problems
    assert "no such anchor" in problems and "#there" in problems
    assert "image did not load" in problems and "missing.png" in problems


# --------------------------------------------------------------------------- the Korean edition

HANGUL = re.compile(r"[\uac00-\ud7a3]")


def test_every_page_has_a_korean_copy_and_each_links_to_the_other(crawled, server, pages) -> None:
    """The crawl starts in English and reaches the Korean site through the switch on every page."""
    for page in pages:
        english, korean = _url(server, page.path), server.url + "ko/" + str(page.path.with_suffix(".html"))
        assert korean in crawled.pages, f"{page.path}: no Korean copy reachable from the English site"
        assert korean in crawled.pages[english]["links"], f"{page.path}: the English page does not link to it"
        assert english in crawled.pages[korean]["links"], f"{page.path}: the Korean page does not link back"
        if page.path.suffix == ".ipynb" and page.path not in {Path("notebooks/widgets_demo.ipynb")}:
            assert HANGUL.search(crawled.pages[korean]["title"]), f"{page.path}: the Korean title is not Korean"


def _hangul_fonts() -> set[str]:
    """Font families fontconfig says cover Hangul (U+AC00, 가)."""
    import subprocess

    listed = subprocess.run(["fc-list", ":charset=ac00", "family"], capture_output=True, text=True).stdout
    return {name.strip() for line in listed.splitlines() for name in line.split(",")}


def test_korean_pages_draw_every_hangul_glyph_with_a_font_that_has_it(browser, server) -> None:
    """Chromium reports which fonts drew a node's glyphs (CDP CSS.getPlatformFontsForNode): every
    Hangul syllable of a chapter's paragraph and of the sidebar must come from a font that has
    Hangul, none from a fallback drawing empty boxes."""
    covering = _hangul_fonts()
    if not covering:
        pytest.skip("no font with Hangul is installed (apt-get install -y fonts-nanum; ./course setup does it as root)")
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(server.url + "ko/notebooks/05_scheduler.html", wait_until="load")
        cdp = page.context.new_cdp_session(page)
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
        checked = 0
        for selector in ("article section p", "article h1", "nav.bd-links a.reference.internal", "article section li"):
            node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
            text = page.locator(selector).first.inner_text()
            fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
            drawn_by_hangul_fonts = sum(f["glyphCount"] for f in fonts if f["familyName"] in covering)
            assert drawn_by_hangul_fonts >= len(HANGUL.findall(text)) > 0, (selector, text[:60], fonts)
            checked += 1
        assert checked == 4
    finally:
        page.close()


def test_korean_search_finds_a_korean_word_of_chapter_7(browser, server) -> None:
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(server.url + "ko/search.html?q=" + urllib.parse.quote("캐싱"), wait_until="load")
        results = page.locator("#search-results ul.search li a")
        results.first.wait_for(timeout=TIMEOUT_MS)
        hrefs = [urllib.parse.urljoin(page.url, h) for h in results.evaluate_all("els => els.map(e => e.getAttribute('href'))")]
        assert any(h.startswith(server.url + "ko/notebooks/07_prefix_caching.html") for h in hrefs), hrefs
    finally:
        page.close()


def test_the_korean_chapter_7_quiz_is_in_korean_without_the_answer(crawled, server) -> None:
    import translations

    english = REPO / "widgets" / "quizzes" / "ch07.json"
    quiz = translations.translated_quiz("ko", json.loads(english.read_text(encoding="utf-8")), english)
    view = _quiz_view(crawled.pages[server.url + "ko/notebooks/07_prefix_caching.html"], "퀴즈", quiz)
    assert "./course lab --lang ko" in view and "notebooks/ko/07_prefix_caching.ipynb" in view
