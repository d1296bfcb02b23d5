"""The scheduler stepper: a live ``LLMEngine`` one step at a time (chapter 5).

Each click runs one real ``engine.step()``. What the widget shows comes from two public
sources only: ``engine.snapshot()`` for the queues (waiting, running, with each request's
progress and block table) and ``engine.events`` for what the step did (which requests got
how many tokens of the budget, prefill chunk or decode, who was preempted, who finished,
and how long it took). Nothing is simulated: the batch drawn is the batch the model ran.

The view redraws after every engine step, whoever ran it (``EngineWatcher``): when another
simulator shares the engine (the widgets demo's sampling playground, whose Generate steps
the engine until its own request finishes), the steps it ran appear here too, marked as
run elsewhere, and Step is disabled once nothing is left to run.

Things to look for (chapter 5): a long prompt split into chunks across steps (chunked
prefill) while running requests keep decoding one token per step (continuous batching);
the token budget (``max_num_batched_tokens``) capping each step; with a small KV pool, the
newest running request preempted (its blocks freed) and recomputed later.

``SchedulerStepperController`` is the testable part; ``SchedulerStepper`` draws it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import ipywidgets as W

from nanoengine import LLMEngine, RequestOutput, RequestSnapshot, SamplingParams
from nanoengine.events import (Event, PrefixCacheHit, RequestFinished, RequestPreempted, RequestQueued,
                               RequestScheduled, StepFinished)
from translations import english, tr
from widgets._common import (PALETTE, ControllerView, EngineWatcher, TokenSource, check_int, check_request_fits,
                             escape, guarded, shared_engine_note)


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: ``num_tokens`` tokens from ``start``."""

    request_id: str
    num_tokens: int
    start: int  # tokens already computed before this step
    is_prefill: bool


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did, assembled from its events."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    finished: tuple[tuple[str, str], ...]  # (request id, finish reason)
    num_prefill_tokens: int
    num_decode_tokens: int
    token_budget: int
    engine_time: float  # seconds, the engine's own measurement
    elsewhere: bool = False  # run by other code on the same engine, not by this controller

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True)
class FinishedRecord:
    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    text: str


@dataclass
class _PendingStep:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)


