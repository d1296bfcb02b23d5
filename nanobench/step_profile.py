"""Where each engine spends its step, measured: ``bench --profile`` (chapter 11, issue #35).

Both engines run the same requests under PyTorch's profiler (``torch.profiler``, CPU
activity), this engine in the benchmark's process and vLLM in its runner process
(``vllm_runner.py``'s ``profile`` command). Every ``step()`` call of the engine object is
wrapped in a profiler range named ``STEP_RANGE``, so the profile says which operator ran
in which step, and each step's time is cut into five disjoint parts:

=============  ==============================================================================
``gemm``       matrix products: ``aten::mm``/``addmm``/``bmm``/``matmul``/``linear``, oneDNN's
               (``mkldnn::_linear_pointwise``, vLLM's ``_C::onednn_mm``), this engine's
               ``nanoengine::few_rows_linear``, any op whose name ends in ``mm`` or says
               ``linear``, ``matmul`` or ``gemm``
``attention``  attention and its KV-cache writes: any op whose name says ``attention`` or
               ``attn`` (``aten::scaled_dot_product_attention``,
               ``nanoengine::paged_decode_attention``, vLLM's ``vllm::unified_attention_with_output``
               with ``_C::cpu_attn_reshape_and_cache`` and ``_C::cpu_attention_with_kv_cache``
               inside), and for this engine everything inside its attention layers'
               ``forward`` (``ATTENTION_RANGES``: its prefill and KV store are PyTorch calls)
``sampling``   the whole sampling range of the step, its Python included: this engine's
               ``sample`` phase (``nanoengine/engine/profiler.py``) and vLLM's own
               ``gpu_model_runner: sample`` scope (``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``)
``other_ops``  every other operator's own time (norms, rotary embedding, activations,
               adds, copies, embedding lookups, Inductor's fused ``cpp_fused_*`` kernels)
``host``       the rest of the step's wall time: Python, scheduling, building the inputs,
               outputs and detokenization, and the profiler's own cost per operator
=============  ==============================================================================

The rule that keeps them disjoint: an event counts once, in the category of its outermost
categorised ancestor (itself included) within the step, with all its time; an
uncategorised operator counts only its own time (without its children's) as
``other_ops``; ranges that are no category (the engine's other phases, vLLM's other
scopes) count nothing themselves, their children are classified as usual; ``host`` is
what is left of the step. ``classify_step`` and ``summarize`` are pure functions over
``Span`` lists, tested on synthetic ones (``tests/measure/test_step_profile.py``).

Two things to read with the figures. The profiler costs a little per operator, on a
thread that also runs the step, so ``host`` is an upper bound and a profiled step is
slower than a timed one. And an operator's time is its wall time on the calling thread:
the OpenMP threads it fans out to are inside it, and work on other threads during the
step is reported apart (``other_threads_ms``), never subtracted from the step.

This module imports only the standard library at the top: the vLLM runner, executed by
``.venv-vllm``'s Python, which has torch but not nanoengine, imports it from beside itself.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable

CATEGORIES = ("gemm", "attention", "other_ops", "sampling", "host")
STEP_RANGE = "nanobench: step"
#: Ranges (``record_function`` names) whose whole time belongs to one category.
SAMPLING_RANGES = ("nanobench: nanoengine sample", "gpu_model_runner: sample")
ATTENTION_RANGES = ("nanobench: nanoengine attention",)
RANGE_CATEGORIES = {**dict.fromkeys(SAMPLING_RANGES, "sampling"), **dict.fromkeys(ATTENTION_RANGES, "attention")}
_ATTENTION = re.compile(r"attention|attn")
_GEMM = re.compile(r"mm$|^mm|matmul|linear|gemm")


@dataclass(frozen=True)
class Span:
    """One profiler event: an operator (``is_range=False``) or a ``record_function`` range,
    with its start and end in microseconds and the thread it ran on."""

    name: str
    start_us: float
    end_us: float
    thread: int = 0
    is_range: bool = False

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def op_category(name: str) -> str | None:
    """``"attention"``, ``"gemm"`` or None (another operator) for an operator's name.

    The name's last part (after ``::``) decides, so a namespace never does: ``_C::onednn_mm``
    is a GEMM, ``mkldnn::_linear_pointwise`` too, ``aten::softmax`` is neither. Attention
    is checked first (its kernels contain products of their own), and Inductor's fused
    kernels (``graph_0_cpp_fused_...``) are never GEMMs whatever ops their names list.
    """
    base = name.rsplit("::", 1)[-1].lower()
    if _ATTENTION.search(base):
        return "attention"
    if "cpp_fused" in base:
        return None
    return "gemm" if _GEMM.search(base) else None


def category_of(span: Span) -> str | None:
    """The category a span claims for its whole time, or None."""
    if span.is_range:
        return RANGE_CATEGORIES.get(span.name)
    return op_category(span.name)


def classify_step(step: Span, spans: Iterable[Span]) -> dict[str, float]:
    """One step's microseconds per category (``CATEGORIES``), plus ``step_us`` and
    ``other_threads_us`` (operators on other threads during the step, not in the sum).

    ``spans`` may hold anything the profiler saw; those inside the step on its thread are
    used. The categories add up to ``step_us`` exactly (``host`` is the remainder).
    """
    inside = sorted((s for s in spans if s is not step and s.start_us >= step.start_us and s.end_us <= step.end_us),
                    key=lambda s: (s.start_us, -s.end_us))
    totals = dict.fromkeys(CATEGORIES, 0.0)
    other_threads = sum(s.duration_us for s in inside if s.thread != step.thread and not s.is_range)
    # Nesting from the intervals: a span's parent is the innermost open span that contains it.
    children: dict[int, list[Span]] = {}
    roots: list[Span] = []
    open_spans: list[Span] = []
    for span in (s for s in inside if s.thread == step.thread):
        while open_spans and open_spans[-1].end_us <= span.start_us:
            open_spans.pop()
        if open_spans and open_spans[-1].end_us >= span.end_us:
            children.setdefault(id(open_spans[-1]), []).append(span)
        else:
            roots.append(span)
        open_spans.append(span)

    def visit(span: Span) -> None:
        category = category_of(span)
        kids = children.get(id(span), [])
        if category is not None:  # the outermost categorised event takes its whole time
            totals[category] += span.duration_us
            return
        if not span.is_range:
            totals["other_ops"] += max(0.0, span.duration_us - sum(k.duration_us for k in kids))
        for kid in kids:
            visit(kid)

    for root in roots:
        visit(root)
    totals["host"] = step.duration_us - sum(totals[c] for c in CATEGORIES if c != "host")
    return {**totals, "step_us": step.duration_us, "other_threads_us": other_threads}


def step_times(spans: list[Span]) -> list[dict[str, float]]:
    """``classify_step`` for every ``STEP_RANGE`` span, in order (nested steps are refused)."""
    steps = sorted((s for s in spans if s.is_range and s.name == STEP_RANGE), key=lambda s: s.start_us)
    for before, after in zip(steps, steps[1:]):
        if after.start_us < before.end_us:
            raise ValueError(f"step ranges overlap ({before.start_us}-{before.end_us} and {after.start_us}-"
                             f"{after.end_us}): one step() called another, or two threads stepped at once")
    others = [s for s in spans if not (s.is_range and s.name == STEP_RANGE)]
    return [classify_step(step, others) for step in steps]


def summarize(steps: list[dict[str, float]]) -> dict:
    """The figures of one profiled run: ``steps`` (those that ran the model: a step with no
    GEMM did not, e.g. the last call that finds nothing to schedule), ``idle_steps``,
    ``step_ms`` (``median`` and ``mean`` over the steps), per category ``median_ms`` (over
    the steps; medians of parts need not add up to the median step) and ``share`` (its
    time over all the steps' time: the shares add up to 1), and ``other_threads_ms`` (mean
    per step)."""
    busy = [s for s in steps if s["gemm"] > 0]
    if not busy:
        raise ValueError(f"no profiled step ran a matrix product ({len(steps)} steps seen): nothing to report")
    if not any(s["sampling"] for s in busy):
        raise ValueError(f"no sampling range ({' or '.join(SAMPLING_RANGES)}) in any of {len(busy)} steps: the "
                         f"sampler was not marked, so its operators would pass for other ones")
    wall = sum(s["step_us"] for s in busy)
    return {
        "steps": len(busy), "idle_steps": len(steps) - len(busy),
        "step_ms": {"median": statistics.median(s["step_us"] for s in busy) / 1e3, "mean": wall / len(busy) / 1e3},
        "categories": {c: {"median_ms": statistics.median(s[c] for s in busy) / 1e3,
                           "share": sum(s[c] for s in busy) / wall} for c in CATEGORIES},
        "other_threads_ms": sum(s["other_threads_us"] for s in busy) / len(busy) / 1e3,
    }


# ------------------------------------------------------------ the profiler itself
def spans_from_events(events) -> list[Span]:
    """``Span``s from ``torch.profiler.profile(...).events()`` (CPU events; asynchronous ones
    have no place in a thread's nesting and are left out)."""
    return [Span(e.name, e.time_range.start, e.time_range.end, e.thread, bool(e.is_user_annotation))
            for e in events if not e.is_async]


def profile_steps(engine, run: Callable[[], object]) -> tuple[list[dict[str, float]], object]:
    """Run ``run()`` under ``torch.profiler`` with each ``engine.step()`` call in a
    ``STEP_RANGE``; returns every step's ``classify_step`` and what ``run`` returned.

    ``engine`` is the object whose ``step`` the generate loop calls: this engine's
    ``LLMEngine`` (``llm.engine``) or vLLM's ``LLMEngine`` (``llm.llm_engine``, the model
    in the same process only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The wrapper is an
    attribute of that one object, removed afterwards.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    own = "step" in vars(engine)
    original = engine.step

    def step(*args, **kwargs):
        with record_function(STEP_RANGE):
            return original(*args, **kwargs)

    engine.step = step
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = run()
    finally:
        if own:
            engine.step = original
        else:
            del engine.step
    return step_times(spans_from_events(prof.events())), result


# ------------------------------------------------------------ this engine's side
def mark_engine(llm) -> Callable[[], None]:
    """Give this engine's sample phase and attention layers profiler ranges; returns the undo.

    The sampling range reuses the engine's own phase boundaries (``StepProfiler.phase``,
    ``nanoengine/engine/profiler.py``): its ``sample`` phase also opens
    ``SAMPLING_RANGES[0]``. Each attention layer's ``forward`` (its KV store, decode and
    prefill, which are PyTorch calls where no kernel of its own exists) runs in
    ``ATTENTION_RANGES[0]``, as vLLM's attention is one operator with its cache write
    inside. Only attributes of this engine's objects are set; nothing in nanoengine changes.
    """
    import contextlib

    from torch.profiler import record_function

    from nanoengine.layers.attention import Attention

    engine = llm.engine
    phases = engine.profiler
    engine_phase = phases.phase

    def phase(name: str):
        if name != "sample":
            return engine_phase(name)
        stack = contextlib.ExitStack()
        stack.enter_context(engine_phase(name))
        stack.enter_context(record_function(SAMPLING_RANGES[0]))
        return stack

    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"found no attention layer ({Attention.__qualname__}) in {type(engine.runner.model).__name__}")

    def ranged(forward):
        def forward_in_range(*args, **kwargs):
            with record_function(ATTENTION_RANGES[0]):
                return forward(*args, **kwargs)
        return forward_in_range

    phases.phase = phase
    for layer in layers:
        layer.forward = ranged(layer.forward)

    def undo() -> None:
        del phases.phase
        for layer in layers:
            del layer.forward

    return undo


def profile_engine(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """This engine on ``prompts`` (token ids, greedy, EOS ignored, ``output_lens`` tokens
    each, all submitted together): one run to warm up, then one under the profiler.
    Returns ``summarize``'s figures with ``output_tokens``."""
    from nanoengine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts, params)  # warm-up, not profiled
    llm.reset_prefix_cache()  # the profiled run computes its prompts, as the timed runs do
    undo = mark_engine(llm)
    try:
        steps, outputs = profile_steps(llm.engine, lambda: llm.generate(prompts, params))
    finally:
        undo()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != sum(output_lens):
        raise RuntimeError(f"the profiled run produced {produced} tokens, not the {sum(output_lens)} requested")
    return {**summarize(steps), "output_tokens": produced}


