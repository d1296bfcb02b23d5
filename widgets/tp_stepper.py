"""Tensor-parallel stepper: one real MLP layer split over N ranks, one stage at a time (chapter 9).

The controller takes a decoder layer of the live engine's model (one process) and a prompt,
and splits the layer's MLP the way a tensor-parallel engine does (Megatron-LM's layout, the
one ``nanoengine/layers/linear.py`` implements): gate and up column-parallel, down
row-parallel, one all-reduce at the end. It then walks the forward pass in five stages, each
computed on the real weights and the prompt's real hidden states:

    0  input       every rank holds the same hidden states x (T, H)
    1  shards      rank r holds rows r*k..(r+1)*k of gate and up, columns r*k..(r+1)*k of down
    2  local       rank r computes silu(x gate_r^T) * (x up_r^T): (T, k), no communication
    3  partials    rank r multiplies by its columns of down: a full-width (T, H) partial sum
    4  all-reduce  the partials are added; the sum equals the unsplit MLP's output

For every stage ``describe()`` says what each rank holds (shapes, bytes, a sample of values)
and what crossed between ranks, so a learner can step, change the rank count or the layer,
and watch the partial sums, which look nothing like the output, add up to it. A rank count
must divide the MLP width (``intermediate_size``), as the engine requires; anything else is
refused with a message and leaves the stepper as it was.

The view (``TPStepper``) is a thin ipywidgets shell: Back / Step / Reset, a rank-count
dropdown, a layer slider. It never steps the engine or touches its KV cache: it reads the
model's weights and runs pieces of one layer's forward pass itself, so whatever the cells after
it do to the engine, it stays usable after Run All.
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import torch
import torch.nn.functional as F

from nanoengine import LLM, LLMEngine
from translations import tr
from widgets._common import MessageView, check_int, escape, format_bytes, guarded

STAGES = ("input", "shards", "local", "partials", "all-reduce")
def _stage_label(name: str) -> str:
    """A stage's name as the reader sees it (``STAGES`` stays the data)."""
    return {"input": tr("input"), "shards": tr("shards"), "local": tr("local"), "partials": tr("partials"),
            "all-reduce": "all-reduce"}[name]


SAMPLE = 12  # values of each rank's tensor shown per stage


@dataclass(frozen=True)
class RankView:
    """What one rank holds at a stage."""

    rank: int
    holds: str  # a sentence: which slices / tensors
    shape: tuple[int, ...]
    num_bytes: int
    sample: tuple[float, ...]  # the first SAMPLE values of the last token's row


@dataclass(frozen=True)
class StageView:
    """One stage of the split forward pass, computed on the real layer."""

    index: int
    name: str
    ranks: tuple[RankView, ...]
    communication: str  # what crossed between ranks at this stage ("nothing" or the all-reduce)
    bytes_sent: int  # bytes each rank contributed to a collective at this stage
    verdict: str  # a check computed at this stage (e.g. the sum equals the unsplit output)