class SchedulerStepperController:
    """Step an engine, keep a timeline of steps, an event log and the finished requests.

    ``engine_factory``, if given, builds a fresh engine on ``reset()``; without it, reset
    aborts every unfinished request and clears the history, keeping the engine (and its
    prefix cache) as it is.
    """

    def __init__(self, engine: LLMEngine | None = None, engine_factory: Callable[[], LLMEngine] | None = None,
                 seed: int = 0, max_log: int = 500) -> None:
        if engine is None:
            if engine_factory is None:
                raise ValueError("give an engine or an engine_factory")
            engine = engine_factory()
        self.engine_factory = engine_factory
        self.seed = seed
        self.max_log = max_log
        self._attach(engine)

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokens = TokenSource(engine.model_config.vocab_size, self.seed)
        self.steps: list[StepRecord] = []
        self.finished: list[FinishedRecord] = []
        self.log: collections.deque[str] = collections.deque(maxlen=self.max_log)  # English: code filters it
        self.shown_log: collections.deque[str] = collections.deque(maxlen=self.max_log)  # the view's language
        self.colours: dict[str, str] = {}
        self._prompt_lens: dict[str, int] = {}
        self._pending = _PendingStep()
        self._stepping = False  # True while this controller runs engine.step()
        self._unsubscribe = engine.events.subscribe(self._on_event)

    # ----------------------------------------------------------------- actions
    def add_requests(self, prompt: str | list[int] | int, params: SamplingParams, count: int = 1) -> list[str]:
        """Queue ``count`` requests; ``prompt`` may be text, token ids, or N (random tokens).

        All of them are validated before any is queued, so a bad value changes nothing.
        """
        count = check_int("count", count, 1, 256)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompts = []
        for _ in range(count):
            if isinstance(prompt, int) and not isinstance(prompt, bool):
                n = check_int("random prompt tokens", prompt, 1)
                check_request_fits(self.engine, n, params.max_tokens)
                prompts.append(self.tokens.tokens(n))
            else:
                _, token_ids = self.engine.tokenize_prompt(prompt)
                check_request_fits(self.engine, len(token_ids), params.max_tokens)
                prompts.append(prompt)
        # Every prompt passed tokenize_prompt and the fit check, and params is validated:
        # add_request checks again before changing anything, so the first one that could
        # fail would fail before any was queued.
        return [self.engine.add_request(p, params) for p in prompts]

    def step(self) -> StepRecord | None:
        """Run one engine step; None when there was nothing to schedule."""
        if not self.engine.has_unfinished_requests():
            raise ValueError(tr("nothing to step: every request has finished; add one"))
        before = len(self.steps)
        self._stepping = True
        try:
            outputs = self.engine.step()
        finally:
            self._stepping = False
        self._remember_outputs(outputs)
        return self.steps[-1] if len(self.steps) > before else None

    def run(self, num_steps: int) -> list[StepRecord]:
        """Up to ``num_steps`` steps, stopping early when the engine is idle."""
        num_steps = check_int("steps", num_steps, 1, 10_000)
        if not self.engine.has_unfinished_requests():
            raise ValueError(tr("nothing to run: every request has finished; add one"))
        records = []
        for _ in range(num_steps):
            if not self.engine.has_unfinished_requests():
                break
            record = self.step()
            if record is not None:
                records.append(record)
        return records

    def abort(self, request_id: str) -> RequestOutput:
        if request_id not in self.engine.requests:
            raise ValueError(tr("no unfinished request {rid!r}", rid=request_id))
        output = self.engine.abort(request_id)
        self._remember_outputs([output])
        return output

    def reset(self) -> None:
        """Back to an empty engine: a fresh one from the factory, or abort everything."""
        if self.engine_factory is not None:
            self._unsubscribe()
            self._attach(self.engine_factory())
            return
        snap = self.engine.snapshot()
        for r in (*snap.running, *snap.waiting):
            self.engine.abort(r.request_id)
        self._unsubscribe()
        self._attach(self.engine)

    def close(self) -> None:
        self._unsubscribe()

    # ---------------------------------------------------------------- observing
    def snapshot(self):
        return self.engine.snapshot()

    @property
    def completed(self) -> list[FinishedRecord]:
        """Requests that ran to their end (a stop or their length), oldest first."""
        return [f for f in self.finished if f.finish_reason != "abort"]

    @property
    def aborted(self) -> list[FinishedRecord]:
        """Requests taken out by an abort (from this view, a cell or another simulator)."""
        return [f for f in self.finished if f.finish_reason == "abort"]

    def colour(self, request_id: str) -> str:
        if request_id not in self.colours:
            self.colours[request_id] = PALETTE[len(self.colours) % len(PALETTE)]
        return self.colours[request_id]

    @staticmethod
    def total_tokens(r: RequestSnapshot, max_model_len: int) -> int:
        """The longest ``r`` can get: prompt + max tokens, capped by max_model_len."""
        return min(r.num_prompt_tokens + r.max_tokens, max_model_len)

    # ----------------------------------------------------------------- events
    def _on_event(self, event: Event) -> None:
        pending = self._pending
        if isinstance(event, RequestQueued):
            self._prompt_lens[event.request_id] = event.num_prompt_tokens
            self.colour(event.request_id)
            self._log(event, lambda tr: tr("queued request {rid} ({n} prompt tokens)", rid=event.request_id,
                                           n=event.num_prompt_tokens))
        elif isinstance(event, RequestScheduled):
            pending.chunks.append(ScheduledChunk(event.request_id, event.num_tokens, event.num_computed_tokens,
                                                 event.is_prefill))
            kind = "prefill" if event.is_prefill else "decode"
            self._log(event, lambda tr: tr("scheduled {rid}: {n} {kind} token(s) [{start}->{end}]",
                                           rid=event.request_id, n=event.num_tokens, kind=kind,
                                           start=event.num_computed_tokens,
                                           end=event.num_computed_tokens + event.num_tokens))
        elif isinstance(event, RequestPreempted):
            pending.preempted.append(event.request_id)
            self._log(event, lambda tr: (
                tr("PREEMPTED {rid}: {n} block freed, it will be recomputed", rid=event.request_id, n=1)
                if event.num_blocks_freed == 1 else
                tr("PREEMPTED {rid}: {n} blocks freed, it will be recomputed", rid=event.request_id,
                   n=event.num_blocks_freed)))
        elif isinstance(event, PrefixCacheHit):
            self._log(event, lambda tr: tr("prefix cache hit for {rid}: {n} tokens reused", rid=event.request_id,
                                           n=event.num_cached_tokens))
        elif isinstance(event, RequestFinished):
            if any(c.request_id == event.request_id for c in pending.chunks):  # not an abort between steps
                pending.finished.append((event.request_id, event.finish_reason))
            self.finished.append(FinishedRecord(event.request_id, event.finish_reason,
                                                self._prompt_lens.get(event.request_id, 0),
                                                event.num_output_tokens, ""))
            self._log(event, lambda tr: tr("finished {rid} ({reason}, {n} tokens)", rid=event.request_id,
                                           reason=event.finish_reason, n=event.num_output_tokens))
        elif isinstance(event, StepFinished):
            self.steps.append(StepRecord(event.step, tuple(pending.chunks), tuple(pending.preempted),
                                         tuple(pending.finished), event.num_prefill_tokens,
                                         event.num_decode_tokens, event.token_budget, event.total_time,
                                         elsewhere=not self._stepping))
            fields = dict(prefill=event.num_prefill_tokens, decode=event.num_decode_tokens,
                          budget=event.token_budget, ms=1000 * event.total_time)
            stepping = self._stepping
            self._log(event, lambda tr: (
                tr("step done: {prefill} prefill + {decode} decode tokens of {budget} in {ms:.0f} ms", **fields)
                if stepping else
                tr("step done: {prefill} prefill + {decode} decode tokens of {budget} in {ms:.0f} ms "
                   "(run elsewhere on this engine)", **fields)))
            self._pending = _PendingStep()

    def _log(self, event: Event, say: Callable[[Callable[..., str]], str]) -> None:
        """Log one line. ``say(tr)`` writes it with the ``tr`` it is given: ``log`` keeps it in
        English (code filters it on English words, as chapter 5 does), ``shown_log`` in the
        notebook's language for the view's event log."""
        self.log.append(f"[step {event.step}] {say(english)}")
        self.shown_log.append(tr("[step {step}] {text}", step=event.step, text=say(tr)))

    def _remember_outputs(self, outputs: list[RequestOutput]) -> None:
        """Attach the final text to finished records (events carry no text)."""
        done = {o.request_id: o for o in outputs if o.finished}
        if not done:
            return
        self.finished = [FinishedRecord(f.request_id, f.finish_reason, f.num_prompt_tokens, f.num_output_tokens,
                                        done[f.request_id].text) if f.request_id in done and not f.text else f
                         for f in self.finished]


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


