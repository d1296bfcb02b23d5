"""llama.cpp's side of ``bench --vs-llamacpp``: a long-lived process that loads one GGUF file
with llama-cpp-python and generates greedy tokens for the prompts sent to it as JSON lines.

This file is *executed* by ``.venv-llamacpp/bin/python`` (made by ``./course
llamacpp-setup``), never imported by the course: that virtualenv has llama-cpp-python and
numpy but neither torch nor nanoengine, so the script uses only them and the standard
library. ``nanobench/llamacpp_peer.py`` drives it through ``peer_process.RunnerProcess``.

llama-cpp-python serves one sequence at a time, so this is the single-stream peer: what a
CPU user runs to chat with one model. Each generation is timed token by token:

* ``llama.reset()`` first, so the prompt is computed afresh each time (llama-cpp-python
  would otherwise reuse the KV cache of a previous prompt with the same prefix);
* the whole prompt goes through ``Llama.eval`` (llama.cpp's ``llama_decode`` in batches of
  ``n_batch`` tokens), then llama.cpp's own greedy sampler (``llama_sampler_init_greedy``:
  the argmax of the last logits) picks the first token: that moment is the time to first
  token;
* then one ``eval`` of the last token and one greedy pick per new token. End of sequence
  is never checked, so exactly ``max_tokens`` tokens come out, as the engine's
  ``ignore_eos`` makes it do.

The protocol, one JSON object per line:

* start: ``python llamacpp_runner.py '<config JSON>'`` with ``model_path`` (a GGUF file),
  ``n_threads`` (llama.cpp's threads for decoding and for prompts alike), ``n_ctx``,
  ``n_batch``, ``kv_cache_type`` (``f32``, ``bf16`` or ``f16``: the KV cache's element
  type) and ``seed``. After loading and one short warm-up generation it answers
  ``{"event": "ready", "llama_cpp_python_version": ..., "system_info": ..., "settings": ...,
  "model": ...}``.
* ``{"command": "generate", "prompt": [ids], "max_tokens": n}``: one timed greedy
  generation, answered by ``{"event": "result", "tokens": [...], "token_times": [...],
  "seconds": ...}``: each token's time in seconds from the start of the call (the first
  is the time to first token) and the whole call's.
* ``{"command": "quit"}``: exit 0 (so does the end of stdin).

Anything wrong is answered by ``{"event": "error", "message": ...}``; a command that fails
leaves the process ready for the next. As in ``vllm_runner.py``, the answers travel on a
copy of the original standard output taken before llama.cpp loads: whatever llama.cpp
prints goes to standard error, the driver's log file (``runner_protocol.serve``).
"""

from __future__ import annotations

import os
import platform
import sys
import time

REQUIRED_CONFIG = ("model_path", "n_threads", "n_ctx", "n_batch", "kv_cache_type", "seed")
#: ``kv_cache_type`` -> the ggml type id (``GGML_TYPE_F32`` and friends, ggml.h).
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30}
WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def check_config(config: dict) -> None:
    missing = [key for key in REQUIRED_CONFIG if key not in config]
    if missing:
        raise ValueError(f"the runner's config lacks {', '.join(missing)} (needs {', '.join(REQUIRED_CONFIG)})")
    if config["kv_cache_type"] not in KV_CACHE_TYPES:
        raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {config['kv_cache_type']!r}")
    if not os.path.isfile(config["model_path"]):
        raise FileNotFoundError(f"no GGUF file at {config['model_path']!r}")


class GreedyGenerator:
    """One GGUF file loaded by llama-cpp-python, generating greedy tokens one sequence at a time."""

    def __init__(self, config: dict) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        kv_type = KV_CACHE_TYPES[config["kv_cache_type"]]
        self.llm = llama_cpp.Llama(model_path=config["model_path"], n_threads=config["n_threads"],
                                   n_threads_batch=config["n_threads"], n_ctx=config["n_ctx"],
                                   n_batch=config["n_batch"], seed=config["seed"], type_k=kv_type, type_v=kv_type,
                                   verbose=True)  # its log goes to stderr: the driver's log file
        self.sampler = llama_cpp.llama_sampler_init_greedy()
        self.generate(WARMUP_PROMPT, 2)

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("generate needs 'prompt': a non-empty list of token ids")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"generate needs 'max_tokens': an integer >= 1, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.llm.n_ctx():
            raise ValueError(f"{len(prompt)} prompt tokens and {max_tokens} new ones do not fit the context of "
                             f"{self.llm.n_ctx()} tokens this runner was started with")
        sample = self.llama_cpp.llama_sampler_sample
        llm, ctx = self.llm, self.llm.ctx
        llm.reset()  # compute the prompt afresh: no KV cache kept from the previous call
        tokens, times = [], []
        start = time.perf_counter()
        llm.eval(prompt)
        while True:
            token = sample(self.sampler, ctx, -1)  # greedy: the argmax of the last position's logits
            tokens.append(int(token))
            times.append(time.perf_counter() - start)
            if len(tokens) == max_tokens:  # end of sequence is never checked: always max_tokens
                break
            llm.eval([token])
        return {"event": "result", "tokens": tokens, "token_times": times, "seconds": times[-1]}

    def described(self, config: dict) -> dict:
        """What llama.cpp made of the file and the config."""
        llm, llama_cpp = self.llm, self.llama_cpp
        return {"n_ctx": llm.n_ctx(), "n_batch": llm.n_batch, "n_threads": llm.n_threads,
                "n_threads_batch": llm.n_threads_batch, "kv_cache_type": config["kv_cache_type"],
                "flash_attn": bool(llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
                "load_mode": (llama_cpp.llama_load_mode_name(llm.model_params.load_mode) or b"?").decode(),
                "seed": config["seed"],
                "model_size_bytes": int(llama_cpp.llama_model_size(llm.model)),
                "model_parameters": int(llama_cpp.llama_model_n_params(llm.model)),
                "model_description": _model_description(llama_cpp, llm.model)}


def _model_description(llama_cpp, model) -> str:
    """llama.cpp's one-line description of the model (architecture, size, file type)."""
    import ctypes

    buffer = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buffer, ctypes.sizeof(buffer))
    return buffer.value.decode("utf-8", errors="replace")


def start(config: dict) -> tuple[dict, dict]:
    """Load the GGUF file as the config says: the ``ready`` message and the commands it takes."""
    check_config(config)
    started = time.perf_counter()
    generator = GreedyGenerator(config)
    import llama_cpp
    import numpy

    ready = {"event": "ready", "llama_cpp_python_version": llama_cpp.__version__, "numpy_version": numpy.__version__,
             "python": platform.python_version(), "load_seconds": time.perf_counter() - started,
             "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
             "settings": generator.described(config)}
    return ready, {"generate": lambda command: generator.generate(command.get("prompt"), command.get("max_tokens"))}


def main(argv: list[str]) -> int:
    from runner_protocol import serve  # beside this file: the script's directory

    return serve(argv, "llamacpp_runner.py", start)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
