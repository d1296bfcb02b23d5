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

import io
from dataclasses import dataclass

import ipywidgets as W

from nanoengine import LLMEngine
from nanoengine.models.config import ModelConfig
from nanoengine.models.presets import PRESETS
from widgets._common import MessageView, check_int, escape, format_bytes, guarded

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8 / int8": 1}


def device_presets() -> dict[str, int]:
    """Device memory sizes in bytes; the first is this machine's RAM (measured now)."""
    import psutil

    ram = psutil.virtual_memory().total
    return {f"this machine's RAM ({ram / GiB:.1f} GiB)": ram, "24 GiB (RTX 4090 class)": 24 * GiB,
            "80 GiB (H100)": 80 * GiB, "141 GiB (H200)": 141 * GiB}


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
            raise ValueError(f"{model} handles at most {config.max_position_embeddings} positions; "
                             f"context length {context_len} is longer")
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
    verdict = (f'<span class="ne-fits" style="color:#2e7d32">fits, {format_bytes(e.headroom_bytes)} to spare'
               if e.fits else f'<span class="ne-fits" style="color:#c62828">does not fit: '
                              f'{format_bytes(-e.headroom_bytes)} short')
    return (f'<table class="ne-mem" style="font-size:13px" cellpadding="3">'
            f'<tr><th align="left">weights</th><td class="ne-weights">{format_bytes(e.weights_bytes)}</td>'
            f'<td>{e.weights_bytes:,} B</td></tr>'
            f'<tr><th align="left">KV cache</th><td class="ne-kv">{format_bytes(e.kv_bytes)}</td>'
            f'<td>{e.kv_bytes_per_token:,} B/token × {e.context_len:,} tokens × {e.batch_size} sequences</td></tr>'
            f'<tr><th align="left">total</th><td class="ne-total"><b>{format_bytes(e.total_bytes)}</b></td>'
            f'<td>{escape(e.device)}: {format_bytes(e.device_bytes)} — {verdict}</span></td></tr>'
            f'<tr><th align="left">at this context</th><td colspan="2">at most <b>{e.max_batch_size:,}</b> sequences '
            f'fit ({e.max_tokens_in_cache:,} KV tokens beside the weights)</td></tr></table>'
            f'<div style="font-size:11px;color:#666">Not counted: activations, framework workspace, CUDA context, '
            f'allocator fragmentation (several GiB on a real GPU).</div>')


def render_chart_png(e: MemoryEstimate) -> bytes:
    """One horizontal stacked bar (weights, KV) against the device's memory."""
    from matplotlib.figure import Figure  # a bare Figure needs no backend: the notebook's stays as it is

    fig = Figure(figsize=(7, 2.2), dpi=80)
    ax = fig.add_subplot()
    w, kv = e.weights_bytes / GiB, e.kv_bytes / GiB
    ax.barh([0], [w], color="#5b9bd5", label=f"weights {w:.2f} GiB")
    ax.barh([0], [kv], left=[w], color="#ed7d31", label=f"KV cache {kv:.2f} GiB")
    ax.axvline(e.device_bytes / GiB, color="#c62828", linestyle="--", label=f"device {e.device_bytes / GiB:.1f} GiB")
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_xlim(0, max(w + kv, e.device_bytes / GiB) * 1.05)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, frameon=False)
    ax.set_title(f"{e.model}, {e.dtype}, {e.context_len:,} tokens × {e.batch_size}", fontsize=10)
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
        self.model = W.Dropdown(options=list(self.controller.models), value=model, description="model", style=style,
                                layout=W.Layout(width="400px"))
        self.context_len = W.BoundedIntText(value=context_len, min=0, max=10**7, description="context length",
                                            style=style)
        self.batch_size = W.BoundedIntText(value=batch_size, min=0, max=10**6, description="batch size", style=style)
        self.dtype = W.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="dtype", style=style)
        # wide enough that "this machine's RAM (23.5 GiB)" is not cut to "this machine's RAM (23.5…"
        self.device = W.Dropdown(options=list(self.controller.devices), description="device", style=style,
                                 layout=W.Layout(width="400px"))
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
            self.summary.value = '<div style="color:#888">no estimate for these values</div>'
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
                f'<div class="ne-engine-check" style="font-size:12px">Live engine check: bytes per token × blocks × '
                f'block size = {c["kv_formula"]:,} B; the engine\'s KV tensor is {c["kv_allocated"]:,} B '
                f'({"equal" if same else "DIFFERENT"}). Weights: {c["weights_formula"]:,} B by formula, '
                f'{c["weights_allocated"]:,} B allocated.</div>')
        super().__init__([W.HBox([W.VBox([self.model, self.dtype, self.device]),
                                  W.VBox([self.context_len, self.batch_size])]),
                          self.message, self.summary, self.chart, self.engine_check])
        self.add_class("ne-memory-estimator")
        on_change()
