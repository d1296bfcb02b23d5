"""One measuring helper for every timing in the course (chapters 1-11; chapter 11 explains it).

A single timing of a function is a poor number: the first calls pay one-time costs
(allocation, lazy initialisation, compilation, cold caches), and later calls vary with
whatever else the machine does. Every timing in the notebooks therefore goes through
``measure``: ``warmup`` untimed calls, then ``repeats`` timed ones, reported as the median
with the interquartile range (the middle half of the runs) and the fastest run, next to
the machine and the engine's git revision the number came from (``Timing``).

On a CPU, PyTorch's OpenMP threads *spin* for a while when they run out of work, so that
the next operator starts without waking them. That is what the engine does in any script
that imports it, and it is the fastest setting on a quiet machine: the chapters measure
the engine as a user runs it. On a shared machine (a CI runner doing other jobs) spinning
threads steal the cores the measured code needs, and ``OMP_WAIT_POLICY=PASSIVE`` (idle
threads sleep at once) is the safer setting; ``./course test`` sets it. OpenMP reads the
policy once, when PyTorch loads it, so it must be chosen before ``import torch``. A
notebook's first cell therefore calls ``prepare_environment()``, which keeps a policy the
environment chose, sets ``PASSIVE`` when asked for a shared machine, and otherwise leaves
OpenMP's default; ``machine_description()`` says which is in effect and every ``Timing``
records it. (``import nanobench.timing`` does not import torch, see
``nanoengine/__init__.py``.)

The roofline of chapter 6 is built from two measurements taken here:

* ``measure_gemm_peak``: FLOP/s of the engine's own matrix multiply (``kernels/cpu_gemm.py``:
  oneDNN prepacked weights on a CPU, ``F.linear`` elsewhere) on given shapes;
* ``measure_memory_bandwidth``: bytes per second of a large tensor copy;

and ``roofline(peak, bandwidth)`` gives the attainable FLOP/s at any arithmetic intensity,
drawn by ``plot_roofline`` with measured points on it.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # torch and plotly load on first use: prepare_environment must run before torch
    import plotly.graph_objects as go
    import torch

    from nanoengine.models.config import ModelConfig

MIN_REPEATS = 5  # fewer runs give no meaningful quartiles
PASSIVE = "PASSIVE"

_policy_set_too_late = False  # prepare_environment ran after torch had loaded OpenMP


# ------------------------------------------------------------------ the environment
def prepare_environment(shared_machine: bool = False) -> str:
    """Choose how idle OpenMP threads wait; call it before ``import torch``. Returns the policy.

    A policy the environment already chose (``OMP_WAIT_POLICY``, e.g. set by ``./course
    test``) is kept. Otherwise ``shared_machine=True`` sets ``PASSIVE`` (idle threads sleep:
    slower per step on a quiet machine, much faster when other work competes for the
    cores), and the default leaves OpenMP's own behaviour, spinning before sleeping, which
    is how the engine runs in a user's script. Returns ``"PASSIVE"``, or ``"spin"`` for
    OpenMP's default or an explicit ``ACTIVE``.

    Called after torch has been imported it cannot change the running process (OpenMP read
    the variable at load): setting ``PASSIVE`` then warns, says to restart the kernel, and
    the variable still reaches child processes (the tensor-parallel workers of chapter 9).
    """
    global _policy_set_too_late
    if not isinstance(shared_machine, bool):
        raise TypeError(f"shared_machine must be True or False, got {shared_machine!r}")
    if shared_machine and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = PASSIVE
        if "torch" in sys.modules:
            _policy_set_too_late = True
            warnings.warn("prepare_environment() ran after torch was imported: OMP_WAIT_POLICY=PASSIVE only "
                          "reaches new processes. Restart the kernel and call it before importing torch "
                          "(or anything from nanoengine other than this module).", RuntimeWarning, stacklevel=2)
    return wait_policy()


def passive_wait_in_effect() -> bool:
    """True when this process's OpenMP threads sleep while idle (``OMP_WAIT_POLICY=PASSIVE``
    was set before torch loaded OpenMP)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == PASSIVE and not _policy_set_too_late


def wait_policy() -> str:
    """How this process's idle OpenMP threads wait: ``"PASSIVE"`` (sleep) or ``"spin"``."""
    return PASSIVE if passive_wait_in_effect() else "spin"


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none, e.g. off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def machine_description() -> str:
    """Where a measurement ran, in one line: GPU if any, CPU model and cores, torch and threads.

    The GPU comes first when there is one, so ``machine_description().split(";")[0]`` names
    the device that did the work.
    """
    import torch

    name = cpu_model() or platform.processor() or platform.machine()
    parts = [f"CPU {name}, {os.cpu_count()} cores"]
    if torch.cuda.is_available():
        parts.insert(0, f"GPU {torch.cuda.get_device_name(0)}")
    idle = "sleep (OMP_WAIT_POLICY=PASSIVE)" if passive_wait_in_effect() else "spin (OpenMP's default)"
    parts.append(f"torch {torch.__version__} using {torch.get_num_threads()} threads, idle threads {idle}")
    return "; ".join(parts)


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    return machine_description()