def plural(n: int, word: str) -> str:
    """``1 block``, ``2 blocks``: a count with its noun in the right number."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _blocks(n: int) -> str:
    """``plural(n, "block")`` in the notebook's language."""
    return tr("{n} block", n=n) if n == 1 else tr("{n} blocks", n=n)


def _progress_bar(r: RequestSnapshot, total: int, colour: str) -> str:
    """Computed tokens (solid) over the request's longest length; the prompt part outlined."""
    width = 160
    computed = min(r.num_computed_tokens, total)
    prompt = min(r.num_prompt_tokens, total)
    return (f'<div style="position:relative;width:{width}px;height:10px;background:#eee;border:1px solid #bbb">'
            f'<div style="position:absolute;left:0;width:{width * prompt / total:.1f}px;height:100%;'
            f'background:{colour}33"></div>'
            f'<div style="position:absolute;left:0;width:{width * computed / total:.1f}px;height:100%;'
            f'background:{colour}"></div></div>')


def policy_note(policy: str) -> str:
    """What a scheduling policy does, shown when the pointer rests on its name ('' if unknown)."""
    notes = {
        "fcfs": tr("continuous batching: decodes and prefill chunks share each step; a freed slot is refilled "
                   "at once"),
        "prefill_first": tr("a step that can admit someone runs prefill work only; decodes wait"),
        "static": tr("static batching: a batch of up to max_num_seqs runs until all of it has finished; "
                     "nobody joins"),
    }
    return notes.get(policy, "")


