"""The command line, ``python -m nanoengine {generate,chat,bench}``: good runs and bad input.

``python -m nanobench`` (the benchmark's own package) runs the same benchmark as ``bench``,
with the same options and the same answers to bad input (its cases at the end).

Most cases call ``nanoengine.__main__.main([...])`` in-process (fast); two run the real
``python -m nanoengine`` in a subprocess. A bad value must end with exit status 2 and a
one-line ``error: ...`` on stderr that names the value and what is allowed (no traceback);
a bad flag or type is argparse's job (exit status 2, its usage message).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from nanobench.__main__ import main as nanobench_main
from nanoengine.__main__ import main


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_cli_error(capsys, argv, *fragments: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


# ------------------------------------------------------------------------ good runs
@pytest.mark.slow
def test_generate_prints_the_completion(capsys, tiny_llama_tok_dir):
    code, out, err = run(capsys, "generate", "Hello there", "--model", str(tiny_llama_tok_dir), "--device", "cpu",
                         "--max-tokens", "4")
    assert code == 0 and out.strip() and not err


@pytest.mark.slow
def test_generate_stream_and_chat_template(capsys, tiny_llama_tok_dir):
    code, out, _ = run(capsys, "generate", "Hello", "--model", str(tiny_llama_tok_dir), "--device", "cpu",
                       "--max-tokens", "4", "--stream", "--chat", "--temperature", "0.8", "--top-k", "20",
                       "--top-p", "0.9", "--min-p", "0.05", "--seed", "3")
    assert code == 0 and out.endswith("\n")


@pytest.mark.slow
def test_chat_loop_reads_stdin_until_exit(capsys, monkeypatch, tiny_llama_tok_dir):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n   \nhow are you?\n/exit\nnever read\n"))
    code, out, _ = run(capsys, "chat", "--model", str(tiny_llama_tok_dir), "--device", "cpu", "--max-tokens", "3",
                       "--system", "Be brief.")
    assert code == 0
    assert out.count("assistant> ") == 2  # blank lines are skipped, /exit ends the loop


@pytest.mark.slow
def test_chat_loop_ends_at_end_of_input(capsys, monkeypatch, tiny_llama_tok_dir):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi"))
    code, out, _ = run(capsys, "chat", "--model", str(tiny_llama_tok_dir), "--device", "cpu", "--max-tokens", "2")
    assert code == 0 and out.count("assistant> ") == 1


# ------------------------------------------------------------------ bad values (exit 2)
SAMPLING_ERRORS = {
    "max-tokens zero": (["--max-tokens", "0"], "max_tokens", "at least 1", "0"),
    "max-tokens negative": (["--max-tokens", "-5"], "max_tokens", "at least 1", "-5"),
    "temperature negative": (["--temperature", "-1"], "temperature", "non-negative", "-1"),
    "temperature nan": (["--temperature", "nan"], "temperature", "NaN"),
    "top-p zero": (["--top-p", "0"], "top_p", "(0, 1]", "0.0"),
    "top-p above one": (["--top-p", "1.5"], "top_p", "(0, 1]", "1.5"),
    "top-p inf": (["--top-p", "inf"], "top_p", "(0, 1]", "inf"),
    "top-k below -1": (["--top-k", "-5"], "top_k", "-1", "-5"),
    "min-p above one": (["--min-p", "2"], "min_p", "[0, 1]", "2.0"),
    "seed negative": (["--seed", "-1"], "seed", "2**63", "-1"),
    "seed too large": (["--seed", str(2**63)], "seed", "2**63", str(2**63)),
}


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, fragments", [pytest.param(v[0], v[1:], id=k) for k, v in SAMPLING_ERRORS.items()])
def test_bad_sampling_values(capsys, command, flags, fragments):
    # Checked before any model is loaded, so no --model is needed.
    argv = ["generate", "hi"] if command == "generate" else ["chat"]
    assert_cli_error(capsys, argv + flags, *fragments)


@pytest.mark.parametrize("flags, fragments", [
    pytest.param(["--device", "tpu"], ("device", "'tpu'", "cpu"), id="device unknown"),
    pytest.param(["--model", "/nonexistent/model"], ("'/nonexistent/model'", "Hugging Face directory"), id="no model"),
])
def test_bad_engine_values(capsys, flags, fragments):
    assert_cli_error(capsys, ["generate", "hi"] + flags, *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys):
    assert_cli_error(capsys, ["generate", "hi", "--device", "cuda"], "device='cuda'", "no CUDA")
    assert_cli_error(capsys, ["bench", "--device", "cuda", "--skip-hf"], "device='cuda'", "no CUDA")


@pytest.mark.slow
def test_bad_prompts(capsys, tiny_llama_tok_dir, tiny_llama_dir):
    tok = ["--model", str(tiny_llama_tok_dir), "--device", "cpu", "--max-tokens", "2"]
    assert_cli_error(capsys, ["generate", ""] + tok, "prompt is empty")
    assert_cli_error(capsys, ["generate", "word " * 1100] + tok, "tokens but max_model_len is 1024")
    bare = ["--model", str(tiny_llama_dir), "--device", "cpu", "--max-tokens", "2"]
    assert_cli_error(capsys, ["generate", "hi"] + bare, "no tokenizer", "token ids")
    assert_cli_error(capsys, ["generate", "hi", "--chat"] + bare, "no chat template")


@pytest.mark.parametrize("flags, fragments", [
    pytest.param(["--num-requests", "0"], ("num_requests", ">= 1", "0"), id="no requests"),
    pytest.param(["--min-prompt", "0"], ("min_prompt", "0"), id="min-prompt zero"),
    pytest.param(["--min-prompt", "10", "--max-prompt", "5"], ("min_prompt <= max_prompt", "10", "5"), id="min > max"),
    pytest.param(["--single-stream-tokens", "1"], ("single_stream_tokens", ">= 2", "1"), id="single-stream one token"),
    pytest.param(["--device", "tpu"], ("device", "'tpu'", "cpu", "cuda"), id="bench device unknown"),
    pytest.param(["--dtype", "float64"], ("dtype", "'float64'", "float32", "bfloat16"), id="bench dtype unknown"),
    pytest.param(["--compile-repeats", "0"], ("compile_repeats", ">= 1", "0"), id="compile repeats zero"),
    pytest.param(["--compile", "--device", "cpu"], ("--compile", "CUDA only", "one native call per decoder layer",
                                                    "--device cuda", "got --device cpu"), id="compile on a cpu"),
    pytest.param(["--repeats", "0"], ("repeats", ">= 1", "0"), id="repeats zero"),
    pytest.param(["--output-len", "0"], ("output_len", ">= 1", "0"), id="output-len zero"),
    pytest.param(["--min-output-len", "9", "--output-len", "4"], ("min_output_len <= output_len", "9", "4"),
                 id="min-output-len above output-len"),
    pytest.param(["--min-output-len", "0"], ("min_output_len", ">= 1", "0"), id="min-output-len zero"),
    pytest.param(["--online-rates", "1", "0"], ("online_rates", "> 0", "requests per second"), id="rate zero"),
    pytest.param(["--online-rates", "inf"], ("online_rates", "finite"), id="rate infinite"),
    pytest.param(["--batch-sizes", "4", "-1"], ("batch_sizes", ">= 1", "-1"), id="batch size negative"),
    pytest.param(["--hf-batch-size", "0"], ("hf_batch_size", ">= 1", "0"), id="hf batch zero"),
    pytest.param(["--tie-tolerance", "-1"], ("tie_tolerance", ">= 0"), id="tie tolerance negative"),
    pytest.param(["--overhead", "--overhead-requests", "64", "0"], ("overhead_requests", ">= 1", "0"),
                 id="overhead requests zero"),
    pytest.param(["--overhead", "--overhead-steps", "0"], ("overhead_steps", ">= 1", "0"), id="overhead steps zero"),
])
def test_bad_bench_values(capsys, tiny_llama_dir, flags, fragments):
    # Checked before the GEMM measurement and before any model is loaded.
    assert_cli_error(capsys, ["bench", "--model", str(tiny_llama_dir), "--skip-hf"] + flags, *fragments)


# -------------------------------------------------------------- argparse (exit 2)
@pytest.mark.parametrize("argv, fragment", [
    pytest.param([], "required: command", id="no command"),
    pytest.param(["sever"], "invalid choice: 'sever'", id="unknown command"),
    pytest.param(["generate"], "the following arguments are required: prompt", id="no prompt"),
    pytest.param(["generate", "hi", "--max-tokens", "abc"], "invalid int value: 'abc'", id="max-tokens not int"),
    pytest.param(["generate", "hi", "--temperature", "warm"], "invalid float value: 'warm'", id="temperature text"),
    pytest.param(["generate", "hi", "--seed", "1.5"], "invalid int value: '1.5'", id="seed float"),
    pytest.param(["generate", "hi", "--tempreature", "0"], "unrecognized arguments: --tempreature", id="typo flag"),
    pytest.param(["chat", "extra"], "unrecognized arguments: extra", id="chat positional"),
    pytest.param(["bench", "--num-requests", "many"], "invalid int value: 'many'", id="bench not int"),
    pytest.param(["bench", "--compile-repeats", "2.5"], "invalid int value: '2.5'", id="bench repeats not int"),
    pytest.param(["bench", "--online-rates"], "expected at least one argument", id="bench rates missing"),
    pytest.param(["bench", "--batch-sizes", "4", "x"], "invalid int value: 'x'", id="bench batch size text"),
    pytest.param(["bench", "--overhead", "--overhead-steps", "many"], "invalid int value: 'many'",
                 id="overhead steps text"),
])
def test_argparse_errors(capsys, argv, fragment):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "usage:" in err, err


# -------------------------------------------------------------------- real process
def _python_m(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanoengine", *argv], capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.mark.slow
def test_python_m_nanoengine_generates(tiny_llama_tok_dir):
    done = _python_m("generate", "Hello", "--model", str(tiny_llama_tok_dir), "--device", "cpu",
                     "--max-tokens", "3")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


@pytest.mark.slow
def test_python_m_nanoengine_reports_a_bad_value():
    done = _python_m("generate", "hi", "--top-p", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: top_p must be in (0, 1], got 0.0"


# -------------------------------------------------------- python -m nanobench: the same bench
@pytest.mark.parametrize("flags, fragments", [
    pytest.param(["--num-requests", "0"], ("num_requests", ">= 1", "0"), id="no requests"),
    pytest.param(["--device", "tpu"], ("device", "'tpu'", "cpu", "cuda"), id="device unknown"),
    pytest.param(["--online-rates", "1", "0"], ("online_rates", "> 0", "requests per second"), id="rate zero"),
])
def test_nanobench_answers_bad_values_as_bench_does(capsys, tiny_llama_dir, flags, fragments):
    code = nanobench_main(["--model", str(tiny_llama_dir), "--skip-hf"] + flags)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, (code, err)
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert main(["bench", "--model", str(tiny_llama_dir), "--skip-hf"] + flags) == 2
    assert capsys.readouterr().err == err


def test_nanobench_argparse_errors_and_the_recorded_command(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        nanobench_main(["--num-requests", "many"])
    assert info.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr("nanobench.benchmark.run_from_args", seen.append)
    assert nanobench_main(["--num-requests", "4", "--skip-hf"]) == 0
    assert seen[0].num_requests == 4 and seen[0].skip_hf
    assert seen[0].command_line == "python -m nanobench --num-requests 4 --skip-hf"  # written into the results


@pytest.mark.slow
def test_python_m_nanobench_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "nanobench", "--help"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 0 and "usage: python -m nanobench" in done.stdout and "--vs-vllm" in done.stdout
    done = subprocess.run([sys.executable, "-m", "nanobench", "--repeats", "0"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: repeats"), done.stderr
