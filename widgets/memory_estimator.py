"""The memory estimator: weights + KV cache against a device's memory (chapters 1 and 3).

For a model shape (the four ``nanoengine.models.presets.PRESETS``), a context length, a
batch size and a dtype::

    weights  = num_parameters x bytes per value
    KV cache = 2 (K and V) x layers x KV heads x head_dim x bytes   per token
               x context length x batch size

Both formulas are the engine's own (``ModelConfig.num_parameters`` and
``ModelConfig.kv_bytes_per_token``); the tests check the KV formula byte for byte against
the KV tensor a live engine allocates, and the weight count against the real model's
parameters. Left out, and said so in the view: activations, the framework's workspace,
CUDA context and allocator fragmentation, which take several more GiB on a real GPU.

``MemoryEstimatorController`` is the testable part; ``MemoryEstimator`` draws it.
"""

from __future__ import annotations

import functools
import io
import re
from dataclasses import dataclass

import ipywidgets as W

from nanoengine import LLMEngine
from nanoengine.models.config import ModelConfig
from nanoengine.models.presets import PRESETS
from translations import tr
from widgets._common import MessageView, chart_fonts, check_int, escape, format_bytes, guarded

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8 / int8": 1}


def device_presets() -> dict[str, int]:
    """Device memory sizes in bytes; the first is this machine's RAM (measured now)."""
    import psutil

    ram = psutil.virtual_memory().total
    return {f"this machine's RAM ({ram / GiB:.1f} GiB)": ram, "24 GiB (RTX 4090 class)": 24 * GiB,
            "80 GiB (H100)": 80 * GiB, "141 GiB (H200)": 141 * GiB}