# ------------------------------------------------------------ the bench's profile
METHOD = ("torch.profiler (CPU activity) around one run of the requests after one warm-up run; each step() in a "
          "range; per step: GEMM, attention and sampling (outermost categorised event or range, whole time), other "
          "operators (own time), host (the rest of the step's wall time, the profiler's cost included); "
          "nanobench/step_profile.py")


def profile_bench(args, model_dir, prompts: list[list[int]], output_lens: list[int], dtype: str,
                  max_num_seqs: int, engine_kwargs: dict) -> dict:
    """``bench --profile``: the results file's ``profile`` section (``results/README.md``).

    Two batches of the bench's own requests: the first alone (batch 1), and all of them
    submitted together (the workload's batch). A fresh engine is built for it (the timed
    runs' engine is shut down by then) and, with ``--vs-vllm``, a vLLM runner of its own
    whose model runs in the runner's process (``VllmSettings(profile=True)``: the timed
    race keeps vLLM's default engine-core process, which a profiler in the runner could not
    see). For each batch the engine goes first, then vLLM; each warms up on the same
    requests before its profiled run.
    """
    from nanobench.benchmark import build_engine

    batches = [([prompts[0]], [output_lens[0]])] + ([(prompts, output_lens)] if len(prompts) > 1 else [])
    peer = None
    if getattr(args, "vs_vllm", False):
        from nanobench.vllm_peer import start_peer

        peer = start_peer(args, model_dir, prompts, output_lens, dtype, max_num_seqs, profile=True,
                          label="vLLM for the profile (model in the runner's process)")
    section: dict = {"method": METHOD, "rows": []}
    try:
        llm = build_engine(model_dir, **engine_kwargs)
        try:
            for batch_prompts, batch_lens in batches:
                shape = {"batch": len(batch_prompts), "prompt_tokens": sum(len(p) for p in batch_prompts)}
                section["rows"].append({"system": "nanoengine", **shape,
                                        **profile_engine(llm, batch_prompts, batch_lens)})
                print(table(section["rows"][-1:], header=not section["rows"][:-1]))
                if peer is not None:
                    answer = peer.profile(batch_prompts, batch_lens)
                    section["rows"].append({"system": "vllm", **shape, **{key: answer[key] for key in PROFILE_FIELDS}})
                    print(table(section["rows"][-1:], header=False))
        finally:
            llm.shutdown()
        if peer is not None:
            ready = peer.wait_ready()
            section["vllm"] = {"version": ready["vllm_version"], "torch": ready["torch_version"],
                               "settings": {**peer.settings.described(), "runner": ready["settings"]},
                               "environment": ready["environment"], "set_by_vllm": ready.get("set_by_vllm", {}),
                               "engine_core_client": answer["engine_core_client"]}
    finally:
        if peer is not None:
            peer.close()
    return section


