"""The speculative decoding stepper: draft -> verify -> accept/reject on a live request (chapter 13).

One request runs on a real engine built with ``speculative_config`` (prompt lookup, the
engine's ``ngram`` method). Each Step is one ``engine.step()``, and the widget shows what that
step did for the request:

- the drafts it checked: the tokens the proposer guessed after the previous step by finding
  the context's last n tokens earlier in the context (``spec_decode.propose_ngram``);
- which of them the model agreed with (accepted, green), the first it did not (rejected,
  red), and those after it, which no longer matter (not checked, grey);
- the model's own token after them: the *correction* where a draft was rejected, or a free
  *bonus* token when every draft was accepted. A verify pass therefore emits between 1 and
  k+1 tokens for the price of about one decode step (chapter 6: small decode steps are
  bound by reading the weights);
- the tokens that reached the output (a stop among the emitted ones ends the request there),
  the KV blocks allocated for the drafts' slots and those given back when drafts were
  rejected;
- the drafts proposed for the next step, and where in the context their n-gram matched.

Where each field comes from (nothing is simulated):

- ``engine.events``: ``RequestScheduled`` (prefill or decode, how many tokens),
  ``DraftsVerified`` (the drafts checked and the tokens emitted), ``BlocksAllocated`` /
  ``BlocksFreed`` (the request's blocks), ``RequestFinished`` and ``StepFinished`` (the step
  is over: the record is complete).
- the live request (``engine.requests[id]``, held from when it was queued): its output tokens
  before and after the step (what was appended) and ``spec_token_ids`` after it (the next
  step's drafts). Both are read between the engine's phases, when they are settled.
- the totals use the engine's own counter class (``SpecDecodeStats``), fed this request's
  verify passes only, so they mean exactly what ``engine.spec_decode_stats`` means.

``SpecDecodeStepperController`` is the testable part; ``SpecDecodeStepper`` draws it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import ipywidgets as W
import numpy as np

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import (BlocksAllocated, BlocksFreed, DraftsVerified, Event, RequestFinished,
                               RequestScheduled, StepFinished)
from nanoengine.spec_decode import propose_ngram
from nanoengine.spec_decode.metrics import SpecDecodeStats
from translations import tr
from widgets._common import (ControllerView, EngineWatcher, check_int, check_request_fits, escape, guarded,
                             shared_engine_note, token_label)

#: What the chapter passes: four drafts, looked up with 4- down to 2-token n-grams.
EXAMPLE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass(frozen=True)
class SpecStep:
    """What one engine step did for the followed request.

    ``proposed`` are the drafts the request carried into the step; ``drafts`` those the step
    checked (fewer when the token budget or the KV pool had no room for all of them; none
    on a prefill step or when no n-gram matched). ``emitted`` are the tokens the step
    produced: the first ``num_accepted`` drafts, then the model's own token. ``appended``
    are those that reached the output: a stop (EOS, a stop token, max_tokens) among the
    emitted tokens ends the request there.
    """

    step: int
    is_prefill: bool
    num_scheduled_tokens: int  # of the step's token budget: its own token(s) plus the drafts
    proposed: tuple[int, ...]
    drafts: tuple[int, ...]
    emitted: tuple[int, ...]
    appended: tuple[int, ...]
    next_drafts: tuple[int, ...]  # proposed after this step, for the next one
    blocks_allocated: tuple[int, ...]
    blocks_freed: tuple[int, ...]  # rejected drafts' blocks, or all of them when the request finished
    finish_reason: str | None = None
    elsewhere: bool = False  # run by other code on the same engine, not by this controller

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1 if self.drafts else 0

    @property
    def accepted(self) -> tuple[int, ...]:
        return self.drafts[:self.num_accepted]

    @property
    def rejected(self) -> int | None:
        """The first draft the model disagreed with (None when all, or none, were checked)."""
        return self.drafts[self.num_accepted] if self.num_accepted < len(self.drafts) else None

    @property
    def unchecked(self) -> tuple[int, ...]:
        """Drafts after the rejected one: the rule stops at the first rejection."""
        return self.drafts[self.num_accepted + 1:]

    @property
    def model_token(self) -> int | None:
        """The token the model chose itself: the last emitted (None for a prefill chunk that samples nothing)."""
        return self.emitted[-1] if self.emitted else None

    @property
    def model_token_kind(self) -> str:
        """'correction' (a draft was rejected), 'bonus' (all accepted) or 'next' (nothing was drafted)."""
        if not self.drafts:
            return "next"
        return "correction" if self.rejected is not None else "bonus"

    @property
    def num_cut(self) -> int:
        """Emitted tokens that a stop kept out of the output."""
        return len(self.emitted) - len(self.appended)


@dataclass(frozen=True)
class NgramMatch:
    """Where prompt lookup found the context's suffix: tokens ``[start, start + n)`` equal the
    last ``n``, and the drafts are the tokens after them."""

    n: int
    start: int
    suffix_start: int
    drafts: tuple[int, ...]

    @property
    def drafts_start(self) -> int:
        return self.start + self.n


def find_ngram_match(token_ids: list[int], num_drafts: int, max_n: int, min_n: int) -> NgramMatch | None:
    """The match behind ``propose_ngram``'s drafts, for showing where they came from.

    Which n wins is the engine's own decision (``propose_ngram`` asked for one n at a time,
    longest first); this only locates that suffix's earliest occurrence, as its docstring
    says, so the widget can point at it. None when nothing matched.
    """
    total = len(token_ids)
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(max_n, min_n - 1, -1):
        if not propose_ngram(token_ids, 1, n, n):
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)  # (total - n, n)
        start = int(np.flatnonzero((windows == tokens[total - n:]).all(axis=1))[0])
        return NgramMatch(n, start, total - n, tuple(token_ids[start + n:start + n + num_drafts]))
    return None


@dataclass
class _Pending:
    """What the step in progress did so far for the followed request."""

    scheduled: RequestScheduled | None = None
    before: int = 0  # output tokens before the step
    proposed: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()
    emitted: tuple[int, ...] | None = None
    allocated: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class SpecDecodeStepperController:
    """Follow one request through speculative decoding, one engine step at a time.

    ``engine`` must have been built with ``speculative_config``. ``prompt`` is text (an
    engine with a tokenizer) or token ids; ``params`` are its sampling settings (greedy by
    default; ``max_tokens`` replaces theirs). An engine that already has unfinished requests
    is refused unless ``share_engine=True``: then every step advances them too, and the
    records here follow this request only.
    """

    def __init__(self, engine: LLMEngine, prompt: str | list[int], max_tokens: int = 32,
                 params: SamplingParams | None = None, share_engine: bool = False) -> None:
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        spec = engine.config.speculative_config
        if spec is None:
            raise ValueError("this engine was built without speculative_config, so it never drafts: build one with "
                             f"speculative_config={EXAMPLE_CONFIG!r} (e.g. LLM(speculative_config=...).engine)")
        self.engine = engine
        self.spec_config = spec
        self.share_engine = bool(share_engine)
        self.base_params = SamplingParams(temperature=0.0) if params is None else params
        if not isinstance(self.base_params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self.base_params.n != 1:
            raise ValueError(f"the stepper follows one completion: params.n must be 1, got {self.base_params.n}")
        self.request_id: str | None = None
        self._check_engine_free()
        checked = self._check(prompt, max_tokens)
        self._unsubscribe = engine.events.subscribe(self._on_event, RequestScheduled, DraftsVerified,
                                                    BlocksAllocated, BlocksFreed, RequestFinished, StepFinished)
        try:
            self._start(*checked)
        except Exception:
            self._unsubscribe()
            raise

    # ------------------------------------------------------------------ checks
    def _check_engine_free(self) -> None:
        """Refuse an engine busy with other requests, unless sharing was asked for."""
        if self.share_engine:
            return
        snap = self.engine.snapshot()
        others = [r.request_id for r in (*snap.running, *snap.waiting) if r.parent_id != self.request_id]
        if others:
            raise ValueError(tr("this engine has {n} unfinished request(s) ({ids}); every step would advance them "
                                "too. Finish or abort them, or pass share_engine=True", n=len(others),
                                ids=', '.join(others[:5])))

    def _check(self, prompt: str | list[int], max_tokens: int) -> tuple[str | list[int], list[int], SamplingParams]:
        """(prompt, its token ids, params), or a ValueError; changes nothing."""
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(tr("prompt is empty: type some text"))
        max_tokens = check_int(tr("max tokens"), max_tokens, 1, self.engine.max_model_len)
        _, token_ids = self.engine.tokenize_prompt(prompt)
        check_request_fits(self.engine, len(token_ids), max_tokens)
        return prompt, token_ids, replace(self.base_params, max_tokens=max_tokens)

    def _start(self, prompt: str | list[int], token_ids: list[int], params: SamplingParams) -> None:
        self.prompt = prompt
        self.prompt_token_ids = list(token_ids)
        self.params = params
        self.steps: list[SpecStep] = []
        self.stats = SpecDecodeStats(self.spec_config.num_speculative_tokens)
        self.finish_reason: str | None = None
        self._pending = _Pending()
        self._stepping = False
        self.request_id = self.engine.add_request(prompt, params)
        # The live request, held so that it can still be read once finished (the engine
        # drops it from ``requests`` then). Read only between the engine's phases.
        self._request = self.engine.requests[self.request_id]

    # ----------------------------------------------------------------- actions
    def step(self) -> SpecStep | None:
        """Run exactly one ``engine.step()``; this request's record of it (None if it was not scheduled)."""
        if self.finished:
            raise ValueError(tr("request {rid} has finished ({reason}); press Reset for a new one",
                                rid=self.request_id, reason=self.finish_reason))
        before = len(self.steps)
        self._stepping = True
        try:
            self.engine.step()
        finally:
            self._stepping = False
        return self.steps[-1] if len(self.steps) > before else None

    def run_to_end(self, max_steps: int = 10_000) -> list[SpecStep]:
        """Step until the request finishes (at most ``max_steps`` engine steps)."""
        max_steps = check_int(tr("steps"), max_steps, 1, 100_000)
        if self.finished:
            raise ValueError(tr("request {rid} has finished ({reason}); press Reset for a new one",
                                rid=self.request_id, reason=self.finish_reason))
        before = len(self.steps)
        for _ in range(max_steps):
            if self.finished:
                break
            self.step()
        return self.steps[before:]

    def reset(self, prompt: str | list[int] | None = None, max_tokens: int | None = None) -> str:
        """A new request (the same prompt and length unless given); the old one is aborted if unfinished.

        Everything is checked before the old request is touched, so a bad value changes nothing.
        """
        checked = self._check(self.prompt if prompt is None else prompt,
                              self.params.max_tokens if max_tokens is None else max_tokens)
        self._check_engine_free()
        if not self.finished:
            self.engine.abort(self.request_id)
        self._start(*checked)
        return self.request_id

    def close(self) -> None:
        """Stop listening to the engine (the request is left as it is)."""
        self._unsubscribe()

    # ---------------------------------------------------------------- observing
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._request.output_token_ids)

    @property
    def next_drafts(self) -> tuple[int, ...]:
        """The drafts the next step will check (empty when finished or when nothing matched)."""
        return () if self.finished else tuple(self._request.spec_token_ids)

    @property
    def token_origins(self) -> list[str]:
        """For each output token: 'draft' (an accepted draft) or 'model' (the model's own)."""
        origins = []
        for s in self.steps:
            origins += ["draft" if i < s.num_accepted else "model" for i in range(len(s.appended))]
        return origins

    def ngram_match(self) -> NgramMatch | None:
        """Where the next drafts' n-gram was found in the context (None if there are no drafts)."""
        drafts = self.next_drafts
        if not drafts:
            return None
        spec = self.spec_config
        return find_ngram_match(list(self._request.all_token_ids), len(drafts), spec.prompt_lookup_max,
                                spec.prompt_lookup_min)

    # totals, for this request only (the engine's counters cover every request)
    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.appended) for s in self.steps)

    @property
    def num_token_steps(self) -> int:
        """Steps that added at least one token (every decode step and the prompt's last chunk)."""
        return sum(bool(s.appended) for s in self.steps)

    @property
    def steps_saved(self) -> int:
        """Steps plain decoding would have needed beyond these: it adds one token per step."""
        return self.num_output_tokens - self.num_token_steps

    # ----------------------------------------------------------------- events
    def _on_event(self, event: Event) -> None:
        if isinstance(event, StepFinished):
            self._finish_step(event)
            return
        if getattr(event, "request_id", None) != self.request_id or self.request_id is None:
            return
        pending = self._pending
        if isinstance(event, RequestScheduled):
            pending.scheduled = event
            pending.before = len(self._request.output_token_ids)
            pending.proposed = tuple(self._request.spec_token_ids)
        elif isinstance(event, DraftsVerified):
            pending.drafts, pending.emitted = event.draft_token_ids, event.emitted
            self.stats.observe(event.draft_token_ids, event.emitted)
        elif isinstance(event, BlocksAllocated):
            pending.allocated += event.block_ids
        elif isinstance(event, BlocksFreed):
            pending.freed += event.block_ids
        elif isinstance(event, RequestFinished):
            self.finish_reason = event.finish_reason
            if pending.scheduled is None:  # an abort between steps: no step to record it in
                self._pending = _Pending()
            else:
                pending.finish_reason = event.finish_reason

    def _finish_step(self, event: StepFinished) -> None:
        pending, self._pending = self._pending, _Pending()
        if pending.scheduled is None:  # the step ran other requests only
            return
        request = self._request
        appended = tuple(request.output_token_ids[pending.before:])
        emitted = pending.emitted if pending.emitted is not None else appended
        self.steps.append(SpecStep(
            step=event.step, is_prefill=pending.scheduled.is_prefill,
            num_scheduled_tokens=pending.scheduled.num_tokens, proposed=pending.proposed,
            drafts=pending.drafts, emitted=tuple(emitted), appended=appended,
            next_drafts=() if request.is_finished else tuple(request.spec_token_ids),
            blocks_allocated=tuple(pending.allocated), blocks_freed=tuple(pending.freed),
            finish_reason=pending.finish_reason, elsewhere=not self._stepping))


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------