def render_queue(controller: SchedulerStepperController, requests: tuple[RequestSnapshot, ...], name: str,
                 max_model_len: int, preempted_now: set[str]) -> str:
    items = []
    for r in requests:
        total = controller.total_tokens(r, max_model_len)
        flag = ""
        if r.request_id in preempted_now:
            flag = (f'<span class="ne-preempted-now" style="color:#fff;background:#c62828;padding:0 4px">'
                    f'{tr("PREEMPTED")}</span>')
        elif r.num_preemptions:
            flag = f'<span style="color:#c62828">{tr("preempted ×{n}", n=r.num_preemptions)}</span>'
        items.append(
            f'<div class="ne-req" data-request="{escape(r.request_id)}" style="margin:2px 0;font-size:12px">'
            f'<b style="color:{controller.colour(r.request_id)}">{escape(r.request_id)}</b> '
            f'{tr("{computed}/{total} tokens", computed=r.num_computed_tokens, total=total)} · '
            f'{_blocks(len(r.block_ids))} {flag}'
            f'{_progress_bar(r, total, controller.colour(r.request_id))}</div>')
    body = "".join(items) or f'<div style="color:#888;font-size:12px">{tr("empty")}</div>'
    title = {"waiting": tr("waiting ({n})", n=len(requests)),
             "running": tr("running ({n})", n=len(requests))}.get(name, f"{name} ({len(requests)})")
    return (f'<div class="ne-queue ne-queue-{name}" data-count="{len(requests)}"><b>{title}</b>{body}</div>')


def render_finished(controller: SchedulerStepperController, limit: int = 12) -> str:
    """Requests that ran to their end, newest first; aborted ones in a line of their own.

    An abort is not a finish: it lists under "aborted", so that the finished column shows
    only what the scheduler completed. Long answers are cut with an ellipsis so that
    nothing runs past the column's edge.
    """
    completed = controller.completed
    items = []
    for f in reversed(completed[-limit:]):
        text = f' · <i>{escape(f.text[:60])}</i>' if f.text else ""
        items.append(f'<div class="ne-req" data-request="{escape(f.request_id)}" style="font-size:12px;'
                     f'white-space:nowrap;overflow:hidden;text-overflow:ellipsis" title="{escape(f.text)}">'
                     f'<b style="color:{controller.colour(f.request_id)}">{escape(f.request_id)}</b> '
                     f'{tr("{reason}: {n_in} + {n_out} tokens", reason=f.finish_reason, n_in=f.num_prompt_tokens, n_out=f.num_output_tokens)}'
                     f'{text}</div>')
    body = "".join(items) or f'<div style="color:#888;font-size:12px">{tr("none yet")}</div>'
    if len(completed) > limit:
        body += f'<div style="color:#888;font-size:12px">{tr("... and {n} older", n=len(completed) - limit)}</div>'
    aborted = controller.aborted
    if aborted:
        shown = ", ".join(escape(f.request_id) for f in aborted[-limit:])
        more = tr(" and {n} more", n=len(aborted) - limit) if len(aborted) > limit else ""
        body += (f'<div class="ne-aborted" data-count="{len(aborted)}" style="font-size:12px;color:#666;'
                 f'margin-top:4px;overflow-wrap:anywhere">'
                 f'{tr("aborted ({n}): {ids}{more}", n=len(aborted), ids=shown, more=more)}</div>')
    return (f'<div class="ne-queue ne-queue-finished" data-count="{len(completed)}">'
            f'<b>{tr("finished ({n})", n=len(completed))}</b>{body}</div>')