class TPStepperController:
    """The split MLP of one decoder layer over ``tp`` ranks, stage by stage."""

    def __init__(self, llm_or_engine, prompt: str = "Tensor parallelism splits every weight matrix.",
                 layer: int = 0, tp: int = 3) -> None:
        engine = llm_or_engine.engine if isinstance(llm_or_engine, LLM) else llm_or_engine
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"pass the chapter's LLM or its engine, got {type(llm_or_engine).__name__}")
        model = getattr(engine.runner, "model", None)
        if model is None:
            raise ValueError("the stepper needs a one-process engine (tensor_parallel_size=1): it splits the "
                             "layer itself")
        self.engine, self.model = engine, model
        self.num_layers = len(model.model.layers)
        self.intermediate = model.model.layers[0].mlp.down_proj.weight.shape[1]
        self.hidden = model.model.layers[0].mlp.down_proj.weight.shape[0]
        ids = engine.tokenize_prompt(prompt)[1]
        if not ids:
            raise ValueError(tr("the prompt is empty: type at least one word"))
        self.prompt = prompt
        self._ids = torch.tensor(ids, device=model.model.embed_tokens.weight.device)
        self.layer, self.tp, self.stage = 0, 1, 0
        self.configure(layer=layer, tp=tp)

    # ------------------------------------------------------------ settings
    def allowed_tp(self) -> list[int]:
        """Rank counts that split the MLP width into equal whole shares (at most 16)."""
        return [n for n in range(1, 17) if self.intermediate % n == 0]

    def configure(self, layer: int | None = None, tp: int | None = None) -> None:
        """Choose the layer and the rank count; the stepper goes back to stage 0. A bad value
        raises ValueError and changes nothing."""
        new_layer = self.layer if layer is None else check_int(tr("layer"), layer, 0, self.num_layers - 1)
        new_tp = self.tp if tp is None else check_int(tr("ranks"), tp, 1, 16)
        if self.intermediate % new_tp:
            raise ValueError(tr("{tp} ranks do not divide the MLP width {width} into equal shares; allowed: {allowed}",
                                tp=new_tp, width=self.intermediate, allowed=self.allowed_tp()))
        self.layer, self.tp, self.stage = new_layer, new_tp, 0
        self._compute()

    def _compute(self) -> None:
        mlp = self.model.model.layers[self.layer].mlp
        gate, up = mlp.gate_up_proj.weight.split(self.intermediate, dim=0)  # (I, H) each
        down = mlp.down_proj.weight  # (H, I)
        k = self.intermediate // self.tp
        with torch.no_grad():
            embedded = self.model.model.embed_tokens(self._ids)
            x = self.model.model.layers[self.layer].post_attention_layernorm(embedded)  # (T, H), real inputs
            self.x = x.float()
            self.shards = [(gate[r * k:(r + 1) * k], up[r * k:(r + 1) * k], down[:, r * k:(r + 1) * k])
                           for r in range(self.tp)]
            self.local = [F.silu(x @ g.T) * (x @ u.T) for g, u, _ in self.shards]  # (T, k) each
            self.partials = [h @ d.T for h, (_, _, d) in zip(self.local, self.shards)]  # (T, H) each
            self.total = torch.stack(self.partials).sum(0)
            self.unsplit = mlp(x)

    # ------------------------------------------------------------ stepping
    def step(self) -> StageView:
        self.stage = min(self.stage + 1, len(STAGES) - 1)
        return self.describe()

    def back(self) -> StageView:
        self.stage = max(self.stage - 1, 0)
        return self.describe()

    def reset(self) -> StageView:
        self.stage = 0
        return self.describe()

    @property
    def finished(self) -> bool:
        return self.stage == len(STAGES) - 1

    # ------------------------------------------------------------ reading
    @staticmethod
    def _sample(t: torch.Tensor) -> tuple[float, ...]:
        return tuple(round(float(v), 3) for v in t[-1, :SAMPLE])

    def describe(self) -> StageView:
        """What every rank holds at the current stage, and what crossed between them."""
        k, itemsize = self.intermediate // self.tp, self.x.element_size()
        tokens = self.x.shape[0]
        ranks, communication, sent, verdict = [], tr("nothing: every rank works on what it holds"), 0, ""
        name = STAGES[self.stage]
        for r in range(self.tp):
            rows = f"{r * k}-{(r + 1) * k - 1}"
            if name == "input":
                view = RankView(r, tr("the full hidden states x of every token (a copy on each rank)"),
                                tuple(self.x.shape), self.x.numel() * itemsize, self._sample(self.x))
            elif name == "shards":
                g, u, d = self.shards[r]
                view = RankView(r, tr("gate and up rows {rows} ({k} of {width} features, each ({k}, {hidden})), "
                                      "down columns {rows} (({hidden}, {k}))", rows=rows, k=k, width=self.intermediate,
                                      hidden=self.hidden), tuple(g.shape),
                                (g.numel() + u.numel() + d.numel()) * itemsize,
                                tuple(round(float(v), 3) for v in g[0, :SAMPLE]))
            elif name == "local":
                h = self.local[r]
                view = RankView(r, tr("silu(gate) * up for its {k} features", k=k), tuple(h.shape), h.numel() * itemsize,
                                self._sample(h))
            else:
                p = self.total if name == "all-reduce" else self.partials[r]
                holds = (tr("the sum of all partials (every rank holds the same)") if name == "all-reduce" else
                         tr("a partial sum over features {rows}, full width", rows=rows))
                view = RankView(r, holds, tuple(p.shape), p.numel() * itemsize, self._sample(p))
            ranks.append(view)
        if name == "partials":
            alone = all(not torch.allclose(p, self.unsplit, atol=1e-3) for p in self.partials) if self.tp > 1 else False
            verdict = (tr("no partial equals the MLP's output on its own: {alone}", alone=alone) if self.tp > 1 else
                       tr("one rank: its partial is the whole output"))
        if name == "all-reduce":
            sent = tokens * self.hidden * itemsize
            ring = 2 * (self.tp - 1) / self.tp
            communication = tr("one all-reduce of a ({tokens}, {hidden}) tensor: each rank contributes {sent}; a ring "
                               "sends {ring:.2f} x that per rank", tokens=tokens, hidden=self.hidden,
                               sent=format_bytes(sent), ring=ring)
            verdict = tr("the all-reduced sum equals the unsplit MLP within 1e-4: {same}",
                         same=torch.allclose(self.total, self.unsplit.float(), atol=1e-4))
        return StageView(self.stage, name, tuple(ranks), communication, sent, verdict)


