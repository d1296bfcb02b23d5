"""Helpers shared by the simulators: engines to drive, formatting, messages, colours.

Nothing here knows about one simulator in particular. The two engine factories are the
ones the notebooks use: ``default_engine()`` loads the course's real model once per
process (chapters 1, 5 and 8 share it, so the ~3-10 s load happens once), and
``tiny_engine()`` builds a randomly initialised model small enough that mechanics-only
chapters (4, 7) and the tests run in milliseconds per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import warnings
from typing import Callable, Iterator

import numpy as np
import torch

from nanoengine import LLMEngine
from nanoengine.events import Event, RequestFinished, RequestQueued, RequestScheduled, StepFinished
from translations import language, tr

#: Errors a control can provoke with bad input. A view shows them as a message; the
#: controller guarantees it raised them before changing any engine state.
USER_ERRORS = (ValueError, TypeError, RuntimeError)

#: A qualitative palette (Tableau 20 without the greys) for request owners.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
           "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")


@functools.lru_cache(maxsize=1)
def default_engine(**config) -> LLMEngine:
    """The course's default model (SmolLM2-135M-Instruct), loaded once per process.

    Every call with the same options returns the same engine, so several widgets in one
    notebook observe one live engine. Pass options (e.g. ``num_kv_blocks=256``) for a
    differently configured engine; a new set of options replaces the cached one.
    """
    return LLMEngine.from_pretrained(**config)


def tiny_engine(num_kv_blocks: int = 64, block_size: int = 4, max_model_len: int = 64,
                vocab_size: int = 256, seed: int = 0, **config) -> LLMEngine:
    """A randomly initialised 2-layer Llama on the CPU, for mechanics and tests.

    Its prompts are lists of token ids (it has no tokenizer) and it has no end-of-sequence
    token, so every request runs to ``max_tokens``: ideal for watching blocks and queues.
    """
    from nanoengine.loader.weights import random_model

    net = random_model("tiny-llama", seed=seed, vocab_size=vocab_size, max_position_embeddings=max_model_len)
    return LLMEngine.from_model(net, tokenizer=None, device="cpu", num_kv_blocks=num_kv_blocks,
                                block_size=block_size, max_model_len=max_model_len, **config)


class TokenSource:
    """Deterministic random prompts as token ids (no tokenizer needed).

    Ids are drawn above the low end of the vocabulary, where tokenizers keep their special
    tokens (SmolLM2's end-of-text is id 2), so a random prompt never contains an EOS.
    """

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.low = min(100, vocab_size // 2)
        self.high = vocab_size
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(self.low, self.high, size=n)]


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high], or a ValueError naming the control."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(tr("{name} must be a whole number, got {value!r}", name=name, value=value))
    value = int(value)
    if value < low or (high is not None and value > high):
        if high is None:
            raise ValueError(tr("{name} must be >= {low}, got {value}", name=name, low=low, value=value))
        raise ValueError(tr("{name} must be between {low} and {high}, got {value}", name=name, low=low, high=high,
                            value=value))
    return value


def check_request_fits(engine: LLMEngine, num_prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a request that could never complete on ``engine``, before queueing it.

    The engine itself only refuses prompts longer than ``max_model_len`` (a longer
    generation is cut at ``max_model_len``); the simulators are stricter, like vLLM's
    server, so that what a reader asks for is what runs.
    """
    max_len = engine.max_model_len
    if num_prompt_tokens > max_len:
        raise ValueError(tr("the prompt has {n} tokens but max_model_len is {max_len}", n=num_prompt_tokens,
                            max_len=max_len))
    if num_prompt_tokens + max_tokens > max_len:
        raise ValueError(tr("prompt ({prompt}) + max tokens ({max_tokens}) = {total} tokens exceeds max_model_len "
                            "({max_len}); lower one of them", prompt=num_prompt_tokens, max_tokens=max_tokens,
                            total=num_prompt_tokens + max_tokens, max_len=max_len))
    block_size = engine.config.block_size
    needed = -(-(num_prompt_tokens + max_tokens) // block_size)
    num_blocks = engine.snapshot().num_blocks
    if needed > num_blocks:
        raise ValueError(tr("the KV cache has {num_blocks} blocks of {block_size} tokens; this request needs "
                            "{needed} at its longest, so it could never run", num_blocks=num_blocks,
                            block_size=block_size, needed=needed))


def format_bytes(n: float) -> str:
    """Binary units, as memory is sized: 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def message_html(text: str, kind: str = "info") -> str:
    """A one-line message box; ``kind`` is 'info', 'ok' or 'error'."""
    if not text:
        return ""
    colours = {"info": ("#eef4fb", "#2a5d9f"), "ok": ("#edf7ed", "#2e7d32"), "error": ("#fdecea", "#b71c1c")}
    bg, fg = colours[kind]
    return (f'<div class="ne-msg ne-msg-{kind}" style="background:{bg};color:{fg};padding:4px 8px;'
            f'border-radius:4px;font-size:13px">{html.escape(text)}</div>')


class MessageView:
    """Mixin for a view with a ``message`` HTML widget: its one line of status or error text."""

    def show_message(self, text: str, kind: str = "info") -> None:
        self.message.value = message_html(text, kind)


class ControllerView(MessageView):
    """Mixin for a view whose ``controller`` listens to an engine's events."""

    def close(self) -> None:
        """Close the widgets and stop listening to the engine's events."""
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.close()
        self.controller.close()
        super().close()


class EngineWatcher:
    """Call ``redraw`` whenever ``engine`` changes, whoever changed it.

    A view that only redraws after its own buttons lies as soon as anything else drives
    the same engine: another simulator's Generate, a notebook cell calling
    ``engine.step()``. The watcher listens to the engine's events (its public
    ``events.subscribe``) and redraws after a step (``StepFinished``), a new request
    (``RequestQueued``) or an abort between steps (``RequestFinished`` outside a step).

    In a running kernel the redraw is deferred with ``loop.call_soon``: a button handler or
    a cell that runs twenty steps in a row gets one redraw, after its last step, when the
    engine is between steps again and its snapshot is complete (during ``StepFinished`` the
    step counter has not moved on yet). Without an event loop (a plain script, most tests)
    it redraws at once. A view that has just redrawn itself calls ``drawn()`` so the
    pending redraw is skipped.
    """

    def __init__(self, engine: LLMEngine, redraw: Callable[[], None]) -> None:
        self.engine = engine
        self._redraw = redraw
        self._pending = False
        self._in_step = False
        self.num_redraws = 0  # redraws this watcher triggered (tests and curious readers)
        self._unsubscribe = engine.events.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RequestScheduled):
            self._in_step = True
            return
        if isinstance(event, StepFinished):
            self._in_step = False
        elif not isinstance(event, (RequestQueued, RequestFinished)) or self._in_step:
            return  # mid-step events: the StepFinished that follows covers them
        if self._pending:
            return
        self._pending = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self.flush()
        else:
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Redraw now if an engine change is waiting to be shown."""
        if not self._pending:
            return
        self._pending = False
        self.num_redraws += 1
        try:
            self._redraw()
        except Exception as exc:  # a deferred callback has no cell to show a traceback in
            warnings.warn(f"redraw after an engine event failed: {exc!r}", RuntimeWarning, stacklevel=2)

    def drawn(self) -> None:
        """The view has just redrawn itself: nothing is pending any more."""
        self._pending = False

    def close(self) -> None:
        self._unsubscribe()


def shared_engine_note(shared_with: str | None) -> str:
    """The line a view shows when another simulator drives the same engine ('' if none)."""
    if not shared_with:
        return ""
    return ('<div class="ne-shared-engine" style="font-size:12px;line-height:1.4;color:#5a4500;'
            'background:#fff6d6;padding:3px 8px;border-radius:4px">'
            + tr("<b>One engine, shared with the {other}</b>: steps either one runs advance the other's requests "
                 "too, and both redraw after every engine step.", other=escape(shared_with)) + '</div>')


def guarded(show: Callable[[str, str], None]) -> Callable:
    """Decorate a view callback so any error becomes a message instead of a traceback.

    User errors (bad values) are shown as they are; anything else is labelled as an
    internal error so it is not mistaken for a wrong input.
    """

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except USER_ERRORS as exc:
                show(str(exc), "error")
            except Exception as exc:  # a view must never dump a traceback into the page
                show(tr("internal error ({kind}): {exc}", kind=type(exc).__name__, exc=exc), "error")
            return None

        return wrapper

    return decorate


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run small tensor work on one thread.

    Vector ops over one vocabulary row take microseconds of work; waking torch's intra-op
    thread pool for each of them costs far more on a small, shared CPU (measured here: a
    top-k/top-p mask over 49,152 logits took ~13 ms on one thread, ~200 ms on two busy
    ones). The previous setting is restored afterwards.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def escape(text: object) -> str:
    return html.escape(str(text))


def token_label(engine: LLMEngine, token_id: int) -> str:
    """A token's text with invisible characters made visible ('␣' for a space)."""
    if engine.tokenizer is None:
        return f"#{token_id}"
    text = engine.decode([token_id])
    return text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") or f"#{token_id}"


HANGUL_FONTS = ("NanumGothic", "Noto Sans CJK KR", "Noto Sans KR", "Malgun Gothic", "AppleGothic")


def chart_fonts() -> dict:
    """matplotlib rc settings for a chart drawn in the notebook's language: nothing in English; in
    Korean, DejaVu Sans first and an installed Hangul font to fill in (``{}`` when there is none:
    the labels then show boxes), used as ``with matplotlib.rc_context(chart_fonts()): ...``."""
    if language() == "en":
        return {}
    hangul = _installed_hangul_fonts()
    return {"font.family": ["DejaVu Sans", *hangul[:1]]} if hangul else {}


@functools.lru_cache(maxsize=1)
def _installed_hangul_fonts() -> tuple[str, ...]:
    """The Hangul fonts matplotlib can use; the system's are registered when matplotlib's font
    cache predates them (``./course setup`` installs fonts-nanum after matplotlib)."""
    from matplotlib import font_manager

    known = {f.name for f in font_manager.fontManager.ttflist}
    if not known.intersection(HANGUL_FONTS):
        for path in font_manager.findSystemFonts():
            if any(key in path for key in ("NanumGothic.", "NotoSansCJK", "NotoSansKR", "malgun", "AppleGothic")):
                try:
                    font_manager.fontManager.addfont(path)
                except (OSError, RuntimeError, ValueError):
                    continue
        known = {f.name for f in font_manager.fontManager.ttflist}
    return tuple(name for name in HANGUL_FONTS if name in known)