def render_batch(controller: SchedulerStepperController) -> str:
    """The last step's batch as one bar against the token budget."""
    if not controller.steps:
        return f'<div class="ne-batch" style="font-size:12px;color:#888">{tr("no step yet")}</div>'
    s = controller.steps[-1]
    budget = s.token_budget
    segs = []
    for c in s.chunks:
        colour = controller.colour(c.request_id)
        stripes = f"repeating-linear-gradient(45deg,{colour},{colour} 3px,#fff 3px,#fff 5px)"
        pattern = colour if c.is_prefill else stripes  # decodes striped
        title = (tr("{rid}: {n} tokens (prefill chunk)", rid=c.request_id, n=c.num_tokens) if c.is_prefill
                 else tr("{rid}: {n} tokens (decode)", rid=c.request_id, n=c.num_tokens))
        segs.append(f'<div title="{escape(title)}" '
                    f'style="width:{100 * c.num_tokens / budget:.3f}%;min-width:2px;height:100%;'
                    f'background:{pattern};border-right:1px solid #fff"></div>')
    chunks = ", ".join(f"{escape(c.request_id)}: {c.num_tokens} {'prefill' if c.is_prefill else 'decode'}"
                       for c in s.chunks)
    preempted = (f' · <span style="color:#c62828;font-weight:bold">'
                 f'{tr("preempted: {ids}", ids=", ".join(map(escape, s.preempted)))}'
                 f'</span>' if s.preempted else "")
    elsewhere = (f' <span class="ne-elsewhere" style="color:#8a6d00">{tr("(run elsewhere on this engine, not by Step)")}'
                 f'</span>' if s.elsewhere else "")
    return (f'<div class="ne-batch" data-step="{s.step}" style="font-size:12px">'
            f'<b>{tr("step {step}", step=s.step)}</b>{elsewhere}: '
            f'{tr("{prefill} prefill + {decode} decode = {total} of a {budget}-token budget ({ms:.0f} ms)", prefill=s.num_prefill_tokens, decode=s.num_decode_tokens, total=s.num_tokens, budget=budget, ms=1000 * s.engine_time)}'
            f'{preempted}'
            f'<div style="display:flex;width:100%;height:16px;border:1px solid #999;background:#f5f5f5">'
            f'{"".join(segs)}</div><div style="color:#555">{chunks}</div></div>')