#: (background, border/text) per chip kind.
CHIP_COLOURS = {"accepted": ("#c8e6c9", "#2e7d32"), "rejected": ("#ffcdd2", "#c62828"),
                "unchecked": ("#eeeeee", "#9e9e9e"), "model": ("#bbdefb", "#1565c0"),
                "cut": ("#fff3e0", "#ef6c00"), "proposed": ("#f3e5f5", "#8e24aa")}

def chip_note(kind: str) -> str:
    """A chip kind's explanation, in the notebook's language."""
    return {"accepted": tr("accepted draft: the model agreed, a token gained for free"),
            "rejected": tr("rejected draft: the model chose another token here, so it and every draft after it "
                           "are dropped"),
            "unchecked": tr("not checked: after the first rejection the rule stops; these drafts are dropped"),
            "model": tr("the model's own token"),
            "cut": tr("emitted but not in the output: a stop came before it"),
            "proposed": tr("proposed by prompt lookup: the next step checks it")}[kind]


CHIP_NOTES = {"accepted": "accepted draft: the model agreed, a token gained for free",
              "rejected": "rejected draft: the model chose another token here, so it and every draft after it "
                          "are dropped",
              "unchecked": "not checked: after the first rejection the rule stops; these drafts are dropped",
              "model": "the model's own token",
              "cut": "emitted but not in the output: a stop came before it",
              "proposed": "proposed by prompt lookup: the next step checks it"}