def device_label(name: str) -> str:
    """A device's name as the view shows it, in the notebook's language (the name itself, a key
    of ``device_presets()``, stays English: code looks devices up by it)."""
    ram = re.fullmatch(r"this machine's RAM \((.+) GiB\)", name)
    if ram:
        return tr("this machine's RAM ({gib} GiB)", gib=ram.group(1))
    if name == "24 GiB (RTX 4090 class)":
        return tr("24 GiB (RTX 4090 class)")
    return name


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    context_len: int
    batch_size: int
    dtype: str
    weights_bytes: int
    kv_bytes_per_token: int
    device: str
    device_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context_len * self.batch_size

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.device_bytes - self.total_bytes

    @property
    def max_batch_size(self) -> int:
        """Most sequences of ``context_len`` tokens whose KV fits beside the weights."""
        return max(0, (self.device_bytes - self.weights_bytes) // (self.kv_bytes_per_token * self.context_len))

    @property
    def max_tokens_in_cache(self) -> int:
        """KV tokens (over all sequences) that fit beside the weights."""
        return max(0, (self.device_bytes - self.weights_bytes) // self.kv_bytes_per_token)


class MemoryEstimatorController:
    """Estimate memory for a preset model; compare the formulas with a live engine."""

    def __init__(self, models: dict[str, ModelConfig] | None = None, devices: dict[str, int] | None = None) -> None:
        self.models = dict(models or PRESETS)
        self.devices = dict(devices or device_presets())

    def estimate(self, model: str, context_len: int, batch_size: int, dtype: str = "bfloat16",
                 device: str | None = None) -> MemoryEstimate:
        if model not in self.models:
            raise ValueError(f"unknown model {model!r}; choose one of {sorted(self.models)}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPE_BYTES)}")
        device = device if device is not None else next(iter(self.devices))
        if device not in self.devices:
            raise ValueError(f"unknown device {device!r}; choose one of {list(self.devices)}")
        config = self.models[model]
        context_len = check_int("context length", context_len, 1)
        if context_len > config.max_position_embeddings:
            raise ValueError(tr("{model} handles at most {n} positions; context length {context_len} is longer",
                                model=model, n=config.max_position_embeddings, context_len=context_len))
        batch_size = check_int("batch size", batch_size, 1)
        nbytes = DTYPE_BYTES[dtype]
        return MemoryEstimate(model, context_len, batch_size, dtype, config.num_parameters() * nbytes,
                              config.kv_bytes_per_token(nbytes), device, self.devices[device])

    @staticmethod
    def compare_with_engine(engine: LLMEngine) -> dict[str, int]:
        """The formulas against what ``engine`` really allocated (bytes).

        ``kv_formula`` is bytes per token x blocks x block size; ``kv_allocated`` is the
        size of the KV tensor the engine allocated. ``weights_formula`` is num_parameters x
        bytes per value; ``weights_allocated`` sums the model's parameter tensors. Both
        allocations come from ``engine.memory_report()``, so this works under tensor
        parallelism too (the ranks' shares added up).
        """
        report = engine.memory_report()
        dtype_bytes = DTYPE_BYTES[report.dtype]
        return {
            "kv_formula": engine.model_config.kv_bytes_per_token(dtype_bytes) * report.num_kv_blocks
            * report.block_size,
            "kv_allocated": report.kv_cache_bytes,
            "weights_formula": engine.model_config.num_parameters() * dtype_bytes,
            "weights_allocated": report.weight_bytes,
        }


def render_summary(e: MemoryEstimate) -> str:
    verdict = (f'<span class="ne-fits" style="color:#2e7d32">'
               f'{tr("fits, {spare} to spare", spare=format_bytes(e.headroom_bytes))}'
               if e.fits else f'<span class="ne-fits" style="color:#c62828">'
                              f'{tr("does not fit: {short} short", short=format_bytes(-e.headroom_bytes))}')
    return (f'<table class="ne-mem" style="font-size:13px" cellpadding="3">'
            f'<tr><th align="left">{tr("weights")}</th><td class="ne-weights">{format_bytes(e.weights_bytes)}</td>'
            f'<td>{e.weights_bytes:,} B</td></tr>'
            f'<tr><th align="left">{tr("KV cache")}</th><td class="ne-kv">{format_bytes(e.kv_bytes)}</td>'
            f'<td>{tr("{per_token:,} B/token × {context:,} tokens × {seqs} sequences", per_token=e.kv_bytes_per_token, context=e.context_len, seqs=e.batch_size)}'
            f'</td></tr>'
            f'<tr><th align="left">{tr("total")}</th><td class="ne-total"><b>{format_bytes(e.total_bytes)}</b></td>'
            f'<td>{escape(device_label(e.device))}: {format_bytes(e.device_bytes)} — {verdict}</span></td></tr>'
            f'<tr><th align="left">{tr("at this context")}</th><td colspan="2">'
            f'{tr("at most <b>{n:,}</b> sequences fit ({tokens:,} KV tokens beside the weights)", n=e.max_batch_size, tokens=e.max_tokens_in_cache)}'
            f'</td></tr></table>'
            f'<div style="font-size:11px;color:#666">'
            f'{tr("Not counted: activations, framework workspace, CUDA context, allocator fragmentation (several GiB on a real GPU).")}'
            f'</div>')


@functools.lru_cache(maxsize=1)
def render_chart_png(e: MemoryEstimate) -> bytes:
    """One horizontal stacked bar (weights, KV) against the device's memory."""
    import matplotlib

    with matplotlib.rc_context(chart_fonts()):
        return _chart_png(e)


def _chart_png(e: MemoryEstimate) -> bytes:
    from matplotlib.figure import Figure  # a bare Figure needs no backend: the notebook's stays as it is

    fig = Figure(figsize=(7, 2.2), dpi=80)
    ax = fig.add_subplot()
    w, kv = e.weights_bytes / GiB, e.kv_bytes / GiB
    ax.barh([0], [w], color="#5b9bd5", label=tr("weights {gib:.2f} GiB", gib=w))
    ax.barh([0], [kv], left=[w], color="#ed7d31", label=tr("KV cache {gib:.2f} GiB", gib=kv))
    ax.axvline(e.device_bytes / GiB, color="#c62828", linestyle="--",
               label=tr("device {gib:.1f} GiB", gib=e.device_bytes / GiB))
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_xlim(0, max(w + kv, e.device_bytes / GiB) * 1.05)
    ax.legend(prop={"size": 8}, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, frameon=False)
    ax.set_title(tr("{model}, {dtype}, {context:,} tokens × {seqs}", model=e.model, dtype=e.dtype,
                    context=e.context_len, seqs=e.batch_size), fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class MemoryEstimator(MessageView, W.VBox):
    """Model, context length, batch size, dtype and device -> weights, KV cache, total."""

    def __init__(self, controller: MemoryEstimatorController | None = None, model: str = "Llama-3-8B",
                 context_len: int = 8192, batch_size: int = 8, dtype: str = "bfloat16",
                 engine: LLMEngine | None = None) -> None:
        self.controller = controller or MemoryEstimatorController()
        self.message = W.HTML()
        show = self.show_message
        style = {"description_width": "110px"}
        self.model = W.Dropdown(options=list(self.controller.models), value=model, description=tr("model"),
                                style=style, layout=W.Layout(width="400px"))
        self.context_len = W.BoundedIntText(value=context_len, min=0, max=10**7, description=tr("context length"),
                                            style=style)
        self.batch_size = W.BoundedIntText(value=batch_size, min=0, max=10**6, description=tr("batch size"),
                                           style=style)
        self.dtype = W.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="dtype", style=style)
        # wide enough that "this machine's RAM (23.5 GiB)" is not cut to "this machine's RAM (23.5…";
        # each option shows its label in the notebook's language, its value stays the devices' key
        self.device = W.Dropdown(options=[(device_label(d), d) for d in self.controller.devices],
                                 description=tr("device"), style=style, layout=W.Layout(width="400px"))
        self.summary = W.HTML()
        self.chart = W.Image(format="png", layout=W.Layout(width="560px"))
        self.engine_check = W.HTML()
        self.summary.add_class("ne-mem-summary")
        self.estimate: MemoryEstimate | None = None

        @guarded(show)
        def on_change(_=None):
            # Clear first: on a bad value the old summary and chart must not stay on screen
            # looking like the answer for the new values.
            self.estimate = None
            self.summary.value = f'<div style="color:#888">{tr("no estimate for these values")}</div>'
            self.chart.layout.display = "none"
            e = self.controller.estimate(self.model.value, self.context_len.value, self.batch_size.value,
                                         self.dtype.value, self.device.value)
            self.estimate = e
            self.summary.value = render_summary(e)
            self.chart.value = render_chart_png(e)
            self.chart.layout.display = None
            self.show_message("")

        self._on_change = on_change
        for w in (self.model, self.context_len, self.batch_size, self.dtype, self.device):
            w.observe(on_change, names="value")
        if engine is not None:
            c = self.controller.compare_with_engine(engine)
            same = c["kv_formula"] == c["kv_allocated"]
            self.engine_check.value = (
                '<div class="ne-engine-check" style="font-size:12px">'
                + tr("Live engine check: bytes per token × blocks × block size = {kv_formula:,} B; the engine's KV "
                     "tensor is {kv_allocated:,} B ({verdict}). Weights: {weights_formula:,} B by formula, "
                     "{weights_allocated:,} B allocated.", kv_formula=c["kv_formula"],
                     kv_allocated=c["kv_allocated"], verdict=tr("equal") if same else tr("DIFFERENT"),
                     weights_formula=c["weights_formula"], weights_allocated=c["weights_allocated"])
                + '</div>')
        super().__init__([W.HBox([W.VBox([self.model, self.dtype, self.device]),
                                  W.VBox([self.context_len, self.batch_size])]),
                          self.message, self.summary, self.chart, self.engine_check])
        self.add_class("ne-memory-estimator")
        on_change()