def render_timeline(controller: SchedulerStepperController, last: int = 60) -> str:
    """Past steps as an SVG stacked bar chart (prefill below, decode above, budget line).

    SVG rather than a matplotlib PNG: a PNG redraw costs ~150 ms on a small CPU, which
    would dominate a step of a tiny model; the SVG string takes well under a millisecond.
    The y axis fits the tallest step; the budget line is drawn when it is within reach.
    """
    steps = controller.steps[-last:]
    width, height, pad = 600, 120, 24
    if not steps:
        return f'<svg class="ne-timeline" width="{width}" height="{height}"></svg>'
    tallest = max(max(s.num_tokens for s in steps), 1)
    budget = max(s.token_budget for s in steps)
    top = budget if budget <= 2 * tallest else int(tallest * 1.1) + 1
    bar = min((width - pad) / len(steps), 24.0)
    scale = (height - pad - 12) / top
    base = height - pad
    parts = [f'<svg class="ne-timeline" data-steps="{len(controller.steps)}" width="{width}" height="{height}" '
             f'style="font:10px sans-serif">']
    if budget <= top:
        y = base - budget * scale
        parts += [f'<line x1="{pad}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888" stroke-dasharray="4 3"/>',
                  f'<text x="{pad + 2}" y="{y - 2:.1f}">{tr("token budget {budget}", budget=budget)}</text>']
    else:
        parts.append(f'<text x="{pad + 2}" y="10">'
                     f'{tr("token budget {budget} (above the chart; tallest step {tallest} tokens)", budget=budget, tallest=tallest)}'
                     f'</text>')
    for i, s in enumerate(steps):
        x = pad + i * bar
        hp, hd = s.num_prefill_tokens * scale, s.num_decode_tokens * scale
        parts.append(f'<rect x="{x:.1f}" y="{base - hp:.1f}" width="{max(bar - 1, 1):.1f}" height="{hp:.1f}" '
                     f'fill="#1f77b4"><title>{tr("step {step}: {n} prefill", step=s.step, n=s.num_prefill_tokens)}'
                     f'</title></rect>')
        parts.append(f'<rect x="{x:.1f}" y="{base - hp - hd:.1f}" width="{max(bar - 1, 1):.1f}" '
                     f'height="{hd:.1f}" fill="#ff7f0e"><title>'
                     f'{tr("step {step}: {n} decode", step=s.step, n=s.num_decode_tokens)}'
                     f'</title></rect>')
        if s.preempted:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{base + 12}" fill="#c62828" text-anchor="middle">▲</text>')
    parts.append(f'<text x="{pad}" y="{height - 2}">'
                 f'{tr("steps {first}-{last}: blue = prefill tokens, orange = decode tokens, red ▲ = preemption", first=steps[0].step, last=steps[-1].step)}'
                 f'</text></svg>')
    return "".join(parts)


# ---------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------