def chip(engine: LLMEngine, token_id: int, kind: str, note: str = "") -> str:
    bg, fg = CHIP_COLOURS[kind]
    dashed = "dashed" if kind in ("unchecked", "proposed") else "solid"
    strike = "text-decoration:line-through;" if kind in ("rejected", "unchecked", "cut") else ""
    title = f"{chip_note(kind)}{note}" + tr(" (id {token_id})", token_id=token_id)
    return (f'<span class="ne-chip ne-chip-{kind}" data-token="{token_id}" title="{escape(title)}" '
            f'style="display:inline-block;margin:1px 2px;padding:1px 6px;border-radius:10px;font:12px monospace;'
            f'background:{bg};border:1px {dashed} {fg};color:{fg};{strike}">'
            f'{escape(token_label(engine, token_id))}</span>')


def _piece(engine: LLMEngine, token_id: int) -> str:
    """A token as it reads in running text (its decoded piece; '#id ' without a tokenizer)."""
    return f"#{token_id} " if engine.tokenizer is None else engine.decode([token_id])


def render_text(c: SpecDecodeStepperController) -> str:
    """The request so far: the prompt, then each output token coloured by who produced it."""
    engine = c.engine
    parts = [f'<span class="ne-spec-prompt" style="color:#666">'
             f'{"".join(escape(_piece(engine, t)) for t in c.prompt_token_ids)}</span>']
    for token, origin in zip(c.output_token_ids, c.token_origins):
        style = ("background:#c8e6c9;border-bottom:2px solid #2e7d32" if origin == "draft"
                 else "background:#e3f2fd;border-bottom:2px solid #1565c0")
        label = tr("accepted draft") if origin == "draft" else tr("model's own token")
        parts.append(f'<span class="ne-spec-tok ne-spec-{origin}" title="{escape(label)}: '
                     f'{escape(token_label(engine, token))}" style="{style}">{escape(_piece(engine, token))}</span>')
    state = (' <span class="ne-spec-finished" style="color:#2e7d32">'
             + tr("[finished: {reason}]", reason=escape(c.finish_reason)) + '</span>' if c.finished else "")
    return (f'<div class="ne-spec-text" style="font:13px monospace;white-space:pre-wrap;overflow-wrap:anywhere;'
            f'line-height:1.7;border:1px solid #ddd;padding:6px;max-height:14em;overflow:auto">'
            f'{"".join(parts)}{state}</div>'
            '<div style="font-size:11px;color:#555">'
            + tr('grey: prompt · <span style="background:#c8e6c9">green</span>: accepted drafts · '
                 '<span style="background:#e3f2fd">blue</span>: the model\'s own tokens') + '</div>')


