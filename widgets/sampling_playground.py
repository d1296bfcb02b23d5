"""The sampling playground: real next-token logits through the engine's own filters (chapter 8).

The model runs once per prompt (``engine.next_token_logits``); every slider move then
re-runs only the filters, and those are the engine's functions, imported, not copied:
``nanoengine.layers.sampler.filter_logits`` (which calls ``kept_mask``). One call with a
4-row batch gives every stage at once, because the engine applies the filters in order
and each row switches on one more of them::

    row 0: temperature only          (top_k=-1, top_p=1, min_p=0)
    row 1: + top-k                   (top_p=1, min_p=0)
    row 2: + top-k + top-p           (min_p=0)
    row 3: + top-k + top-p + min-p   = exactly what the engine samples from

A token missing from row r but present in row r-1 was cut by stage r (temperature alone
never cuts: row 0 keeps the whole vocabulary).

"Sample N times" draws N tokens from the engine-filtered probabilities: by default with
one seeded generator (fast); ticked "as N seeded requests", draw i is exactly the first
token a request with seed ``seed + i`` gets from the engine's ``Sampler`` (a test checks
it). "Generate" sends a real request with the chosen settings through
``engine.add_request`` and ``engine.step``, stepping the engine until that request
finishes. On an engine that other simulators share, those steps also advance their
requests: pass ``shared_with`` and the view says so, and the message after Generate counts
the other requests it advanced.

``SamplingPlaygroundController`` is the testable part; ``SamplingPlayground`` draws it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
from dataclasses import dataclass

import ipywidgets as W
import torch

from nanoengine import LLMEngine, RequestOutput, SamplingParams
from nanoengine.layers.sampler import Sampler, filter_logits
from translations import tr
from widgets._common import MessageView, chart_fonts, check_int, escape, guarded, shared_engine_note, single_thread, token_label

STAGES = ("model (T=1)", "temperature", "top-k", "top-p", "min-p")
_CUT_NAMES = {0: "temperature", 1: "top-k", 2: "top-p", 3: "min-p"}


def _stage_label(name: str) -> str:
    """A stage's or a cut's name as the reader sees it (the name itself stays the data)."""
    return {"model (T=1)": tr("model (T=1)"), "temperature": tr("temperature"), "greedy": tr("greedy")}.get(name, name)


TOP_P_STEP = 0.01  # the top-p slider's step and its lowest value (top_p must be above 0)


@dataclass(frozen=True)
class StageSummary:
    name: str
    num_kept: int  # tokens with non-zero probability after this stage
    entropy_bits: float  # of the renormalised distribution after this stage
    top_probability: float


@dataclass(frozen=True)
class TokenRow:
    rank: int  # by logit (the same order at any temperature > 0)
    token_id: int
    label: str
    p_model: float  # softmax of the raw logits (temperature 1, no filter)
    p_temperature: float  # after temperature only
    p_final: float  # after every filter: what the engine samples from
    cut_by: str | None  # the stage that removed it, None if it survives


@dataclass(frozen=True)
class Distribution:
    params: SamplingParams
    rows: tuple[TokenRow, ...]
    stages: tuple[StageSummary, ...]

    @property
    def kept_rows(self) -> tuple[TokenRow, ...]:
        return tuple(r for r in self.rows if r.cut_by is None)


def entropy_bits(probs: torch.Tensor) -> float:
    """Shannon entropy in bits of a probability vector (zeros contribute nothing)."""
    return float(torch.special.entr(probs.double()).sum() / math.log(2))


class SamplingPlaygroundController:
    """Logits once per prompt; filters, samples and generation through the engine's code."""

    def __init__(self, engine: LLMEngine, prompt: str | list[int] | None = None, top_n: int = 15) -> None:
        self.engine = engine
        self.top_n = check_int(tr("top N"), top_n, 1, 200)
        self.params = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, max_tokens=24)
        self.prompt: str | list[int] | None = None
        self.logits: torch.Tensor | None = None  # (vocab,) float32
        self.num_logit_computations = 0
        self._logit_cache: collections.OrderedDict[object, torch.Tensor] = collections.OrderedDict()
        self._distribution: Distribution | None = None
        if prompt is not None:
            self.set_prompt(prompt)

    # --------------------------------------------------------------- inputs
    def set_prompt(self, prompt: str | list[int]) -> None:
        """Run the model once for ``prompt`` (cached: a prompt seen before costs nothing)."""
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        logits = self._logit_cache.get(key)
        if logits is None:
            logits = self.engine.next_token_logits(prompt).float().cpu()  # (vocab,) raises before any change
            self.num_logit_computations += 1
            self._logit_cache[key] = logits
            while len(self._logit_cache) > 16:
                self._logit_cache.popitem(last=False)
        self.prompt, self.logits = prompt, logits
        self._distribution = None

    def set_params(self, **changes) -> SamplingParams:
        """Change sampling values; SamplingParams validates them (the engine's own checks)."""
        unknown = set(changes) - {"temperature", "top_k", "top_p", "min_p", "max_tokens"}
        if unknown:
            raise ValueError(tr("unknown sampling control(s) {names}", names=sorted(unknown)))
        params = dataclasses.replace(self.params, **changes)  # raises ValueError on a bad value
        if params != self.params:
            self.params, self._distribution = params, None
        return params

    def set_top_n(self, top_n: int) -> None:
        self.top_n = check_int(tr("top N"), top_n, 1, 200)
        self._distribution = None

    # ------------------------------------------------------------ computing
    def _require_logits(self) -> torch.Tensor:
        if self.logits is None:
            raise ValueError(tr("no prompt yet: set a prompt first"))
        return self.logits

    def stages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, kept), each (5, vocab): the model's distribution, then after each stage.

        ``kept`` comes from the filter itself (a finite filtered logit), not from p > 0,
        so a kept token whose probability underflows at a low temperature still counts.
        """
        logits = self._require_logits()
        p = self.params
        vocab = logits.shape[0]
        with single_thread():
            model = torch.softmax(logits, dim=-1)  # (V,)
            if p.greedy:  # the engine takes the argmax and skips every filter
                onehot = torch.zeros_like(model)
                onehot[int(logits.argmax())] = 1.0
                probs = torch.stack([model, onehot, onehot, onehot, onehot])  # (5, V)
                kept = probs > 0
                kept[0] = True  # the model's own distribution keeps every token
                return probs, kept
            rows = filter_logits(logits[None].expand(4, vocab), [p.temperature] * 4,  # (4, V)
                                 [-1, p.top_k, p.top_k, p.top_k], [1.0, 1.0, p.top_p, p.top_p],
                                 [0.0, 0.0, 0.0, p.min_p])
            probs = torch.cat([model[None], torch.softmax(rows, dim=-1)])  # (5, V)
            kept = torch.cat([torch.ones(1, vocab, dtype=torch.bool), torch.isfinite(rows)])  # (5, V)
            return probs, kept

    def final_probs(self) -> torch.Tensor:
        """What the engine samples from with the current settings. (vocab,)"""
        return self.stages()[0][-1]

    def distribution(self) -> Distribution:
        if self._distribution is not None:
            return self._distribution
        logits = self._require_logits()
        probs, kept = self.stages()  # (5, V) each
        with single_thread():
            stages = tuple(StageSummary(name, int(kept[i].sum()), entropy_bits(probs[i]), float(probs[i].max()))
                           for i, name in enumerate(STAGES))
            top = logits.topk(min(self.top_n, logits.shape[0])).indices.tolist()
            rows = []
            for rank, t in enumerate(top):
                cut = None
                if self.params.greedy:
                    cut = None if kept[-1, t] else "greedy"
                else:
                    for stage in range(1, 5):
                        if not kept[stage, t]:
                            cut = _CUT_NAMES[stage - 1]
                            break
                rows.append(TokenRow(rank, t, token_label(self.engine, t), float(probs[0, t]), float(probs[1, t]),
                                     float(probs[-1, t]), cut))
        self._distribution = Distribution(self.params, tuple(rows), stages)
        return self._distribution

    def sample(self, n: int, seed: int = 0, per_request: bool = False) -> list[int]:
        """``n`` tokens drawn from the engine-filtered distribution, reproducibly.

        Default: one generator seeded ``seed`` draws all ``n`` (independent draws, fast).
        ``per_request=True``: the first token each of ``n`` requests seeded ``seed``,
        ``seed+1``, ... would get from the engine, drawn exactly as the engine's sampler
        draws it: by the engine's ``Sampler`` itself, one generator per request.
        """
        n = check_int(tr("samples"), n, 1, 1_000_000)
        seed = check_int(tr("seed"), seed, 0, 2**63 - 1 - n)
        probs = self.final_probs()
        if self.params.greedy:
            return [int(probs.argmax())] * n
        with single_thread():
            if not per_request:
                generator = torch.Generator().manual_seed(seed)
                return torch.multinomial(probs, n, replacement=True, generator=generator).tolist()
            sampler, row = Sampler(), self.logits[None].float()  # the engine's own sampler, so the same draw
            return [sampler(row, [self.params], [torch.Generator().manual_seed(seed + i)]).token_ids[0]
                    for i in range(n)]  # the engine seeds request i's generator like this

    def histogram(self, n: int, seed: int = 0, per_request: bool = False) -> list[tuple[int, int]]:
        """(token id, count) of ``sample(n, seed, per_request)``, most frequent first."""
        return collections.Counter(self.sample(n, seed, per_request)).most_common()

    def generate(self, max_tokens: int, seed: int | None = None, max_steps: int = 10_000) -> RequestOutput:
        """Generate a continuation of the prompt through the engine with the chosen settings.

        Other unfinished requests on the same engine advance too (it is one engine).
        """
        if self.prompt is None:
            raise ValueError(tr("no prompt yet: set a prompt first"))
        params = dataclasses.replace(self.params, max_tokens=check_int(tr("max tokens"), max_tokens, 1), seed=seed)
        request_id = self.engine.add_request(self.prompt, params)
        final = None
        for _ in range(max_steps):
            for output in self.engine.step():
                if output.request_id == request_id and output.finished:
                    final = output
            if final is not None:
                return final
        self.engine.abort(request_id)
        raise RuntimeError(tr("generation did not finish in {max_steps} steps; aborted", max_steps=max_steps))


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


BAR_PX = 180  # width of the probability bars in the distribution table


def render_distribution(dist: Distribution) -> str:
    """The top-N tokens: a grey bar for the model's probability, a coloured one for the
    probability after every filter; cut tokens struck through with the stage that cut them.

    HTML bars rather than a matplotlib PNG: a slider move must redraw in under 200 ms,
    and rendering a PNG alone takes ~150 ms on a small CPU; this string takes ~1 ms.
    """
    scale = max(max((max(r.p_model, r.p_temperature, r.p_final) for r in dist.rows), default=1.0), 1e-12)
    rows = []
    for r in dist.rows:
        cut = r.cut_by is not None
        style = "text-decoration:line-through;color:#999" if cut else ""
        bar = (f'<div style="position:relative;width:{BAR_PX}px;height:14px;background:#fafafa">'
               f'<div title="{tr("model p={p:.4f}", p=r.p_model)}" style="position:absolute;top:0;height:4px;'
               f'width:{BAR_PX * r.p_model / scale:.1f}px;background:#bbb"></div>'
               f'<div title="{tr("after temperature p={p:.4f}", p=r.p_temperature)}" style="position:absolute;top:4px;'
               f'height:4px;width:{BAR_PX * r.p_temperature / scale:.1f}px;background:#9ecae1"></div>'
               f'<div title="{tr("final p={p:.4f}", p=r.p_final)}" style="position:absolute;top:8px;height:6px;'
               f'width:{BAR_PX * r.p_final / scale:.1f}px;background:{"#e57373" if cut else "#2b7bba"}"></div></div>')
        rows.append(f'<tr class="ne-token{" ne-cut" if cut else ""}" data-token="{r.token_id}">'
                    f'<td>{r.rank + 1}</td><td style="font-family:monospace;{style}">{escape(r.label)}</td>'
                    f'<td>{r.p_model:.3f}</td><td>{r.p_temperature:.3f}</td><td><b>{r.p_final:.3f}</b></td>'
                    f'<td>{bar}</td><td style="color:#c62828">{escape(_stage_label(r.cut_by or ""))}</td></tr>')
    p = dist.params
    head = (f'<div class="ne-dist-params" style="font-size:12px">T={p.temperature:g} · top-k={p.top_k} · '
            f'top-p={p.top_p:g} · min-p={p.min_p:g}'
            f'{tr(" · greedy (argmax, filters skipped)") if p.greedy else ""}</div>')
    # line-height set here: a widget's HTML inherits JupyterLab's 28 px control height otherwise
    return (head + '<table class="ne-dist" cellpadding="2" style="font-size:12px;line-height:1.25;'
            'border-collapse:collapse">'
            + tr('<tr><th>#</th><th>token</th><th>model p</th><th>after T</th><th>final p</th>'
               '<th>grey: model<br>blue: after T · dark: final</th><th>cut by</th></tr>') + "".join(rows) + "</table>")


def render_stages(dist: Distribution) -> str:
    cells = "".join(f'<td class="ne-stage" data-stage="{escape(s.name)}">{escape(_stage_label(s.name))}<br>'
                    + tr('<b>{kept:,}</b> tokens<br>H = <b class="ne-entropy">{bits:.2f}</b> bits<br>'
                         'max p {top:.3f}', kept=s.num_kept, bits=s.entropy_bits, top=s.top_probability)
                    + '</td>' for s in dist.stages)
    return ('<table class="ne-stages" border="1" cellpadding="3" style="font-size:12px;line-height:1.3;'
            'border-collapse:collapse">'
            f'<tr>{cells}</tr></table>')


def render_histogram_png(engine: LLMEngine, counts: list[tuple[int, int]], n: int, seed: int,
                         probs: torch.Tensor, top: int = 20) -> bytes:
    """A bar chart of sample counts next to the expected counts, as PNG bytes."""
    import matplotlib
    from matplotlib.figure import Figure  # a bare Figure needs no backend: the notebook's stays as it is

    with matplotlib.rc_context(chart_fonts()):
        return _histogram_png(Figure, engine, counts, n, seed, probs, top)


def _histogram_png(Figure, engine: LLMEngine, counts: list[tuple[int, int]], n: int, seed: int,
                   probs: torch.Tensor, top: int) -> bytes:
    shown = counts[:top]
    labels = [token_label(engine, t) for t, _ in shown]
    fig = Figure(figsize=(5.4, 2.6), dpi=80)  # 432 x 208 px: beside the distribution, not under it
    ax = fig.add_subplot()
    xs = range(len(shown))
    ax.bar(xs, [c for _, c in shown], color="#2b7bba", label=tr("{n} seeded samples", n=n))
    ax.plot(xs, [float(probs[t]) * n for t, _ in shown], "k_", markersize=14, label=tr("expected (n × p)"))
    ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(tr("count"))
    ax.set_title(tr("{n} samples from seed {seed}: {distinct} distinct tokens", n=n, seed=seed, distinct=len(counts)),
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------


class SamplingPlayground(MessageView, W.VBox):
    """Prompt, four sliders, the staged distribution, a seeded histogram and generation.

    Laid out so the sliders and every result they drive fit on one screen: the controls
    on top, the distribution on the left, sampling and generation (controls right above
    their results) on the right. ``shared_with`` names another simulator that drives the
    same engine; the view then says so.
    """

    def __init__(self, engine: LLMEngine | None = None, prompt: str | list[int] | None = "The capital of France is",
                 controller: SamplingPlaygroundController | None = None, top_n: int = 15,
                 shared_with: str | None = None) -> None:
        self.message = W.HTML()
        self.shared_note = W.HTML(shared_engine_note(shared_with))
        self.shared_with = shared_with
        show = self.show_message
        if controller is None:
            if engine is None:
                raise ValueError("give an engine or a controller")
            controller = SamplingPlaygroundController(engine, top_n=top_n)
        self.controller = controller
        text_prompt = isinstance(prompt, str) or prompt is None
        self.prompt = W.Text(value=prompt if isinstance(prompt, str) else "", description=tr("prompt"),
                             continuous_update=False, layout=W.Layout(width="520px"), disabled=not text_prompt)
        self.prompt_button = W.Button(description=tr("Compute logits"))
        p = controller.params
        slider = dict(continuous_update=True, layout=W.Layout(width="400px"), style={"description_width": "100px"})
        self.temperature = W.FloatSlider(value=p.temperature, min=0.0, max=2.0, step=0.05, description=tr("temperature"),
                                         **slider)
        self.top_k = W.IntSlider(value=p.top_k, min=-1, max=100, step=1, description=tr("top-k (-1 off)"), **slider)
        # Every slider stays inside what SamplingParams accepts: top_p is in (0, 1], so its lowest stop is
        # one step above 0 (a slider at 0.00 would only ever show the engine's refusal).
        self.top_p = W.FloatSlider(value=p.top_p, min=TOP_P_STEP, max=1.0, step=TOP_P_STEP, description="top-p",
                                   **slider)
        self.min_p = W.FloatSlider(value=p.min_p, min=0.0, max=1.0, step=0.01, description="min-p", **slider)
        self.top_n = W.IntSlider(value=controller.top_n, min=5, max=40, description=tr("show top N"), **slider)
        self.stages = W.HTML()
        self.dist = W.HTML()
        short = {"description_width": "40px"}
        self.num_samples = W.BoundedIntText(value=1000, min=0, max=100_000, description="N", style=short,
                                            layout=W.Layout(width="120px"))
        self.sample_seed = W.BoundedIntText(value=0, min=0, max=2**62, description=tr("seed"), style=short,
                                            layout=W.Layout(width="150px"))
        self.per_request = W.Checkbox(value=False, indent=False, layout=W.Layout(width="auto"),
                                      description=tr("as N seeded requests (the engine's exact draws, ~3 ms each)"))
        self.sample_button = W.Button(description=tr("Sample N times"), layout=W.Layout(width="auto"))
        self.histogram = W.Image(format="png", layout=W.Layout(width="432px", display="none"))  # until sampled
        self.histogram_text = W.HTML()
        self.gen_tokens = W.BoundedIntText(value=24, min=0, max=100_000, description=tr("max tokens"),
                                           style={"description_width": "80px"}, layout=W.Layout(width="165px"))
        self.gen_seed = W.BoundedIntText(value=0, min=-1, max=2**62, description=tr("seed (-1 none)"),
                                         style={"description_width": "95px"}, layout=W.Layout(width="200px"))
        self.gen_button = W.Button(description=tr("Generate"), button_style="primary")
        self.generation = W.HTML()
        for widget, name in ((self.temperature, "temperature"), (self.top_k, "top-k"), (self.top_p, "top-p"),
                             (self.min_p, "min-p"), (self.dist, "dist"), (self.stages, "stages"),
                             (self.sample_button, "sample"), (self.gen_button, "generate"),
                             (self.histogram, "histogram"), (self.generation, "generation")):
            widget.add_class(f"ne-sampling-{name}")

        @guarded(show)
        def on_prompt(_=None):
            controller.set_prompt(self.prompt.value)
            self.redraw()
            self.show_message(tr("logits computed for a {n}-token prompt ({calls} model call(s) so far)",
                                 n=len(controller.engine.tokenize_prompt(self.prompt.value)[1]),
                                 calls=controller.num_logit_computations), "ok")

        @guarded(show)
        def on_slider(_=None):
            controller.set_params(temperature=float(self.temperature.value), top_k=int(self.top_k.value),
                                  top_p=float(self.top_p.value), min_p=float(self.min_p.value))
            controller.set_top_n(self.top_n.value)
            self.redraw()
            self.show_message("")

        @guarded(show)
        def on_sample(_):
            seed = self.sample_seed.value
            counts = controller.histogram(self.num_samples.value, seed, self.per_request.value)
            n = self.num_samples.value
            self.histogram.value = render_histogram_png(controller.engine, counts, n, seed, controller.final_probs())
            self.histogram.layout.display = None
            top = ", ".join(f"{escape(token_label(controller.engine, t))}: {c}" for t, c in counts[:8])
            how = (tr("seeds {first}..{last}, one per request", first=seed, last=seed + n - 1) if self.per_request.value
                   else tr("seed {seed}", seed=seed))
            self.histogram_text.value = ('<div class="ne-hist-text" style="font-size:12px">'
                                         + tr("{n} samples ({how}): {top}", n=n, how=how, top=top) + '</div>')

        @guarded(show)
        def on_generate(_):
            seed = self.gen_seed.value
            before = controller.engine.snapshot()
            others = {r.request_id for r in (*before.running, *before.waiting)}
            out = controller.generate(self.gen_tokens.value, None if seed == -1 else seed)
            after = controller.engine.snapshot()
            still = {r.request_id for r in (*after.running, *after.waiting)}
            prompt_text = controller.prompt if isinstance(controller.prompt, str) else ""
            self.generation.value = (f'<div class="ne-gen" style="font-size:13px"><span style="color:#777">'
                                     f'{escape(prompt_text)}</span><b>{escape(out.text)}</b><br><small>'
                                     + tr("{n} tokens, finish reason: {reason}", n=len(out.token_ids),
                                          reason=out.finish_reason) + '</small></div>')
            ran = tr("generated request {rid} through the engine in {steps} engine steps", rid=out.request_id,
                     steps=after.step - before.step)
            if others:
                where = tr(" (the {other})", other=self.shared_with) if self.shared_with else ""
                ran += tr("; the same steps advanced {n} other request(s) on this engine{where}, {done} of which "
                          "finished", n=len(others), where=where, done=len(others - still))
            self.show_message(ran, "ok")

        self.prompt.observe(on_prompt, names="value")
        self.prompt_button.on_click(on_prompt)
        for s in (self.temperature, self.top_k, self.top_p, self.min_p, self.top_n):
            s.observe(on_slider, names="value")
        self.sample_button.on_click(on_sample)
        self.gen_button.on_click(on_generate)
        left = W.VBox([W.HTML(tr("<b>Each stage of the engine's filter</b> (kept tokens, entropy)")), self.stages,
                       W.HTML(tr("<b>Top tokens before and after the filters</b>")), self.dist])
        right = W.VBox([W.HTML(tr("<b>Sample N times</b> from what the engine samples from")),
                        W.HBox([self.num_samples, self.sample_seed, self.sample_button]), self.per_request,
                        self.histogram_text, self.histogram,
                        W.HTML(tr("<b>Generate</b> a continuation through the engine")),
                        W.HBox([self.gen_tokens, self.gen_seed]), self.gen_button, self.generation],
                       layout=W.Layout(width="440px", margin="0 0 0 16px"))
        super().__init__([
            self.shared_note, W.HBox([self.prompt, self.prompt_button]), self.message,
            W.HBox([W.VBox([self.temperature, self.top_k, self.top_n]), W.VBox([self.top_p, self.min_p])]),
            W.HBox([left, right], layout=W.Layout(flex_flow="row wrap"))])
        self.add_class("ne-sampling-playground")
        if prompt is not None and controller.logits is None:
            if text_prompt:
                on_prompt()
            else:
                guarded(show)(controller.set_prompt)(prompt)
        self.redraw()

    def redraw(self) -> None:
        if self.controller.logits is None:
            self.dist.value = '<div style="color:#888">' + tr("no logits yet: set a prompt") + '</div>'
            return
        dist = self.controller.distribution()
        self.stages.value = render_stages(dist)
        self.dist.value = render_distribution(dist)