def source_revision() -> str | None:
    """The git commit of the engine's source tree, "+modified" if it has local changes."""
    root = pathlib.Path(__file__).resolve().parents[1]  # the repository: nanobench/ -> ..
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "nanoengine", "nanobench"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an installed wheel) or no git
    return rev + ("+modified" if dirty else "")



@functools.lru_cache(maxsize=1)
def _revision() -> str:
    return source_revision() or "unknown (not a git checkout)"


# ------------------------------------------------------------------ timings
def in_turn(systems, turn: int) -> list:
    """The order in which the compared systems (names, or a dict's keys) run in round ``turn`` of an
    alternating race: as given, then reversed every other round, so that each runs first, and each
    right after the others, as often as the rest (a machine's slow spells and warm caches favour none)."""
    names = list(systems)
    return names if turn % 2 == 0 else names[::-1]


def median_ms(seconds) -> float | None:
    """The median of durations in seconds, in milliseconds (None for none): how results files
    record the engine's per-step timers."""
    seconds = list(seconds)
    return 1e3 * statistics.median(seconds) if seconds else None


def _format_seconds(seconds: float, unit: tuple[str, float]) -> str:
    name, scale = unit
    value = seconds / scale
    return f"{value:.3g} {name}" if value < 100 else f"{value:.0f} {name}"


def _unit_for(seconds: float) -> tuple[str, float]:
    """The unit in which ``seconds`` reads as 1-999: ns, µs, ms or s."""
    for name, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return name, scale
    return "ns", 1e-9


@dataclass(frozen=True)
class Timing:
    """The timed runs of one function, and where they ran. Times are in seconds.

    ``median`` is the number to quote; ``q1``-``q3`` (the interquartile range, the middle
    half of the runs) is the spread to quote with it; ``min`` is the best case, a floor the
    reader will rarely see.
    """

    runs: tuple[float, ...]
    warmup: int
    machine: str
    revision: str
    passive_wait: bool  # idle OpenMP threads slept (OMP_WAIT_POLICY=PASSIVE), else they spun
    label: str = ""

    def __post_init__(self) -> None:
        if len(self.runs) < MIN_REPEATS:
            raise ValueError(f"a Timing needs at least {MIN_REPEATS} runs for a median and quartiles, "
                             f"got {len(self.runs)}")

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(q1, q3): a quarter of the runs are faster than q1, a quarter slower than q3."""
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return q1, q3

    @property
    def q1(self) -> float:
        return self.quartiles[0]

    @property
    def q3(self) -> float:
        return self.quartiles[1]

    @property
    def iqr(self) -> float:
        """q3 - q1: how far apart the middle half of the runs lie."""
        return self.q3 - self.q1

    @property
    def min(self) -> float:
        return min(self.runs)

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def describe(self) -> str:
        """``label: median (IQR q1-q3, min) over N runs after W warm-up`` and the machine and revision."""
        unit = _unit_for(self.median)
        q1, q3 = self.quartiles
        head = f"{self.label}: " if self.label else ""
        waiting = " [idle threads sleep: OMP_WAIT_POLICY=PASSIVE]" if self.passive_wait else ""
        return (f"{head}{_format_seconds(self.median, unit)} median (IQR {_format_seconds(q1, unit)} - "
                f"{_format_seconds(q3, unit)}, min {_format_seconds(self.min, unit)}) over {self.repeats} runs "
                f"after {self.warmup} warm-up; {self.machine}; engine {self.revision}{waiting}")

    __str__ = describe


def _default_sync() -> Callable[[], None] | None:
    """Wait for the GPU before reading the clock (its kernels run asynchronously); None on CPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return None