def render_step(c: SpecDecodeStepperController) -> str:
    """The last step: the drafts checked as chips, then the model's token, and what reached the output."""
    if not c.steps:
        return ('<div class="ne-spec-step" style="color:#888;font-size:12px">' + tr("no step yet: press Step")
                + '</div>')
    s, engine = c.steps[-1], c.engine
    where = (' <span class="ne-elsewhere" style="color:#8a6d00">'
             + tr("(run elsewhere on this engine, not by Step)") + '</span>' if s.elsewhere else "")
    head = tr("<b>engine step {step}</b>{where}: ", step=s.step, where=where)
    if s.is_prefill:
        body = tr("prefill of {n} prompt token(s): nothing to draft yet (drafts come from the context, after the "
                  "first token). ", n=s.num_scheduled_tokens)
        if s.model_token is not None:
            body += tr("First token: {chip}", chip=chip(engine, s.model_token, "model"))
    elif not s.drafts:
        why = (tr("no n-gram of the context's end occurred earlier, so there was nothing to propose")
               if not s.proposed else tr("{n} draft(s) were proposed but did not fit this step (token budget or "
                                         "free KV blocks): a plain decode", n=len(s.proposed)))
        token = "" if s.model_token is None else chip(engine, s.model_token, "model", tr(": the next token"))
        body = tr("plain decode ({why}). Token: {token}", why=why, token=token)
    else:
        chips = [chip(engine, t, "accepted") for t in s.accepted]
        if s.rejected is not None:
            chips.append(chip(engine, s.rejected, "rejected"))
        chips += [chip(engine, t, "unchecked") for t in s.unchecked]
        kind = s.model_token_kind
        note = (tr(": the correction, where the rejected draft was") if kind == "correction"
                else tr(": a bonus token, after every draft was accepted"))
        cut = set(range(len(s.appended), len(s.emitted)))
        own = chip(engine, s.model_token, "cut" if len(s.emitted) - 1 in cut else "model", note)
        fitted = ("" if len(s.proposed) <= len(s.drafts)
                  else tr(" ({n} more proposed; no room for them this step)", n=len(s.proposed) - len(s.drafts)))
        checked = (tr("checked {n} draft(s){fitted} in one pass of {tokens} tokens: {accepted} accepted, then the "
                      "model's correction token.", n=len(s.drafts), fitted=fitted, tokens=s.num_scheduled_tokens,
                      accepted=s.num_accepted) if kind == "correction"
                   else tr("checked {n} draft(s){fitted} in one pass of {tokens} tokens: {accepted} accepted, then "
                           "the model's bonus token.", n=len(s.drafts), fitted=fitted, tokens=s.num_scheduled_tokens,
                           accepted=s.num_accepted))
        body = (checked +
                f'<div class="ne-spec-chips" style="margin:4px 0">{"".join(chips)}'
                f'<span style="margin:0 4px;color:#555">→</span>{own}</div>')
    appended = "".join(chip(engine, t, "accepted" if i < s.num_accepted else "model")
                       for i, t in enumerate(s.appended))
    out = '<div>' + tr("appended to the output ({n}): {tokens}", n=len(s.appended),
                       tokens=appended or tr("nothing"))
    if s.num_cut:
        out += ' · <b style="color:#ef6c00">' + tr("{n} emitted token(s) cut off by the stop", n=s.num_cut) + '</b>'
    out += "</div>"
    blocks = []
    if s.blocks_allocated:
        blocks.append(tr("allocated KV blocks {blocks}", blocks=list(s.blocks_allocated)))
    if s.blocks_freed:
        why = tr("the request finished") if s.finish_reason else tr("they held only rejected drafts")
        blocks.append(tr("freed {blocks} ({why})", blocks=list(s.blocks_freed), why=why))
    blocks_line = f'<div style="color:#555">{escape(" · ".join(blocks))}</div>' if blocks else ""
    finished = ('<div class="ne-spec-finished"><b>' + tr("finished: {reason}", reason=escape(s.finish_reason))
                + '</b></div>'
                if s.finish_reason else "")
    return (f'<div class="ne-spec-step" data-step="{s.step}" style="font-size:12px;line-height:1.6">'
            f'{head}{body}{out}{blocks_line}{finished}</div>')


