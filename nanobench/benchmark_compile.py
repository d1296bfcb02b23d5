"""Eager against ``compile=True`` on CUDA, measured in one process (chapter 10's fusion experiment).

``python -m nanoengine bench --device cuda --compile`` calls ``compare_compile``, which

1. builds two engines on the same checkpoint, alike but for ``compile=True``; the compiled
   runner compiles and warms up while it is built (``compile_seconds``),
2. runs the benchmark workload on each ``repeats`` times, alternating which goes first,
   with an empty prefix cache every time; throughput is the median run,
3. times single-stream decode of both, alternating (``benchmark.decode_rates``),
4. checks that the greedy tokens are equal, request by request.

``compile=True`` is CUDA's (``nanoengine/backends/compilation.py`` says why), so the bench
refuses ``--compile`` on a CPU before anything loads. Both engines are in memory at once:
twice the weights and twice the KV pool.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from nanobench.benchmark import compare_greedy, decode_rates, engine_decoder
from nanobench.timing import in_turn

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
        engines[name] = LLM(model_dir, compile=name == "compiled", **engine_kwargs)  # CUDA graphs in both
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
        for name in in_turn(SYSTEMS, i):
            run_tokens, run_seconds = run_workload(name)
            tokens[name].append(run_tokens)
            seconds[name].append(run_seconds)
    total_out = len(prompts) * output_len
    tok_s = {name: total_out / statistics.median(seconds[name]) for name in SYSTEMS}
    check = compare_greedy(tokens["compiled"][0], tokens["eager"][0])
    result = {
        "compiled": report.compiled, "fallback_reason": report.fallback_reason, "compiled_ops": list(report.ops),
        "compile_seconds": report.seconds, "engine_build_seconds": build_seconds,
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

    result["explanation"] = explain(result)
    print(result["explanation"])
    for llm in engines.values():
        llm.shutdown()
    return result


def explain(result: dict) -> str:
    """One paragraph from the measured figures: the speed-up and what compiling cost."""
    parts = []
    if not result["compiled"]:
        parts.append(f"compile=True fell back to eager ({result['fallback_reason']}), so both engines ran eagerly.")
    text = f"compiled / eager: {result['workload']['speedup']:.2f}x on the workload"
    single = result.get("single_stream_decode")
    if single and single["speedup"] is not None:
        text += f", {single['speedup']:.2f}x in single-stream decode"
    parts.append(text + f"; compiling and warming up took {result['compile_seconds']:.1f} s.")
    return " ".join(parts)


def _inductor_cache_dir() -> str | None:
    """Where Inductor keeps compiled code between processes (a warm cache compiles faster)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return cache_dir()