def measure(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 2, label: str = "",
            clock: Callable[[], float] = time.perf_counter,
            synchronize: Callable[[], None] | None | str = "auto") -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones (at least 5).

    ``synchronize`` is called before each clock reading; "auto" waits for CUDA when it is
    in use, so a GPU timing covers the kernels and not just their launch. ``clock`` is
    replaceable for tests. The OpenMP wait policy in effect is recorded (``passive_wait``).
    """
    if not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise ValueError(f"repeats must be an integer >= {MIN_REPEATS} (a median and quartiles of fewer runs "
                         f"mean little), got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {fn!r}")
    sync = _default_sync() if synchronize == "auto" else synchronize
    passive = passive_wait_in_effect()
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = clock()
        fn()
        if sync is not None:
            sync()
        runs.append(clock() - start)
    return Timing(tuple(runs), warmup, _machine(), _revision(), passive, label)


# ------------------------------------------------------------------ GEMM peak
@dataclass(frozen=True)
class GemmMeasurement:
    """One (tokens x in_features) @ (in_features -> out_features) multiply, timed."""

    tokens: int
    out_features: int
    in_features: int
    path: str  # "few-rows kernel" or "oneDNN packed" (the engine's CPU paths) or "F.linear"
    timing: Timing

    @property
    def flops(self) -> int:
        return 2 * self.tokens * self.in_features * self.out_features  # a multiply and an add per weight per token

    @property
    def flops_per_s(self) -> float:
        """FLOP/s at the median time: what the reader should expect."""
        return self.flops / self.timing.median

    @property
    def best_flops_per_s(self) -> float:
        """FLOP/s at the fastest run."""
        return self.flops / self.timing.min


@dataclass(frozen=True)
class GemmPeak:
    """GEMM measurements on several shapes; the peak is the best median among them."""

    measurements: tuple[GemmMeasurement, ...]

    @property
    def best(self) -> GemmMeasurement:
        return max(self.measurements, key=lambda m: m.flops_per_s)

    @property
    def flops_per_s(self) -> float:
        return self.best.flops_per_s


def model_gemm_shapes(config: "ModelConfig") -> list[tuple[int, int]]:
    """(out_features, in_features) of a layer's big matmuls: fused gate/up, down, fused QKV."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return [(2 * i, h), (h, i), (qkv, h)]


def measure_gemm_peak(shapes: Sequence[tuple[int, int]], tokens: int = 1024, *, repeats: int = 7, warmup: int = 2,
                      device: str = "cpu", dtype: "torch.dtype | None" = None,
                      paths: Sequence[str] = ("engine",), seed: int = 0) -> GemmPeak:
    """FLOP/s of matrix multiplies of ``tokens`` rows by weights of the given (out, in) shapes.

    ``paths``: "engine" multiplies the way the engine's CPU backend does (up to
    ``cpu_native.MAX_ROWS`` rows the few-rows kernel when it is built, more rows
    ``cpu_gemm.linear`` with a prepacked oneDNN weight when this PyTorch can pack, else
    ``F.linear``);
    "F.linear" always hands the plain weight to ``F.linear`` (MKL on a CPU, cuBLAS on a
    GPU). Each measurement records which path actually ran.
    """
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from nanoengine.backends.cpu import CpuLinearMethod
    from nanoengine.kernels import cpu_native

    if tokens < 1 or not shapes:
        raise ValueError(f"need tokens >= 1 and at least one shape, got tokens={tokens}, shapes={shapes!r}")
    unknown = set(paths) - {"engine", "F.linear"}
    if unknown or not paths:
        raise ValueError(f"paths must be a non-empty subset of ('engine', 'F.linear'), got {tuple(paths)!r}")
    dev = torch.device(device)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    results = []
    for n_out, n_in in shapes:
        x = torch.randn(tokens, n_in, generator=gen).to(dev, dtype)  # (tokens, in)
        w = torch.randn(n_out, n_in, generator=gen).to(dev, dtype)  # (out, in)
        for path in paths:
            native = dev.type == "cpu" and cpu_native.load()
            method = None
            if path == "engine":  # the method a CPU model's linear layer gets, given this weight as if loaded
                method = CpuLinearMethod(few_rows=native and dtype in cpu_native.DTYPES)
                method.process_weights_after_loading(SimpleNamespace(weight=w))
            if method is not None and (method.packed is not None or method.takes_few_rows(x, w)):
                def run(x=x, w=w, method=method):
                    return method.product(x, w)  # (tokens, out)
                used = "few-rows kernel" if method.takes_few_rows(x, w) else "oneDNN packed"
            else:
                def run(x=x, w=w):
                    return F.linear(x, w)  # (tokens, out)
                used = "F.linear"
            timing = measure(run, repeats=repeats, warmup=warmup,
                             label=f"GEMM {tokens}x{n_in} @ {n_in}x{n_out} ({used})")
            results.append(GemmMeasurement(tokens, n_out, n_in, used, timing))
    return GemmPeak(tuple(results))


