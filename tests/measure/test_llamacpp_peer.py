"""``bench --vs-llamacpp``: llama.cpp driven as a long-lived subprocess (nanobench/llamacpp_peer.py).

Most tests drive a stand-in runner (``fake_llamacpp_runner.py``, the same JSON-lines
protocol) with the course's own Python, so they need no llama.cpp; the last runs the real
runner on the default model and is skipped where ``./course llamacpp-setup`` has not made
``.venv-llamacpp``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanobench.llamacpp_peer import (DEFAULT_VENV, LlamaCppPeer, LlamaCppRunnerError, LlamaCppSettings,
                                     LlamaCppSetupError, llamacpp_python, stream_timing)
from nanoengine.__main__ import main

FAKE_RUNNER = Path(__file__).with_name("fake_llamacpp_runner.py")
sys.path.insert(0, str(FAKE_RUNNER.parent))
from fake_llamacpp_runner import fake_tokens  # noqa: E402
from test_vllm_peer import fake_venv  # noqa: E402

# The set-up's stamp, written once llama-cpp-python is installed (scripts/setup_llamacpp.sh):
# a virtualenv still being built has its python but not yet the package.
REAL_VENV = (DEFAULT_VENV / ".pins.sha").exists()


def settings(**overrides) -> LlamaCppSettings:
    values = dict(model_path="/nowhere/model.gguf", weights="float32", kv_cache_type="f32", n_threads=1, n_ctx=64)
    return LlamaCppSettings(**{**values, **overrides})


def fake_peer(**overrides) -> LlamaCppPeer:
    return LlamaCppPeer(settings(**overrides), python=sys.executable, runner=FAKE_RUNNER, load_timeout_s=60,
                        run_timeout_s=60)


# ------------------------------------------------------------- arguments
def test_missing_venv_is_a_clear_error_before_anything_loads(tmp_path, capsys):
    with pytest.raises(LlamaCppSetupError, match="./course llamacpp-setup"):
        llamacpp_python(tmp_path / "no-venv")
    # The command line says the same and exits 2, before any model is read.
    code = main(["bench", "--vs-llamacpp", "--llamacpp-venv", str(tmp_path / "no-venv")])
    assert code == 2 and "./course llamacpp-setup" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "float16"], "float32 or bfloat16"),
    (["--device", "cuda"], "--device cpu"),
    (["--llamacpp-prompt-len", "0"], "llamacpp_prompt_len"),
    (["--output-len", "1"], "output_len must be >= 2"),
    (["--vs-vllm"], "leave out --vs-vllm"),
    (["--online-rates", "1"], "leave out --online-rates"),
    (["--model", "/nowhere"], "needs --llamacpp-gguf"),
    (["--llamacpp-gguf", "/nowhere.gguf"], "no such file"),
])
def test_bad_vs_llamacpp_arguments_are_refused(tmp_path, capsys, extra, message):
    code = main(["bench", "--vs-llamacpp", "--llamacpp-venv", str(fake_venv(tmp_path, FAKE_RUNNER)), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="kv_cache_type must be one of f32, bf16"):
        settings(kv_cache_type="q4_0")
    with pytest.raises(ValueError, match="n_threads must be an integer >= 1"):
        settings(n_threads=0)
    assert "PYTHONPATH" not in settings().environment({"PYTHONPATH": "/course", "HOME": "/root"})


def test_the_runners_own_checks_need_no_llama_cpp(tmp_path):
    from nanobench.llamacpp_runner import check_config

    config = {"model_path": str(tmp_path / "none.gguf"), "n_threads": 1, "n_ctx": 64, "n_batch": 64,
              "kv_cache_type": "f32", "seed": 0}
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        check_config(config)
    with pytest.raises(ValueError, match="kv_cache_type must be one of f32, f16, bf16"):
        check_config({**config, "kv_cache_type": "f64"})
    with pytest.raises(ValueError, match="lacks seed"):
        check_config({k: v for k, v in config.items() if k != "seed"})


def test_stream_timing_is_ttft_then_decode_rate_after_the_first_token():
    timing = stream_timing([0.5, 0.6, 0.7, 0.9])
    assert timing["ttft_s"] == 0.5 and timing["decode_seconds"] == pytest.approx(0.4)
    assert timing["decode_tok_s"] == pytest.approx(3 / 0.4)
    with pytest.raises(ValueError, match="at least two"):
        stream_timing([0.5])


# ----------------------------------------------------------------- runner
def test_peer_loads_once_and_answers_timed_generations():
    with fake_peer() as peer:
        ready = peer.wait_ready()
        assert ready["llama_cpp_python_version"] == "0.0-fake" and ready["settings"]["n_ctx"] == 64
        first = peer.generate([1, 2, 3], 5)
        assert first["tokens"] == fake_tokens([1, 2, 3], 5) and len(first["token_times"]) == 5
        assert first["token_times"] == sorted(first["token_times"]) and first["seconds"] == first["token_times"][-1]
        assert peer.generate([4, 5], 3)["tokens"] == fake_tokens([4, 5], 3)  # the same process takes another
        process = peer.process
    assert peer.process is None and process.returncode == 0  # quit on close


@pytest.mark.parametrize("mode, message", [
    ("fail-load", "cannot load"),
    ("die-on-run", "exited"),
    ("short", "not a measurement"),
])
def test_peer_failures_are_clear_errors_with_the_log(monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_LLAMACPP_MODE", mode)
    with fake_peer() as peer:
        with pytest.raises(LlamaCppRunnerError, match=message) as caught:
            peer.wait_ready()
            peer.generate([1, 2], 4)
        assert "a log line a real llama.cpp would print" in str(caught.value)  # the log's tail comes along


# ------------------------------------------------------------ end to end
@pytest.mark.slow  # the engine on a tiny model, the bandwidth measure
def test_bench_vs_llamacpp_alternates_and_writes_its_results(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bench-llamacpp.json"
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # the stand-in never reads it
    code = main(["bench", "--vs-llamacpp", "--llamacpp-venv", str(fake_venv(tmp_path, FAKE_RUNNER)),
                 "--model", str(tiny_llama_dir), "--llamacpp-gguf", str(gguf), "--llamacpp-prompt-len", "6",
                 "--output-len", "5", "--repeats", "2", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    engine, peer = results["systems"]["nanoengine"], results["systems"]["llamacpp"]
    assert engine["repeats"] == peer["repeats"] == 2 and len(peer["ttft_ms"]["runs"]) == 2
    assert engine["tokens_identical_across_repeats"] and engine["dtype"] == "float32"
    assert peer["settings"]["kv_cache_type"] == "f32" and peer["settings"]["n_threads"] == engine["threads"]
    assert peer["settings"]["n_ctx"] >= 6 + 5 and peer["gguf"] == {
        "file": "tiny.gguf", "bytes": 4, "weights": "given", "same_precision_as_engine": True}
    assert peer["version"] == "0.0-fake" and peer["weight_bytes"] == 1000
    check = peer["greedy_agreement"]
    assert check["prompts_compared"] == 1 and check["tokens_compared"] == 5
    if check["first_divergence"] != [None]:  # the stand-in's tokens are not the model's: the gap is measured
        assert check["top2_logit_gap"] >= 0
    if engine["decode_tok_s"] and peer["decode_tok_s"]:
        assert results["ratios_engine_over"]["llamacpp"]["decode"] == pytest.approx(
            engine["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"])
    assert results["workload"] == {"streams": 1, "prompt_tokens": 6, "output_tokens": 5, "seed": 0, "greedy": True,
                                   "ignore_eos": True, "repeats": 2}
    assert results["memory_bandwidth_gbs"] > 0 and results["command"] and results["environment"]["nanoengine_revision"]
    assert "engine / llamacpp (medians)" in capsys.readouterr().out


@pytest.mark.slow  # loads the default model in the engine and in llama.cpp
@pytest.mark.skipif(not REAL_VENV, reason="no .venv-llamacpp (./course llamacpp-setup)")
def test_real_llamacpp_runner_agrees_with_the_engine_in_float32():
    from nanobench.benchmark import build_engine, make_workload
    from nanobench.gguf_export import default_model_gguf
    from nanobench.llamacpp_peer import engine_generate
    from nanobench.vllm_peer import greedy_agreement
    from nanoengine import default_model_dir

    prompt = make_workload(1, 16, 16, seed=0)[0]
    llm = build_engine(default_model_dir(), dtype="float32")
    try:
        engine_tokens = engine_generate(llm)(prompt, 8)["tokens"]
    finally:
        llm.shutdown()
    with LlamaCppPeer(LlamaCppSettings(model_path=str(default_model_gguf("float32")), weights="float32",
                                       kv_cache_type="f32", n_threads=2, n_ctx=64)) as peer:
        ready = peer.wait_ready()
        assert ready["settings"]["kv_cache_type"] == "f32" and "F32" in ready["settings"]["model_description"]
        result = peer.generate(prompt, 8)
    assert greedy_agreement([engine_tokens], [result["tokens"]])["identical_prompts"] == 1
