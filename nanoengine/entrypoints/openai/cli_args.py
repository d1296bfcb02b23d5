"""The ``serve`` command's flags, and their checks before anything is loaded (chapter 12).

Only argparse here, so ``python -m nanoengine --help`` does not import the web stack.
``check_arguments`` refuses a bad value with a ``ValueError`` that names it, before the
model loads; the engine options go through ``EngineConfig``'s own validation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256
# The default model's 8,192-token window holds about 33 KB of English (4 bytes a token) or
# 60 KB as JSON token ids: 8 MiB leaves room for a batch of a hundred full prompts.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT = 30.0  # seconds for a request's headers (nginx's client_header_timeout is 60)
DEFAULT_BODY_TIMEOUT = 60.0  # seconds for a whole request body, once the headers are in
# Engine options the command passes on to LLMEngine.from_pretrained (EngineConfig's names).
ENGINE_OPTIONS = ("device", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_num_seqs",
                  "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "scheduling_policy",
                  "tensor_parallel_size", "seed", "speculative_config", "enforce_eager")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the model's directory or file name)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this "
                   "machine only; 0.0.0.0 offers the model to the network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--api-key", default=os.environ.get("NANOENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 request (default: $NANOENGINE_API_KEY, "
                   "or no key)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting for the engine before new ones get 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help=f"seconds a request's headers may take to arrive, else 408 and the connection closes "
                   f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help=f"seconds a request's body may take to arrive, else 408 (default {DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--engine-thread", action="store_true",
                   help="step the engine on a thread of the server's process instead of a process of its own "
                   "(the default, as in vLLM: the engine's Python work then never waits for the server's)")
    engine = p.add_argument_group("engine options (EngineConfig)")
    engine.add_argument("--device", default="auto", help="auto, cpu or cuda")
    engine.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-memory-gb", type=float, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (also the largest n)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    engine.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--scheduling-policy", default=None, help="fcfs, prefill_first or static")
    engine.add_argument("--tensor-parallel-size", type=int, default=None)
    engine.add_argument("--seed", type=int, default=None)
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run the model's Python forward: on a CPU not one native call per layer, on CUDA "
                             "without graphs (vLLM's flag)")
    engine.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')


def _json_object(text: str) -> dict:
    """``--speculative-config``'s value: a JSON object (checked by ``SpeculativeConfig``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"method\": \"ngram\", "
                                         f"\"num_speculative_tokens\": 4}}', got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options that were given (the others keep EngineConfig's defaults)."""
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}


def run(args: argparse.Namespace) -> None:
    """``python -m nanoengine serve``: check everything, then load and serve (``api_server``)."""
    check_arguments(args)
    from nanoengine.entrypoints.openai.api_server import serve_from_args

    serve_from_args(args)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad values before the model loads, naming the value and what is allowed."""
    from nanoengine.config import EngineConfig

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"the server needs {' and '.join(missing)}: pip install -r requirements.txt "
                         f"(or pip install 'nanoengine[serve]')")
    if not args.host:
        raise ValueError("host must be an address such as 127.0.0.1, got an empty string")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port must be in [0, 65535] (0 picks a free one), got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"max_queue must be an integer >= 1 (requests waiting for the engine), got {args.max_queue}")
    check_limits(args.max_body_bytes, args.header_timeout, args.body_timeout)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("api_key is empty: give a key, or leave --api-key out to serve without one")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("served_model_name is empty: give a name or leave it out")
    EngineConfig.from_kwargs(**engine_kwargs(args))  # every engine value, checked without loading anything


def check_limits(max_body_bytes: int, header_timeout: float, body_timeout: float) -> None:
    """The request limits, for ``check_arguments`` and ``build_app``: a ValueError names a bad one."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    for name, value in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):  # nan too
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