# ------------------------------------------------------------------ memory bandwidth
@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second moved by a large tensor copy (read + write counted, as STREAM does)."""

    bytes_moved: int  # per run
    timing: Timing

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.timing.median

    def describe(self) -> str:
        return f"{self.bytes_per_s / 1e9:.1f} GB/s median copy bandwidth; {self.timing}"

    __str__ = describe


def measure_memory_bandwidth(megabytes: float = 256, *, repeats: int = 7, warmup: int = 2,
                             device: str = "cpu") -> Bandwidth:
    """Median bandwidth of copying a ``megabytes`` float32 tensor into another.

    The tensor must be much larger than the last-level cache (tens of MB on a server CPU)
    or the copy measures the cache instead of memory. A copy reads and writes every byte,
    so it moves twice the tensor's size; that is what decode does with the weights (read)
    and what the roofline's memory slope stands for.
    """
    import torch

    if megabytes <= 0:
        raise ValueError(f"megabytes must be > 0, got {megabytes}")
    n = max(1, int(megabytes * 2**20) // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), repeats=repeats, warmup=warmup,
                     label=f"copy of {n * 4 / 2**20:.0f} MiB")
    return Bandwidth(2 * n * 4, timing)


# ------------------------------------------------------------------ the roofline (chapter 6)
@dataclass(frozen=True)
class Roofline:
    """The most FLOP/s a kernel of a given arithmetic intensity (FLOPs per byte) can reach.

    Below the ridge point a kernel waits for memory (attainable = bandwidth x intensity);
    above it the arithmetic units are the limit (attainable = peak).
    """

    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.bandwidth > 0):
            raise ValueError(f"peak_flops and bandwidth must be > 0, got {self.peak_flops}, {self.bandwidth}")

    @property
    def ridge_point(self) -> float:
        """The intensity (FLOPs/byte) where the memory slope meets the compute ceiling."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        if intensity < 0:
            raise ValueError(f"arithmetic intensity must be >= 0, got {intensity}")
        return min(self.peak_flops, self.bandwidth * intensity)

    def bound(self, intensity: float) -> str:
        """"memory" or "compute": which roof limits a kernel of this intensity."""
        return "memory" if intensity < self.ridge_point else "compute"


def roofline(peak_flops: float, bandwidth: float) -> Roofline:
    """The roofline of a machine from its measured peak FLOP/s and bandwidth (bytes/s)."""
    return Roofline(float(peak_flops), float(bandwidth))


@dataclass(frozen=True)
class RooflinePoint:
    intensity: float  # FLOPs per byte
    flops_per_s: float  # achieved
    label: str = ""


def plot_roofline(roof: Roofline, points: Sequence[RooflinePoint | tuple[float, float, str]] = (),
                  title: str | None = None) -> "go.Figure":
    """A log-log plotly roofline with measured points; hovering a point shows its numbers.

    ``points`` are ``RooflinePoint``s or (intensity, achieved FLOP/s, label) tuples.
    """
    import numpy as np
    import plotly.graph_objects as go

    pts = [p if isinstance(p, RooflinePoint) else RooflinePoint(float(p[0]), float(p[1]), str(p[2]))
           for p in points]
    lows = [p.intensity for p in pts if p.intensity > 0] + [roof.ridge_point / 100]
    highs = [p.intensity for p in pts] + [roof.ridge_point * 100]
    xs = np.geomspace(min(lows) / 2, max(highs) * 2, 200)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[roof.attainable(x) / 1e9 for x in xs], mode="lines", name="attainable",
                             hovertemplate="intensity %{x:.3g} FLOP/B<br>roof %{y:.3g} GFLOP/s<extra></extra>"))
    fig.add_vline(x=roof.ridge_point, line_dash="dot")
    # On a log axis plotly places lines by value but annotations by log10(value).
    fig.add_annotation(x=math.log10(roof.ridge_point), y=1, yref="paper", text=f"ridge {roof.ridge_point:.3g} FLOP/B",
                       showarrow=False, xanchor="right", yanchor="bottom")
    if pts:
        fig.add_trace(go.Scatter(
            x=[p.intensity for p in pts], y=[p.flops_per_s / 1e9 for p in pts], mode="markers+text",
            text=[p.label for p in pts], textposition="top center", name="measured",
            customdata=[[p.flops_per_s / roof.attainable(p.intensity) if p.intensity > 0 else float("nan"),
                         roof.bound(p.intensity)] for p in pts],
            hovertemplate=("%{text}<br>intensity %{x:.3g} FLOP/B<br>achieved %{y:.3g} GFLOP/s"
                           "<br>%{customdata[0]:.0%} of the roof (%{customdata[1]}-bound)<extra></extra>")))
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOPs per byte)")
    fig.update_yaxes(type="log", title="GFLOP/s")
    fig.update_layout(title=title or f"Roofline: peak {roof.peak_flops / 1e9:.3g} GFLOP/s, "
                                     f"bandwidth {roof.bandwidth / 1e9:.3g} GB/s", height=420)
    return fig