def render_lookup(c: SpecDecodeStepperController, context: int = 6) -> str:
    """The next step's drafts and the earlier place in the context their n-gram was found."""
    engine, drafts = c.engine, c.next_drafts
    if c.finished:
        return ('<div class="ne-spec-lookup" style="font-size:12px;color:#888">'
                + tr("finished: nothing more to draft") + '</div>')
    if not drafts:
        prompt_left = not c.steps or (c.steps[-1].is_prefill and not c.steps[-1].appended)
        why = (tr("the prompt is still being computed") if prompt_left
               else tr("the context's last {lo}-{hi} tokens occur nowhere earlier (or no room is left): the next step "
                       "decodes one token", lo=c.spec_config.prompt_lookup_min, hi=c.spec_config.prompt_lookup_max))
        return ('<div class="ne-spec-lookup" style="font-size:12px;color:#555">'
                + tr("no drafts for the next step: {why}", why=why) + '</div>')
    match = c.ngram_match()
    tokens = list(c._request.all_token_ids)
    chips = "".join(chip(engine, t, "proposed") for t in drafts)
    if match is None:  # cannot happen while the engine's proposer is prompt lookup; shown rather than hidden
        return '<div class="ne-spec-lookup" style="font-size:12px">' + tr("next drafts: {chips}", chips=chips) + '</div>'

    def run(lo: int, hi: int, style: str = "") -> str:
        return "".join(f'<span style="{style}">{escape(_piece(engine, t))}</span>' for t in tokens[max(lo, 0):hi])

    mark = "background:#fff59d;border-bottom:2px solid #f9a825"
    src = "background:#e1bee7;border-bottom:2px solid #8e24aa"
    lead = "…" if match.start - context > 0 else ""
    earlier = (f'{lead}{run(match.start - context, match.start)}'
               f'<span class="ne-spec-match">{run(match.start, match.drafts_start, mark)}</span>'
               f'<span class="ne-spec-source">{run(match.drafts_start, match.drafts_start + len(drafts), src)}</span>'
               f'{run(match.drafts_start + len(drafts), match.drafts_start + len(drafts) + context)}…')
    suffix = f'…{run(match.suffix_start - context, match.suffix_start)}{run(match.suffix_start, len(tokens), mark)}'
    found = (tr("found earlier at position {start} (in the prompt); the tokens that followed them (purple) are the "
                "drafts:", start=match.start) if match.start < len(c.prompt_token_ids)
             else tr("found earlier at position {start} (in the output); the tokens that followed them (purple) are "
                     "the drafts:", start=match.start))
    return (f'<div class="ne-spec-lookup" data-match-start="{match.start}" data-n="{match.n}" '
            f'style="font-size:12px;line-height:1.7">' + tr("next step's drafts: {chips}", chips=chips)
            + '<div>' + tr("the context ends with these {n} tokens (yellow):", n=match.n)
            + f'<div style="font:12px monospace;white-space:pre-wrap">{suffix}</div></div>'
            f'<div>{found}<div style="font:12px monospace;white-space:pre-wrap">{earlier}</div>'
            f'</div></div>')


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render_totals(c: SpecDecodeStepperController) -> str:
    """This request's counters beside the engine's (which cover every request since it started)."""
    st, engine_st = c.stats, c.engine.spec_decode_stats
    rate = "–" if st.acceptance_rate is None else f"{100 * st.acceptance_rate:.0f}%"
    engine_rate = "–" if engine_st.acceptance_rate is None else f"{100 * engine_st.acceptance_rate:.0f}%"
    rows = [  # (name, what the reader sees, this request, the engine, note)
        ("engine steps", tr("engine steps"), c.num_steps, "", tr("steps that ran this request")),
        ("output tokens", tr("output tokens"), c.num_output_tokens, "", ""),
        ("verify passes with drafts", tr("verify passes with drafts"), st.num_drafts, engine_st.num_drafts,
         "vLLM: num_drafts"),
        ("drafted tokens checked", tr("drafted tokens checked"), st.num_draft_tokens, engine_st.num_draft_tokens,
         "num_draft_tokens"),
        ("accepted drafts", tr("accepted drafts"), st.num_accepted_tokens, engine_st.num_accepted_tokens,
         "num_accepted_tokens"),
        ("acceptance rate", tr("acceptance rate"), rate, engine_rate, tr("accepted / drafted")),
        ("tokens per verify pass", tr("tokens per verify pass"), _fmt(st.mean_acceptance_length),
         _fmt(engine_st.mean_acceptance_length), tr("1 + accepted / passes")),
        ("steps saved", tr("steps saved"), c.steps_saved, "",
         tr("output tokens − steps that added tokens: plain decoding adds one token per step")),
    ]
    body = "".join(f'<tr class="ne-spec-total" data-name="{escape(name)}"><td style="text-align:left">{escape(label)}'
                   f'</td><td><b>{escape(mine)}</b></td><td>{escape(all_)}</td>'
                   f'<td style="text-align:left;color:#666">{escape(note)}</td></tr>'
                   for name, label, mine, all_, note in rows)
    return ('<table class="ne-spec-totals" style="font-size:12px;border-collapse:collapse">'
            + tr('<tr><th></th><th>this request</th><th>engine (all requests)</th><th></th></tr>') + f'{body}</table>')