class SchedulerStepper(ControllerView, W.VBox):
    """Step / Run N / Play / Reset, an add-request form, queues, batch, timeline, log."""

    def __init__(self, engine: LLMEngine | None = None, controller: SchedulerStepperController | None = None,
                 play_interval_ms: int = 700, shared_with: str | None = None, **controller_kwargs) -> None:
        """``shared_with`` names another simulator that drives the same engine (e.g.
        "sampling playground above"); the view then says so in a line at its top."""
        if controller is None:
            controller = SchedulerStepperController(engine, **controller_kwargs)
        self.controller = controller
        show = self.show_message
        self.message = W.HTML()
        self.shared_note = W.HTML(shared_engine_note(shared_with))
        self._steps_drawn = len(controller.steps)
        self.step_button = W.Button(description=tr("Step"), button_style="primary")
        self.run_button = W.Button(description=tr("Run N"))
        self.run_count = W.BoundedIntText(value=10, min=0, max=100_000, description="N",
                                          layout=W.Layout(width="130px"))
        self.play = W.Play(value=0, min=0, max=10**9, interval=play_interval_ms, description=tr("Play"),
                           show_repeat=False)
        self.reset_button = W.Button(description=tr("Reset"), button_style="warning")
        # the add-request form
        has_tokenizer = controller.engine.tokenizer is not None
        self.prompt = W.Text(value="Explain continuous batching in one sentence." if has_tokenizer else "",
                             description=tr("prompt"), disabled=not has_tokenizer,
                             placeholder=tr("text prompt") if has_tokenizer else tr("no tokenizer: use random tokens"),
                             layout=W.Layout(width="420px"))
        self.random_tokens = W.BoundedIntText(value=0 if has_tokenizer else 12, min=0, max=10**7,
                                              description=tr("or random"), layout=W.Layout(width="160px"),
                                              tooltip=tr("a random prompt of this many tokens (0: use the text)"))
        self.max_tokens = W.BoundedIntText(value=16, min=0, max=10**7, description=tr("max tokens"),
                                           style={"description_width": "90px"}, layout=W.Layout(width="180px"))
        self.count = W.BoundedIntText(value=1, min=0, max=1000, description=tr("count"),
                                      layout=W.Layout(width="140px"))
        self.temperature = W.FloatText(value=0.0, description=tr("temperature"), style={"description_width": "95px"},
                                       layout=W.Layout(width="190px"))
        self.top_k = W.IntText(value=-1, description="top-k", layout=W.Layout(width="140px"))
        self.top_p = W.FloatText(value=1.0, description="top-p", layout=W.Layout(width="140px"))
        self.min_p = W.FloatText(value=0.0, description="min-p", layout=W.Layout(width="140px"))
        self.seed = W.IntText(value=-1, description=tr("seed"), tooltip=tr("-1: no seed"),
                              layout=W.Layout(width="140px"))
        self.ignore_eos = W.Checkbox(value=not has_tokenizer, description=tr("ignore EOS"), indent=False)
        self.add_button = W.Button(description=tr("Add request(s)"), button_style="success")
        self.abort_picker = W.Dropdown(options=[], description=tr("request"), layout=W.Layout(width="200px"))
        self.abort_button = W.Button(description=tr("Abort"), button_style="danger")
        self.status = W.HTML()
        self.queues = W.HTML()
        self.batch = W.HTML()
        self.timeline = W.HTML()
        self.event_log = W.HTML()
        for widget, name in ((self.step_button, "step"), (self.run_button, "run"), (self.reset_button, "reset"),
                             (self.add_button, "add"), (self.play, "play"), (self.queues, "queues"),
                             (self.batch, "batch"), (self.status, "status")):
            widget.add_class(f"ne-sched-{name}")

        @guarded(show)
        def on_step(_):
            record = controller.step()
            self.refresh(tr("ran step {step}", step=record.step) if record else tr("nothing was scheduled"), "ok")

        @guarded(show)
        def on_run(_):
            records = controller.run(self.run_count.value)
            self.refresh(tr("ran {n} steps", n=len(records)), "ok")

        @guarded(show)
        def on_play(change):
            if not self.play.playing:  # a value change while paused: nothing to do
                return
            if not controller.engine.has_unfinished_requests():
                self.play.playing = False
                self.refresh(tr("idle: every request has finished"), "info")
                return
            controller.step()
            self.refresh()

        @guarded(show)
        def on_reset(_):
            self.play.playing = False
            controller.reset()
            if controller.engine is not self.watcher.engine:  # a fresh engine from the factory
                self.watcher.close()
                self.watcher = EngineWatcher(controller.engine, self._on_engine_change)
            self.refresh(tr("reset: no requests, history cleared"), "ok")

        @guarded(show)
        def on_add(_):
            ids = controller.add_requests(self._prompt_value(), self._params(), self.count.value)
            self.refresh(tr("queued {ids}", ids=", ".join(ids)), "ok")

        @guarded(show)
        def on_abort(_):
            rid = self.abort_picker.value
            if rid is None:
                raise ValueError(tr("no request selected"))
            controller.abort(rid)
            self.refresh(tr("aborted {rid}", rid=rid), "ok")

        self.step_button.on_click(on_step)
        self.run_button.on_click(on_run)
        self.play.observe(on_play, names="value")
        self.reset_button.on_click(on_reset)
        self.add_button.on_click(on_add)
        self.abort_button.on_click(on_abort)
        form = W.VBox([W.HBox([self.prompt, self.random_tokens, self.max_tokens, self.count]),
                       W.HBox([self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.ignore_eos]),
                       W.HBox([self.add_button, self.abort_picker, self.abort_button])])
        super().__init__([
            self.shared_note,
            W.HBox([self.step_button, self.run_button, self.run_count, self.play, self.reset_button]),
            self.status, self.message, form, self.queues, W.HTML("<b>" + tr("This step's batch") + "</b>"), self.batch,
            W.HTML(f"<b>{tr('Timeline')}</b>"), self.timeline, W.HTML(f"<b>{tr('Event log (newest first)')}</b>"),
            self.event_log])
        self.add_class("ne-scheduler-stepper")
        self.watcher = EngineWatcher(controller.engine, self._on_engine_change)
        self.refresh()

    # ------------------------------------------------------------------ helpers
    def _prompt_value(self) -> str | int:
        if self.random_tokens.value > 0 or self.controller.engine.tokenizer is None:
            if self.random_tokens.value <= 0:
                raise ValueError(tr("this engine has no tokenizer: set 'or random' to a number of tokens"))
            return int(self.random_tokens.value)
        return self.prompt.value

    def _params(self) -> SamplingParams:
        seed = self.seed.value
        return SamplingParams(temperature=float(self.temperature.value), top_k=int(self.top_k.value),
                              top_p=float(self.top_p.value), min_p=float(self.min_p.value),
                              max_tokens=int(self.max_tokens.value), seed=None if seed == -1 else int(seed),
                              ignore_eos=bool(self.ignore_eos.value))

    def _on_engine_change(self) -> None:
        """Redraw after the engine changed outside this view's buttons, and say what ran."""
        new = self.controller.steps[self._steps_drawn:]
        elsewhere = sum(s.elsewhere for s in new)
        if elsewhere:
            self.refresh(tr("{n} engine step(s) ran outside this stepper (another view or cell on the same engine); "
                            "the queues show where they left every request", n=elsewhere), "info")
        else:
            self.refresh()

    def refresh(self, text: str | None = None, kind: str = "info") -> None:
        """Redraw everything from the engine's snapshot and this controller's history."""
        c = self.controller
        snap = c.snapshot()
        self._steps_drawn = len(c.steps)
        preempted_now = set(c.steps[-1].preempted) if c.steps else set()
        idle = not (snap.running or snap.waiting)
        for button in (self.step_button, self.run_button):
            button.disabled = idle  # never offer a step the display says cannot happen
            button.tooltip = tr("nothing to step: every request has finished; add one") if idle else ""
        idle_note = (f' · <b class="ne-idle">{tr("every request has finished: add one to step")}</b>'
                     if idle else "")
        # Redrawn from a StepFinished observer (no event loop to defer to), the engine's step
        # counter has not moved past the step that just finished: count that step as done.
        steps_done = max(snap.step, c.steps[-1].step + 1) if c.steps else snap.step
        self.status.value = (
            f'<div style="font-size:13px">{tr("engine step <b>{n}</b>", n=steps_done)}{idle_note} · '
            f'{tr("KV blocks free <b>{free}</b>/{total} × {size} tokens", free=snap.num_free_blocks, total=snap.num_blocks, size=snap.block_size)}'
            f' · {tr("token budget {budget}/step", budget=snap.max_num_batched_tokens)} · '
            f'{tr("max {n} running", n=snap.max_num_seqs)} · '
            f'{tr("preemptions so far <b>{n}</b>", n=snap.num_preemptions)} · {tr("policy")} '
            f'<b class="ne-policy" title="{escape(policy_note(snap.scheduling_policy))}">'
            f'{snap.scheduling_policy}</b></div>')
        columns = [render_queue(c, snap.waiting, "waiting", snap.max_model_len, preempted_now),
                   render_queue(c, snap.running, "running", snap.max_model_len, preempted_now),
                   render_finished(c)]
        self.queues.value = ('<div style="display:flex;gap:16px;align-items:flex-start;max-width:100%">'
                             + "".join(f'<div style="flex:1 1 0;min-width:0;overflow:hidden;overflow-wrap:anywhere">'
                                       f'{col}</div>' for col in columns)
                             + "</div>")
        self.batch.value = render_batch(c)
        self.timeline.value = render_timeline(c)
        self.event_log.value = ("<pre class='ne-sched-log' style='font-size:11px;max-height:14em;overflow:auto'>"
                                + escape("\n".join(list(c.shown_log)[::-1][:40]) or tr("no events yet")) + "</pre>")
        live = [r.request_id for r in (*snap.running, *snap.waiting)]
        picked = self.abort_picker.value
        self.abort_picker.options = live
        self.abort_picker.value = picked if picked in live else (live[0] if live else None)
        self.abort_button.disabled = not live
        if text is not None:
            self.show_message(text, kind)
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.drawn()