class TPStepper(MessageView, W.VBox):
    """Back / Step / Reset over ``TPStepperController``, with the rank count and layer as controls."""

    def __init__(self, llm_or_engine=None, controller: TPStepperController | None = None, **kwargs) -> None:
        self.message = W.HTML()
        if controller is None:
            if llm_or_engine is None:
                raise ValueError("give an LLM / engine or a controller")
            controller = TPStepperController(llm_or_engine, **kwargs)
        self.controller = controller
        self.back_button, self.step_button, self.reset_button = (W.Button(description=d) for d in
                                                                 (tr("Back"), tr("Step"), tr("Reset")))
        self.tp = W.Dropdown(options=controller.allowed_tp(), value=controller.tp, description=tr("ranks"))
        self.layer = W.IntSlider(value=controller.layer, min=0, max=controller.num_layers - 1,
                                 description=tr("layer"), continuous_update=False)
        self.header, self.table = W.HTML(), W.HTML()
        show = self.show_message
        self.back_button.on_click(guarded(show)(lambda _: self._redraw(controller.back())))
        self.step_button.on_click(guarded(show)(lambda _: self._redraw(controller.step())))
        self.reset_button.on_click(guarded(show)(lambda _: self._redraw(controller.reset())))
        self.tp.observe(guarded(show)(lambda ch: self._configure(tp=ch["new"])), names="value")
        self.layer.observe(guarded(show)(lambda ch: self._configure(layer=ch["new"])), names="value")
        super().__init__([W.HBox([self.back_button, self.step_button, self.reset_button, self.tp, self.layer]),
                          self.message, self.header, self.table])
        self._redraw(controller.describe())

    def _configure(self, **changes) -> None:
        self.controller.configure(**changes)
        self._redraw(self.controller.describe())

    def _redraw(self, view: StageView) -> None:
        self.show_message("")
        c = self.controller
        stages = " → ".join(f"<b>{escape(_stage_label(s))}</b>" if i == view.index else escape(_stage_label(s))
                            for i, s in enumerate(STAGES))
        self.header.value = ('<div style="font-size:13px">'
                             + tr("layer {layer}'s MLP over {tp} rank(s), prompt {prompt}: {stages}<br>communication: "
                                  "{communication}", layer=c.layer, tp=c.tp, prompt=escape(repr(c.prompt)),
                                  stages=stages, communication=escape(view.communication))
                             + (f"<br>{escape(view.verdict)}" if view.verdict else "") + "</div>")
        limit = max((abs(v) for r in view.ranks for v in r.sample), default=1.0) or 1.0

        def cell(v: float) -> str:
            a = min(abs(v) / limit, 1.0)
            colour = f"rgba(214,39,40,{a:.2f})" if v > 0 else f"rgba(31,119,180,{a:.2f})"
            return f'<td style="background:{colour};padding:2px 4px;font-size:11px">{v:+.2f}</td>'

        rows = "".join(f"<tr><td>{tr('rank {rank}', rank=r.rank)}</td><td>{escape(r.holds)}</td><td>{r.shape}</td>"
                       f"<td>{format_bytes(r.num_bytes)}</td>{''.join(cell(v) for v in r.sample)}</tr>"
                       for r in view.ranks)
        self.table.value = ('<table style="border-collapse:collapse;font-size:12px">'
                            + tr('<tr><th>rank</th><th>holds</th><th>shape</th><th>bytes</th><th colspan="{n}">first '
                                 '{n} values (last token; red > 0 > blue)</th></tr>', n=SAMPLE)
                            + f'{rows}</table>')
        self.back_button.disabled = view.index == 0
        self.step_button.disabled = view.index == len(STAGES) - 1


__all__ = ["STAGES", "RankView", "StageView", "TPStepper", "TPStepperController"]