# ---------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------


def parse_token_ids(text: str) -> list[int]:
    """'101 102, 103' -> [101, 102, 103]: a prompt for an engine without a tokenizer."""
    pieces = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not pieces:
        raise ValueError(tr("prompt is empty: this engine has no tokenizer, so type token ids, e.g. '101 102 103'"))
    try:
        return [int(p) for p in pieces]
    except ValueError:
        raise ValueError(tr("this engine has no tokenizer: type token ids separated by spaces, e.g. '101 102 103', "
                            "got {text!r:.60}", text=text)) from None


def _has_chat_template(engine: LLMEngine) -> bool:
    return engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))


def _as_chat(engine: LLMEngine, message: str) -> str:
    """``message`` as one user turn through the engine's chat template (the prompt ``LLM.chat`` sends)."""
    if not message.strip():
        raise ValueError(tr("prompt is empty: type some text"))
    if not _has_chat_template(engine):
        raise ValueError(tr("this engine's tokenizer has no chat template: untick 'chat template' and type the "
                            "prompt"))
    return engine.input_processor.apply_chat_template([{"role": "user", "content": message}])


class SpecDecodeStepper(ControllerView, W.VBox):
    """Step / Run to end / Reset over one request: text, the last step's drafts, the next ones, totals."""

    def __init__(self, engine: LLMEngine | None = None, prompt: str | list[int] | None = None, max_tokens: int = 32,
                 controller: SpecDecodeStepperController | None = None, shared_with: str | None = None,
                 chat: bool = False, **controller_kwargs) -> None:
        """``shared_with`` names another simulator that drives the same engine; the view then says so.
        ``chat``: ``prompt`` is a user's message, and the request is the model's chat template over
        it (an instruction-tuned model answers a message; a bare question often just ends); the
        prompt box then holds the message, and a checkbox turns the template off."""
        if controller is None:
            if prompt is None:
                raise ValueError("give a prompt (text, or token ids for an engine without a tokenizer)")
            if chat and not isinstance(prompt, str):
                raise ValueError(f"chat=True takes the user's message as text, got {type(prompt).__name__}")
            request = _as_chat(engine, prompt) if chat else prompt
            controller = SpecDecodeStepperController(engine, request, max_tokens, **controller_kwargs)
        self.controller = controller
        self.message_text = prompt if chat else None  # what the prompt box shows when the template is on
        show = self.show_message
        self.message = W.HTML()
        self.shared_note = W.HTML(shared_engine_note(shared_with))
        self.step_button = W.Button(description=tr("Step"), button_style="primary")
        self.run_button = W.Button(description=tr("Run to end"))
        self.reset_button = W.Button(description=tr("Reset"), button_style="warning",
                                     tooltip=tr("a new request with the prompt and max tokens below"))
        prompt_text = (self.message_text if chat else controller.prompt if isinstance(controller.prompt, str)
                       else " ".join(str(t) for t in controller.prompt))
        self.chat = W.Checkbox(value=chat, description=tr("chat template"), indent=False, layout=W.Layout(width="130px"),
                               disabled=not _has_chat_template(controller.engine),
                               tooltip=tr("wrap the prompt box's text as a user's message in the model's chat template"))
        placeholder = tr("text") if controller.engine.tokenizer is not None else tr("token ids: 101 102 103")
        self.prompt = W.Text(value=prompt_text, description=tr("prompt"), layout=W.Layout(width="520px"),
                             placeholder=placeholder)
        # wide bounds: a value out of range reaches the controller, which says what is allowed
        self.max_tokens = W.BoundedIntText(value=controller.params.max_tokens, min=-10**7, max=10**7,
                                           description=tr("max tokens"), style={"description_width": "80px"},
                                           layout=W.Layout(width="170px"))
        self.status = W.HTML()
        self.text = W.HTML()
        self.last_step = W.HTML()
        self.lookup = W.HTML()
        self.totals = W.HTML()
        for widget, name in ((self.step_button, "step"), (self.run_button, "run"), (self.reset_button, "reset")):
            widget.add_class(f"ne-spec-{name}")

        @guarded(show)
        def on_step(_):
            record = controller.step()
            if record is None:
                self.refresh(tr("the engine ran a step, but not this request (its queue was full)"), "info")
            else:
                self.refresh(tr("step {step}: {n} token(s) added", step=record.step, n=len(record.appended)), "ok")

        @guarded(show)
        def on_run(_):
            records = controller.run_to_end()
            self.refresh(tr("ran {ran} steps: {tokens} tokens in {steps} steps, {saved} fewer than plain decoding",
                            ran=len(records), tokens=controller.num_output_tokens, steps=controller.num_steps,
                            saved=controller.steps_saved), "ok")

        @guarded(show)
        def on_reset(_):
            rid = controller.reset(self._prompt_value(), self.max_tokens.value)
            self.refresh(tr("new request {rid}", rid=rid), "ok")

        self.step_button.on_click(on_step)
        self.run_button.on_click(on_run)
        self.reset_button.on_click(on_reset)
        super().__init__([
            self.shared_note, W.HBox([self.step_button, self.run_button, self.reset_button]),
            W.HBox([self.prompt, self.chat, self.max_tokens]), self.status, self.message,
            W.HTML(tr("<b>The request so far</b>")), self.text,
            W.HTML(tr("<b>Last step: draft → verify → accept/reject</b>")), self.last_step,
            W.HTML(tr("<b>Next step's drafts (prompt lookup)</b>")), self.lookup, W.HTML(tr("<b>Totals</b>")),
            self.totals])
        self.add_class("ne-spec-decode-stepper")
        self.watcher = EngineWatcher(controller.engine, self.refresh)
        self.refresh()

    def close(self) -> None:
        if getattr(self, "controller", None) is None:  # the constructor refused its input: nothing listens
            W.VBox.close(self)
            return
        super().close()

    def _prompt_value(self) -> str | list[int]:
        if self.controller.engine.tokenizer is None:
            return parse_token_ids(self.prompt.value)
        if self.chat.value:
            return _as_chat(self.controller.engine, self.prompt.value)
        return self.prompt.value

    def refresh(self, text: str | None = None, kind: str = "info") -> None:
        """Redraw everything from the controller's records and the live request."""
        c = self.controller
        spec = c.spec_config
        for button in (self.step_button, self.run_button):
            button.disabled = c.finished
            button.tooltip = tr("the request has finished: Reset for a new one") if c.finished else ""
        sampling = (tr("greedy") if c.params.temperature == 0
                    else tr("temperature {t:g}", t=c.params.temperature))
        self.status.value = (
            '<div style="font-size:13px">'
            + tr("request <b>{rid}</b> · {n} prompt tokens · max tokens {max_tokens} · {mode} · prompt lookup: "
                 "up to <b>{k}</b> drafts from {hi}- down to {lo}-token n-grams", rid=escape(c.request_id),
                 n=len(c.prompt_token_ids), max_tokens=c.params.max_tokens, mode=sampling,
                 k=spec.num_speculative_tokens, hi=spec.prompt_lookup_max, lo=spec.prompt_lookup_min) + '</div>')
        self.text.value = render_text(c)
        self.last_step.value = render_step(c)
        self.lookup.value = render_lookup(c)
        self.totals.value = render_totals(c)
        if text is not None:
            self.show_message(text, kind)
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.drawn()