#: What ``summarize`` returns and the vLLM runner's ``profile`` answer carries.
PROFILE_FIELDS = ("steps", "idle_steps", "step_ms", "categories", "other_threads_ms", "output_tokens")
LABELS = {"gemm": "GEMM", "attention": "attention", "other_ops": "other ops", "sampling": "sampling", "host": "host"}


def table(rows: list[dict], header: bool = True) -> str:
    """Profile rows as a text table: system, batch, steps, median ms per step, each
    category's share of the step time (and its median ms per step)."""
    lines = []
    if header:
        lines.append(f"{'system':<11}{'batch':>6}{'steps':>7}{'ms/step':>9}  "
                     + "".join(f"{LABELS[c]:>18}" for c in CATEGORIES))
    for r in rows:
        cells = "".join(f"{r['categories'][c]['share']:>9.0%} {r['categories'][c]['median_ms']:>6.2f}ms"
                        for c in CATEGORIES)
        lines.append(f"{r['system']:<11}{r['batch']:>6}{r['steps']:>7}{r['step_ms']['median']:>9.2f}  {cells}")
    return "\n".join(lines)


__all__ = ["ATTENTION_RANGES", "CATEGORIES", "LABELS", "METHOD", "PROFILE_FIELDS", "RANGE_CATEGORIES",
           "SAMPLING_RANGES", "STEP_RANGE", "Span", "category_of", "classify_step", "mark_engine", "op_category",
           "profile_bench", "profile_engine", "profile_steps", "spans_from_events", "step_times", "summarize",
           "table"]
