"""The structured output stepper: the grammar's mask over the vocabulary, one step at a time (chapter 14).

One constrained request (``SamplingParams(structured_outputs=...)``) runs on a real engine.
Each Step is one ``engine.step()``, and the widget shows what the mask did at that step:

- how many of the vocabulary's tokens the grammar allowed there (a packed bitmask, one bit per
  token, filled by the request's own grammar exactly as the engine fills its row);
- the model's top tokens *before* the mask (its raw next-token distribution) and *after* it
  (the same logits with every forbidden token at -inf, renormalised): where they differ, the
  grammar overruled the model;
- a *forced* token: a position where exactly one token was allowed, so the model's opinion did
  not matter at all;
- the token the engine really appended, and whether the grammar is now complete (the request
  then finishes with ``finish_reason`` "stop").

Where each field comes from (nothing is simulated):

- the mask: the request's grammar (``request.structured_output``), compiled by the engine on its
  thread; ``fill_bitmask`` writes the allowed tokens without advancing the grammar, into a row
  from ``allocate_token_bitmask``; ``apply_token_bitmask`` masks the logits as the model runner
  does before sampling.
- the logits: ``engine.next_token_logits`` over the request's tokens so far (one extra prefill
  through the paged cache, mostly a prefix-cache hit), read *before* the step runs;
- the appended token: the live request's output tokens before and after ``engine.step()``.

``StructuredOutputStepperController`` is the testable part; ``StructuredOutputStepper`` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ipywidgets as W
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output.backend import allocate_token_bitmask, apply_token_bitmask
from translations import tr
from widgets._common import (ControllerView, EngineWatcher, check_int, check_request_fits, escape, guarded,
                             shared_engine_note, token_label)

#: A small schema to step through: two required fields, nothing else allowed.
EXAMPLE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}


@dataclass(frozen=True)
class GrammarStep:
    """What the mask did at one engine step of the followed request.

    ``top_before`` and ``top_after`` are (token id, probability) pairs, the model's most likely
    tokens over the whole vocabulary and over the allowed tokens only. ``appended`` are the
    tokens the step added to the output (none for a prefill chunk that does not sample).
    """

    step: int
    num_allowed: int
    vocab_size: int
    top_before: tuple[tuple[int, float], ...]
    top_after: tuple[tuple[int, float], ...]
    appended: tuple[int, ...]
    terminated: bool
    finish_reason: str | None = None

    @property
    def forced(self) -> bool:
        """Exactly one token was allowed: the grammar, not the model, chose it."""
        return self.num_allowed == 1

    @property
    def token(self) -> int | None:
        return self.appended[0] if self.appended else None

    @property
    def overruled(self) -> bool:
        """The model's favourite token was forbidden here: the mask changed the choice."""
        return bool(self.top_before) and bool(self.top_after) and self.top_before[0][0] != self.top_after[0][0]


def allowed_mask(grammar, vocab_size: int) -> torch.Tensor:
    """A (vocab,) bool tensor: the tokens ``grammar`` allows next (the grammar does not advance)."""
    bitmask = allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    apply_token_bitmask(logits, bitmask)  # the runner's own unpacking: allowed stays 0, forbidden -inf
    return logits[0] == 0


