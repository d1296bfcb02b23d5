"""Eager against ``compile=True``, measured in one process (chapter 10's fusion experiment).

``python -m nanoengine bench --compile`` calls ``compare_compile``, which

1. builds two engines on the same checkpoint, one eager, one with ``compile=True``; the
   compiled runner compiles and warms up while it is built (``compile_seconds``),
2. runs the benchmark workload on each ``repeats`` times, alternating which goes first,
   with an empty prefix cache every time; throughput is the median run,
3. times single-stream decode of both, alternating (``benchmark.decode_rates``),
4. checks that the greedy tokens are equal, request by request,
5. measures the share of a decode step that the compilable ops take, eager and compiled:
   each of the runner's ``compilable`` functions is wrapped in a stopwatch for a few
   extra runs. That share bounds what fusing them can save, so it explains the speed-up
   or its absence with a measurement instead of a guess.

Both engines are in memory at once: twice the weights and twice the KV pool.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from nanobench.benchmark import compare_greedy, decode_rates, engine_decoder
from nanoengine.backends.compilation import CPU_MIN_ROWS, compilable_objects

SYSTEMS = ("eager", "compiled")


def compare_compile(model_dir: Path, prompts: list[list[int]], output_len: int, repeats: int,
                    single_stream_tokens: int, **engine_kwargs) -> dict:
    """The eager and the compiled engine on the same workload; see the module docstring."""
    from nanoengine import LLM, SamplingParams

    cache_dir = _inductor_cache_dir()
    cache_was_warm = cache_dir is not None and Path(cache_dir).is_dir() and any(Path(cache_dir).iterdir())
    engines, build_seconds = {}, {}
    for name in SYSTEMS:
        start = time.perf_counter()
        # "eager": the layers' Python forward, as compile=True runs them, so the two differ only in compile=True
        engines[name] = LLM(model_dir, compile=name == "compiled", enforce_eager=name == "eager", **engine_kwargs)
        build_seconds[name] = time.perf_counter() - start
    report = engines["compiled"].engine.runner.compilation
    print(f"compile=True: {'compiled ' + ', '.join(report.ops) if report.compiled else report.fallback_reason}; "
          f"compiling and warming up took {report.seconds:.1f} s")

    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run_workload(name: str) -> tuple[list[list[int]], float]:
        llm = engines[name]
        llm.engine.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        return [list(o.token_ids) for o in outs], time.perf_counter() - start

    for name in SYSTEMS:  # warm-up, as benchmark.run_engine does
        engines[name].generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    tokens = {name: [] for name in SYSTEMS}
    seconds = {name: [] for name in SYSTEMS}
    for i in range(repeats):
        for name in SYSTEMS if i % 2 == 0 else reversed(SYSTEMS):  # alternate who goes first
            run_tokens, run_seconds = run_workload(name)
            tokens[name].append(run_tokens)
            seconds[name].append(run_seconds)
    total_out = len(prompts) * output_len
    tok_s = {name: total_out / statistics.median(seconds[name]) for name in SYSTEMS}
    check = compare_greedy(tokens["compiled"][0], tokens["eager"][0])
    result = {
        "compiled": report.compiled, "fallback_reason": report.fallback_reason, "compiled_ops": list(report.ops),
        "compile_seconds": report.seconds, "engine_build_seconds": build_seconds,
        "cpu_min_rows": CPU_MIN_ROWS if engines["compiled"].engine.runner.device.type == "cpu" else None,
        "inductor_cache": {"dir": cache_dir, "warm_before_run": cache_was_warm},
        "workload": {"repeats": repeats, "seconds": seconds, "output_tokens_per_s": tok_s,
                     "speedup": tok_s["compiled"] / tok_s["eager"]},
        "greedy_tokens_equal": tokens["compiled"][0] == tokens["eager"][0], "greedy_check": check,
        "deterministic_across_repeats": all(t == tokens[name][0] for name in SYSTEMS for t in tokens[name]),
    }
    print(f"workload, medians of {repeats}: eager {tok_s['eager']:.1f} tok/s, compiled {tok_s['compiled']:.1f} "
          f"tok/s ({result['workload']['speedup']:.2f}x); greedy tokens equal: {result['greedy_tokens_equal']}")

    prompt = prompts[0][:32]
    if single_stream_tokens:
        rates = decode_rates({name: engine_decoder(engines[name], prompt) for name in SYSTEMS},
                             single_stream_tokens, repeats=5)
        speedup = rates["compiled"] / rates["eager"] if None not in rates.values() else None
        result["single_stream_decode"] = {"tokens": single_stream_tokens, "prompt_tokens": len(prompt),
                                          "repeats": 5, "tok_s": rates, "speedup": speedup}
        if speedup is not None:
            print(f"single-stream decode: eager {rates['eager']:.1f} tok/s, compiled {rates['compiled']:.1f} tok/s "
                  f"({speedup:.2f}x)")

    if engines["eager"].engine.runner.device.type == "cpu":  # CPU ops are synchronous: a stopwatch times them
        result["op_time"] = {name: op_time_share(engines[name], prompts, greedy, prompt, single_stream_tokens)
                             for name in SYSTEMS}
    result["explanation"] = explain(result)
    print(result["explanation"])
    for llm in engines.values():
        llm.shutdown()
    return result


class Stopwatch:
    """Wraps one function; adds the wall time of each call to ``totals[name]``."""

    def __init__(self, fn: Callable, totals: dict[str, float], name: str) -> None:
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        self.totals[self.name] += time.perf_counter() - start
        return out


@contextmanager
def timed_ops(runner) -> Iterator[dict[str, float]]:
    """While inside, every compilable function of ``runner`` (eager or compiled, whichever it
    uses) runs through a ``Stopwatch``; yields the running totals in seconds by op name."""
    totals: dict[str, float] = {}
    swapped = []
    for obj in compilable_objects(runner):
        for attr in type(obj).compilable:
            name = f"{type(obj).__name__}.{attr}"
            totals.setdefault(name, 0.0)
            swapped.append((obj, attr, vars(obj).get(attr)))
            setattr(obj, attr, Stopwatch(getattr(obj, attr), totals, name))
    try:
        yield totals
    finally:
        for obj, attr, own in reversed(swapped):
            if own is None:
                delattr(obj, attr)  # back to the class's eager function
            else:
                setattr(obj, attr, own)


def op_time_share(llm, prompts: list[list[int]], params, prompt: list[int], decode_tokens: int,
                  repeats: int = 5) -> dict:
    """Time spent in the compilable ops: per decode step of one stream, and over the workload."""
    runner = llm.engine.runner
    result: dict = {}
    with timed_ops(runner) as totals:
        llm.engine.block_manager.reset_prefix_cache()
        start, before = time.perf_counter(), sum(totals.values())
        llm.generate(prompts, params)
        wall, in_ops = time.perf_counter() - start, sum(totals.values()) - before
        result["workload"] = {"seconds": wall, "ops_seconds": in_ops, "share": in_ops / wall}
        if decode_tokens:
            run = engine_decoder(llm, prompt)
            run(2)  # warm-up
            walls = {1: [], decode_tokens: []}
            ops = {1: [], decode_tokens: []}
            per_op = {1: [], decode_tokens: []}
            for _ in range(repeats):
                for k in (1, decode_tokens):
                    snapshot = dict(totals)
                    start = time.perf_counter()
                    run(k)
                    walls[k].append(time.perf_counter() - start)
                    per_op[k].append({name: totals[name] - snapshot[name] for name in totals})
                    ops[k].append(sum(per_op[k][-1].values()))
            steps = decode_tokens - 1
            step = (statistics.median(walls[decode_tokens]) - statistics.median(walls[1])) / steps
            in_ops = (statistics.median(ops[decode_tokens]) - statistics.median(ops[1])) / steps
            result["decode_step"] = {
                "step_ms": 1e3 * step, "ops_ms": 1e3 * in_ops, "share": in_ops / step if step > 0 else None,
                "per_op_ms": {name: 1e3 * (statistics.median(r[name] for r in per_op[decode_tokens])
                                           - statistics.median(r[name] for r in per_op[1])) / steps
                              for name in totals},
                "method": "(median over repeats of n-token minus 1-token runs) / (n - 1)", "repeats": repeats}
    return result


def explain(result: dict) -> str:
    """One paragraph from the measured figures: the speed-up and the op share that bounds it."""
    parts = []
    if not result["compiled"]:
        parts.append(f"compile=True fell back to eager ({result['fallback_reason']}), so both engines ran eagerly.")
    text = f"compiled / eager: {result['workload']['speedup']:.2f}x on the workload"
    single = result.get("single_stream_decode")
    if single and single["speedup"] is not None:
        text += f", {single['speedup']:.2f}x in single-stream decode"
    parts.append(text + f"; compiling and warming up took {result['compile_seconds']:.1f} s.")
    if result.get("cpu_min_rows"):
        parts.append(f"On a CPU compiled code runs for inputs of at least {result['cpu_min_rows']} rows (tokens in "
                     f"a step, or sampled sequences); smaller steps, such as single-stream decode, run eagerly.")
    op_time = result.get("op_time")
    if op_time:
        eager, compiled = op_time["eager"], op_time["compiled"]
        text = "Eager, the compilable ops (RMSNorm + residual, rotary, SiLU-and-mul, sampler filters) take "
        step = eager.get("decode_step")
        if step and step["share"] is not None:
            text += (f"{step['share']:.1%} of a single-stream decode step ({step['ops_ms']:.2f} of "
                     f"{step['step_ms']:.2f} ms) and ")
        text += (f"{eager['workload']['share']:.1%} of the workload's time: the most that fusing them can save. "
                 f"Compiled they take ")
        step = compiled.get("decode_step")
        if step and step["share"] is not None:
            text += f"{step['share']:.1%} of a decode step ({step['ops_ms']:.2f} ms) and "
        text += f"{compiled['workload']['share']:.1%} of the workload's time."
        parts.append(text)
    return " ".join(parts)


def _inductor_cache_dir() -> str | None:
    """Where Inductor keeps compiled code between processes (a warm cache compiles faster)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return cache_dir()