def top_tokens(logits: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of ``logits`` (vocab,) and their softmax probabilities (-inf: never)."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, k)
    return tuple((int(i), float(v)) for i, v in zip(ids, values) if v > 0)


class StructuredOutputStepperController:
    """Follow one constrained request, one engine step at a time.

    ``constraint`` is a ``StructuredOutputsParams`` (JSON schema, regex, choice, grammar);
    ``params`` the rest of the sampling settings (greedy by default; ``max_tokens`` replaces
    theirs). An engine that already has unfinished requests is refused unless
    ``share_engine=True``.
    """

    def __init__(self, engine: LLMEngine, prompt: str | list[int], constraint: StructuredOutputsParams,
                 max_tokens: int = 48, params: SamplingParams | None = None, top_k: int = 5,
                 share_engine: bool = False) -> None:
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        if not isinstance(constraint, StructuredOutputsParams):
            raise TypeError(f"constraint must be a StructuredOutputsParams, e.g. StructuredOutputsParams(json=...), "
                            f"got {type(constraint).__name__}")
        self.engine = engine
        self.share_engine = bool(share_engine)
        self.top_k = check_int(tr("top k"), top_k, 1, 20)
        self.base_params = SamplingParams(temperature=0.0) if params is None else params
        if not isinstance(self.base_params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self.base_params.n != 1:
            raise ValueError(f"the stepper follows one completion: params.n must be 1, got {self.base_params.n}")
        self.request_id: str | None = None
        self._check_engine_free()
        self._start(*self._check(prompt, constraint, max_tokens))

    def _check_engine_free(self) -> None:
        if self.share_engine:
            return
        snap = self.engine.snapshot()
        others = [r.request_id for r in (*snap.running, *snap.waiting) if r.request_id != self.request_id]
        if others:
            raise ValueError(tr("this engine has {n} unfinished request(s) ({ids}); every step would advance them "
                                "too. Finish or abort them, or pass share_engine=True", n=len(others),
                                ids=', '.join(others[:5])))

    def _check(self, prompt, constraint: StructuredOutputsParams, max_tokens: int):
        """(prompt, params), or a ValueError; changes nothing (the engine checks that the constraint compiles)."""
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(tr("prompt is empty: type some text"))
        max_tokens = check_int(tr("max tokens"), max_tokens, 1, self.engine.max_model_len)
        _, token_ids = self.engine.tokenize_prompt(prompt)
        check_request_fits(self.engine, len(token_ids), max_tokens)
        params = replace(self.base_params, max_tokens=max_tokens, structured_outputs=constraint)
        self.engine.structured_output.validate(params)  # a constraint that does not compile: its reason
        return prompt, params

    def _start(self, prompt, params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.steps: list[GrammarStep] = []
        self.finish_reason: str | None = None
        self.request_id = self.engine.add_request(prompt, params)
        # The live request, held so that it can be read once finished (the engine drops it then).
        self._request = self.engine.requests[self.request_id]

    # ----------------------------------------------------------------- actions
    def grammar(self):
        """The request's grammar, waiting for its compile (on the engine's thread) if need be."""
        structured = self._request.structured_output
        return structured.grammar if structured.grammar is not None else structured.compiling.result()

    def step(self) -> GrammarStep:
        """Read the mask and the logits for the next token, then run exactly one ``engine.step()``."""
        if self.finished:
            raise ValueError(tr("request {rid} has finished ({reason}); press Reset", rid=self.request_id,
                                reason=self.finish_reason))
        request, engine = self._request, self.engine
        grammar = self.grammar()
        logits = engine.next_token_logits(list(request.all_token_ids)).float()
        vocab = logits.shape[-1]
        allowed = allowed_mask(grammar, vocab)
        masked = logits.masked_fill(~allowed, float("-inf"))
        before = request.num_output_tokens
        step = engine.step_count
        engine.step()
        appended = tuple(request.output_token_ids[before:])
        if request.is_finished:
            self.finish_reason = request.status.finish_reason or "stop"
        record = GrammarStep(step=step, num_allowed=int(allowed.sum()), vocab_size=vocab,
                             top_before=top_tokens(logits, self.top_k), top_after=top_tokens(masked, self.top_k),
                             appended=appended, terminated=grammar.is_terminated(), finish_reason=self.finish_reason)
        self.steps.append(record)
        return record

    def run_to_end(self, max_steps: int = 1000) -> list[GrammarStep]:
        max_steps = check_int(tr("steps"), max_steps, 1, 100_000)
        before = len(self.steps)
        for _ in range(max_steps):
            if self.finished:
                break
            self.step()
        return self.steps[before:]

    def reset(self, prompt=None, max_tokens: int | None = None) -> str:
        """A new request (same prompt, constraint and length unless given); the old one is aborted."""
        checked = self._check(self.prompt if prompt is None else prompt, self.params.structured_outputs,
                              self.params.max_tokens if max_tokens is None else max_tokens)
        if not self.finished:
            self.engine.abort(self.request_id)
        self._check_engine_free()
        self._start(*checked)
        return self.request_id

    def close(self) -> None:
        """Nothing to stop: the controller reads the engine between steps and subscribes to no events."""

    # ---------------------------------------------------------------- observing
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self._request.is_finished

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._request.output_token_ids)

    @property
    def text(self) -> str:
        return self.engine.decode(self.output_token_ids) if self.engine.tokenizer is not None else \
            " ".join(map(str, self.output_token_ids))

    @property
    def num_forced(self) -> int:
        return sum(s.forced for s in self.steps)

    @property
    def num_overruled(self) -> int:
        return sum(s.overruled for s in self.steps)


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------

def _chips(engine: LLMEngine, tops: tuple[tuple[int, float], ...], chosen: int | None, allowed: set[int] | None) -> str:
    parts = []
    for token, p in tops:
        forbidden = allowed is not None and token not in allowed
        style = ("background:#ffcdd2;color:#c62828;text-decoration:line-through" if forbidden
                 else "background:#c8e6c9;color:#2e7d32" if token == chosen else "background:#eeeeee;color:#333")
        parts.append(f'<span class="ne-so-chip" data-token="{token}" style="display:inline-block;margin:1px 2px;'
                     f'padding:1px 6px;border-radius:10px;font:12px monospace;{style}">'
                     f'{escape(token_label(engine, token))} {100 * p:.0f}%</span>')
    return "".join(parts)


def render_step(c: StructuredOutputStepperController) -> str:
    """The last step: allowed count, the top tokens before and after the mask, the token taken."""
    if not c.steps:
        return '<div class="ne-so-step" style="color:#888;font-size:12px">' + tr("no step yet: press Step") + '</div>'
    s, engine = c.steps[-1], c.engine
    after_ids = {t for t, _ in s.top_after}
    forbidden_top = {t for t, _ in s.top_before if t not in after_ids and s.num_allowed < s.vocab_size}
    allowed = {t for t, _ in s.top_before} - forbidden_top
    forced = (' <b class="ne-so-forced" style="color:#8e24aa">' + tr("forced: only one token allowed") + '</b>'
              if s.forced else "")
    overruled = (' <b class="ne-so-overruled" style="color:#c62828">' + tr("the model's favourite was forbidden")
                 + '</b>' if s.overruled else "")
    done = '<div><b>' + tr("finished: {reason}", reason=escape(s.finish_reason)) + '</b></div>' if s.finish_reason else ""
    appended = escape(" ".join(token_label(engine, t) for t in s.appended)) or tr("nothing")
    return (f'<div class="ne-so-step" data-step="{s.step}" data-allowed="{s.num_allowed}" style="font-size:12px;'
            f'line-height:1.7">'
            + tr("<b>engine step {step}</b>: {allowed:,} of {vocab:,} tokens allowed", step=s.step,
                 allowed=s.num_allowed, vocab=s.vocab_size)
            + f'{forced}{overruled}<div>'
            + tr("before the mask: {chips}", chips=_chips(engine, s.top_before, s.token, allowed)) + '</div><div>'
            + tr("after the mask: {chips}", chips=_chips(engine, s.top_after, s.token, None)) + '</div><div>'
            + tr("appended: {tokens}", tokens=appended) + f'</div>{done}</div>')


def render_history(c: StructuredOutputStepperController) -> str:
    """Every step so far as a row: allowed tokens, forced, overruled, the token taken."""
    rows = "".join(
        f'<tr class="ne-so-row"><td>{s.step}</td><td>{s.num_allowed:,}</td><td>{tr("yes") if s.forced else ""}</td>'
        f'<td>{tr("yes") if s.overruled else ""}</td>'
        f'<td style="font-family:monospace">{escape(" ".join(token_label(c.engine, t) for t in s.appended))}</td></tr>'
        for s in c.steps)
    return ('<table class="ne-so-history" style="font-size:12px">'
            + tr('<tr><th>step</th><th>allowed</th><th>forced</th><th>overruled</th><th>token</th></tr>')
            + f'{rows}</table><div style="font-size:12px">'
            + tr("output so far: <code>{text}</code> · forced {forced} · overruled {overruled} of {steps} steps",
                 text=escape(c.text), forced=c.num_forced, overruled=c.num_overruled, steps=len(c.steps))
            + '</div>')


class StructuredOutputStepper(ControllerView, W.VBox):
    """Step / Run to end / Reset over one constrained request: the last step's mask, and every step."""

    def __init__(self, engine: LLMEngine | None = None, prompt: str | list[int] | None = None,
                 constraint: StructuredOutputsParams | None = None, max_tokens: int = 48,
                 controller: StructuredOutputStepperController | None = None, shared_with: str | None = None,
                 **controller_kwargs) -> None:
        if controller is None:
            if prompt is None or constraint is None:
                raise ValueError("give a prompt and a constraint, e.g. StructuredOutputsParams(json=EXAMPLE_SCHEMA)")
            controller = StructuredOutputStepperController(engine, prompt, constraint, max_tokens,
                                                           **controller_kwargs)
        self.controller = controller
        show = self.show_message
        self.message = W.HTML()
        self.shared_note = W.HTML(shared_engine_note(shared_with))
        self.step_button = W.Button(description=tr("Step"), button_style="primary")
        self.run_button = W.Button(description=tr("Run to end"))
        self.reset_button = W.Button(description=tr("Reset"), button_style="warning")
        self.max_tokens = W.BoundedIntText(value=controller.params.max_tokens, min=-10**7, max=10**7,
                                           description=tr("max tokens"), layout=W.Layout(width="170px"))
        self.status = W.HTML()
        self.last_step = W.HTML()
        self.history = W.HTML()
        for widget, name in ((self.step_button, "step"), (self.run_button, "run"), (self.reset_button, "reset")):
            widget.add_class(f"ne-so-{name}")

        @guarded(show)
        def on_step(_):
            record = controller.step()
            self.refresh(tr("step {step}: {allowed:,} tokens allowed", step=record.step, allowed=record.num_allowed),
                         "ok")

        @guarded(show)
        def on_run(_):
            records = controller.run_to_end()
            self.refresh(tr("ran {n} steps; {forced} forced", n=len(records), forced=controller.num_forced), "ok")

        @guarded(show)
        def on_reset(_):
            self.refresh(tr("new request {rid}", rid=controller.reset(max_tokens=self.max_tokens.value)), "ok")

        self.step_button.on_click(on_step)
        self.run_button.on_click(on_run)
        self.reset_button.on_click(on_reset)
        super().__init__([self.shared_note, W.HBox([self.step_button, self.run_button, self.reset_button,
                                                    self.max_tokens]),
                          self.status, self.message, W.HTML(tr("<b>Last step: the mask over the vocabulary</b>")),
                          self.last_step, W.HTML(tr("<b>Every step</b>")), self.history])
        self.add_class("ne-structured-output-stepper")
        self.watcher = EngineWatcher(controller.engine, self.refresh)
        self.refresh()

    def close(self) -> None:
        if getattr(self, "controller", None) is None:
            W.VBox.close(self)
            return
        super().close()

    def refresh(self, text: str | None = None, kind: str = "info") -> None:
        c = self.controller
        for button in (self.step_button, self.run_button):
            button.disabled = c.finished
        constraint = c.params.structured_outputs
        self.status.value = ('<div style="font-size:13px">'
                             + tr("request <b>{rid}</b> · constraint <b>{kind}</b> <code>{spec}</code> · max tokens "
                                  "{max_tokens}", rid=escape(c.request_id), kind=escape(constraint.kind),
                                  spec=escape(str(constraint.spec)[:120]), max_tokens=c.params.max_tokens)
                             + '</div>')
        self.last_step.value = render_step(c)
        self.history.value = render_history(c)
        if text is not None:
            self.show_message(text, kind)
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.drawn()
