"""A bad-input matrix for every public entry point (chapter 2's API, chapter 8's parameters).

Each case feeds one bad value to ``SamplingParams``, ``EngineConfig``, ``LLM(...)``,
``generate``, ``chat``, ``stream``, ``abort``, ``add_request`` or ``next_token_logits``
(the command line has its own file, ``test_cli.py``) and checks that

* it fails with a clear error whose message names the bad value and what is allowed
  (each case lists the fragments the message must contain);
* the engine is exactly as before: an equal ``snapshot()``, the same unfinished requests,
  no event emitted, invariants intact, even with another request in flight;
* a normal request right after still gives the expected tokens.

Boundary values that *are* allowed are checked too, so the checks are not over-eager.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoengine import LLM, EngineConfig, SamplingParams

VOCAB = 49152  # SmolLM2's tokenizer on the tiny model
CONFIG = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8)
PROBE = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROBE_PROMPT = [11, 12, 13, 14, 15]
GOOD = SamplingParams(temperature=0.0, max_tokens=4)
NAN, INF = float("nan"), float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


@pytest.fixture(scope="module")
def make_llm(build_tiny_llm):
    # LLM(...) itself is exercised by the constructor cases
    return lambda with_tokenizer=True, **overrides: build_tiny_llm({**CONFIG, **overrides}, with_tokenizer)


@pytest.fixture(scope="module")
def expected_probe(make_llm) -> tuple[int, ...]:
    return make_llm().generate([PROBE_PROMPT], PROBE)[0].token_ids


@pytest.fixture(scope="module")
def shared_llm(make_llm) -> LLM:
    return make_llm()


@pytest.fixture
def llm(shared_llm, expected_probe) -> LLM:
    """The shared LLM with a request in flight (holding blocks, some cached); checked after the test."""
    engine = shared_llm.engine
    if "bg" not in engine.requests:
        engine.add_request(list(range(100, 130)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           request_id="bg")
        engine.step()
        engine.step()
    yield shared_llm
    # A normal request right after the bad one still works (bg keeps running beside it).
    assert shared_llm.generate([PROBE_PROMPT], PROBE)[0].token_ids == expected_probe
    engine.check_invariants()


def assert_rejected(llm: LLM, call, exc: type[Exception], *fragments: str) -> None:
    """``call()`` raises ``exc`` naming every fragment, and the engine is untouched."""
    engine = llm.engine
    events: list = []
    unsubscribe = engine.events.subscribe(events.append)
    before, requests_before = engine.snapshot(), dict(engine.requests)
    try:
        with pytest.raises(exc) as info:
            call()
    finally:
        unsubscribe()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the error message {message!r}"
    assert engine.snapshot() == before, "a rejected input changed the engine"
    assert engine.requests == requests_before
    assert not events, f"a rejected input emitted events: {events}"
    engine.check_invariants()


def _cases(table: dict) -> list:
    return [pytest.param(*value, id=key) for key, value in table.items()]


# ------------------------------------------------------------------- SamplingParams
SAMPLING = {
    "temperature negative": (dict(temperature=-0.5), ValueError, "temperature", "-0.5", "non-negative"),
    "temperature NaN": (dict(temperature=NAN), ValueError, "temperature", "NaN"),
    "temperature inf": (dict(temperature=INF), ValueError, "temperature", "finite", "inf"),
    "temperature str": (dict(temperature="0.7"), ValueError, "temperature", "'0.7'", "a number"),
    "temperature None": (dict(temperature=None), ValueError, "temperature", "None"),
    "temperature bool": (dict(temperature=True), ValueError, "temperature", "True"),
    "top_p zero": (dict(top_p=0.0), ValueError, "top_p", "(0, 1]", "0.0"),
    "top_p above one": (dict(top_p=1.5), ValueError, "top_p", "(0, 1]", "1.5"),
    "top_p negative": (dict(top_p=-0.1), ValueError, "top_p", "(0, 1]", "-0.1"),
    "top_p NaN": (dict(top_p=NAN), ValueError, "top_p", "NaN"),
    "top_p inf": (dict(top_p=INF), ValueError, "top_p", "(0, 1]", "inf"),
    "top_k below -1": (dict(top_k=-2), ValueError, "top_k", "-1", "-2"),
    "top_k float": (dict(top_k=1.5), ValueError, "top_k", "integer", "1.5"),
    "top_k str": (dict(top_k="5"), ValueError, "top_k", "integer", "'5'"),
    "top_k bool": (dict(top_k=True), ValueError, "top_k", "True"),
    "min_p negative": (dict(min_p=-0.1), ValueError, "min_p", "[0, 1]", "-0.1"),
    "min_p above one": (dict(min_p=1.5), ValueError, "min_p", "[0, 1]", "1.5"),
    "min_p NaN": (dict(min_p=NAN), ValueError, "min_p", "NaN"),
    "max_tokens zero": (dict(max_tokens=0), ValueError, "max_tokens", "at least 1", "0"),
    "max_tokens negative": (dict(max_tokens=-3), ValueError, "max_tokens", "at least 1", "-3"),
    "max_tokens float": (dict(max_tokens=2.5), ValueError, "max_tokens", "integer", "2.5"),
    "max_tokens str": (dict(max_tokens="16"), ValueError, "max_tokens", "integer", "'16'"),
    "max_tokens None": (dict(max_tokens=None), ValueError, "max_tokens", "None"),
    "max_tokens bool": (dict(max_tokens=True), ValueError, "max_tokens", "True"),
    "seed negative": (dict(seed=-1), ValueError, "seed", "2**63", "-1"),
    "seed too large": (dict(seed=2**63), ValueError, "seed", "2**63", str(2**63)),
    "seed float": (dict(seed=1.5), ValueError, "seed", "integer", "1.5"),
    "seed str": (dict(seed="1"), ValueError, "seed", "integer", "'1'"),
    "stop empty string": (dict(stop=[""]), ValueError, "stop", "non-empty", "''"),
    "stop int item": (dict(stop=[1]), ValueError, "stop", "strings", "1"),
    "stop int": (dict(stop=5), ValueError, "stop", "a string or a list of strings", "5"),
    "stop bytes": (dict(stop=b"x"), ValueError, "stop", "a string or a list of strings", "b'x'"),
    "stop_token_ids negative": (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids", "non-negative", "-1"),
    "stop_token_ids bool": (dict(stop_token_ids=[True]), ValueError, "stop_token_ids", "integers", "True"),
    "stop_token_ids float": (dict(stop_token_ids=[1.5]), ValueError, "stop_token_ids", "integers", "1.5"),
    "stop_token_ids int": (dict(stop_token_ids=5), ValueError, "stop_token_ids", "a list of token ids", "5"),
    "stop_token_ids str": (dict(stop_token_ids="abc"), ValueError, "stop_token_ids", "list of token ids", "'abc'"),
    "logprobs negative": (dict(logprobs=-1), ValueError, "logprobs", "[0, 20]", "-1"),
    "logprobs too many": (dict(logprobs=21), ValueError, "logprobs", "[0, 20]", "21"),
    "logprobs float": (dict(logprobs=1.5), ValueError, "logprobs", "integer", "1.5"),
    "logprobs bool": (dict(logprobs=True), ValueError, "logprobs", "True"),
    "ignore_eos str": (dict(ignore_eos="yes"), ValueError, "ignore_eos", "True or False", "'yes'"),
    "unknown field": (dict(temprature=0.0), TypeError, "temprature"),
    # Beyond what the engine's tensors hold (the reproduction sent top_k = 2**63).
    "top_k 2**63": (dict(top_k=2**63), ValueError, "top_k", "64 bits", str(2**63)),
    "top_k 10**30": (dict(top_k=10**30), ValueError, "top_k", "64 bits", "an integer of 100 bits"),
    "max_tokens 10**5000": (dict(max_tokens=10**5000), ValueError, "max_tokens", "64 bits", "16610 bits"),
    "n 2**64": (dict(n=2**64), ValueError, "n must be", "64 bits"),
    "temperature 10**400": (dict(temperature=10**400), ValueError, "temperature", "finite", "1329 bits"),
    "top_p 10**400": (dict(top_p=10**400), ValueError, "top_p", "finite"),
    "seed 10**30": (dict(seed=10**30), ValueError, "seed", "64 bits"),
    "stop too many": (dict(stop=["x"] * 33), ValueError, "stop", "33 strings", "at most 32"),
    "stop string too long": (dict(stop=["x" * 257]), ValueError, "stop", "257 characters", "at most 256"),
    "stop_token_ids too many": (dict(stop_token_ids=range(257)), ValueError, "stop_token_ids", "257", "at most 256"),
}


@pytest.mark.parametrize("kwargs, exc, fragments", [pytest.param(v[0], v[1], v[2:], id=k) for k, v in SAMPLING.items()])
def test_bad_sampling_params(kwargs, exc, fragments):
    with pytest.raises(exc) as info:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0),
    dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=1), dict(seed=0), dict(seed=2**63 - 1), dict(logprobs=0),
    dict(logprobs=20), dict(stop=None), dict(stop="x"), dict(stop_token_ids=None), dict(stop_token_ids={2, 3}),
    dict(stop_token_ids=range(3)), dict(stop=["x" * 256] * 32), dict(stop_token_ids=range(256)),
    dict(top_k=2**62), dict(temperature=1e300)], ids=lambda kwargs: repr(kwargs)[:60])
def test_boundary_sampling_params_are_allowed(kwargs):
    params = SamplingParams(**kwargs)
    assert isinstance(params.stop, tuple) and isinstance(params.stop_token_ids, tuple)


# ------------------------------------------------------ EngineConfig and LLM(...)
ENGINE_CONFIG = {
    "device unknown": (dict(device="tpu"), "device", "'tpu'", "cpu"),
    "device None": (dict(device=None), "device", "None"),
    "dtype unknown": (dict(dtype="float64"), "dtype", "'float64'", "float32"),
    "dtype torch object": (dict(dtype=torch.float32), "dtype", "torch.float32", "float32"),
    "block_size zero": (dict(block_size=0), "block_size", ">= 1", "0"),
    "block_size negative": (dict(block_size=-1), "block_size", ">= 1", "-1"),
    "block_size float": (dict(block_size=2.5), "block_size", "integer", "2.5"),
    "block_size str": (dict(block_size="16"), "block_size", "integer", "'16'"),
    "block_size bool": (dict(block_size=True), "block_size", "True"),
    "block_size None": (dict(block_size=None), "block_size", "None"),
    "num_kv_blocks zero": (dict(num_kv_blocks=0), "num_kv_blocks", ">= 1", "0"),
    "num_kv_blocks negative": (dict(num_kv_blocks=-5), "num_kv_blocks", ">= 1", "-5"),
    "num_kv_blocks float": (dict(num_kv_blocks=1.5), "num_kv_blocks", "integer", "1.5"),
    "kv_cache_memory_gb zero": (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb", "> 0", "0"),
    "kv_cache_memory_gb negative": (dict(kv_cache_memory_gb=-1.0), "kv_cache_memory_gb", "> 0", "-1.0"),
    "kv_cache_memory_gb NaN": (dict(kv_cache_memory_gb=NAN), "kv_cache_memory_gb", "nan"),
    "kv_cache_memory_gb inf": (dict(kv_cache_memory_gb=INF), "kv_cache_memory_gb", "finite", "inf"),
    "kv_cache_memory_gb str": (dict(kv_cache_memory_gb="1"), "kv_cache_memory_gb", "number", "'1'"),
    "kv_cache_memory_gb bool": (dict(kv_cache_memory_gb=True), "kv_cache_memory_gb", "True"),
    "max_num_seqs zero": (dict(max_num_seqs=0), "max_num_seqs", ">= 1", "0"),
    "max_num_seqs str": (dict(max_num_seqs="8"), "max_num_seqs", "integer", "'8'"),
    "max_num_batched_tokens zero": (dict(max_num_batched_tokens=0), "max_num_batched_tokens", ">= 1", "0"),
    "max_num_batched_tokens float": (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens", "1.5"),
    "budget below max_num_seqs": (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens (8)",
                                  "max_num_seqs (16)", "at least 16", "at most 8"),
    "max_model_len zero": (dict(max_model_len=0), "max_model_len", ">= 1", "0"),
    "max_model_len negative": (dict(max_model_len=-1), "max_model_len", ">= 1", "-1"),
    "prefix caching str": (dict(enable_prefix_caching="yes"), "enable_prefix_caching", "True or False", "'yes'"),
    "prefix caching int": (dict(enable_prefix_caching=1), "enable_prefix_caching", "True or False", "1"),
    "prefix caching None": (dict(enable_prefix_caching=None), "enable_prefix_caching", "None"),
    "chunked prefill int": (dict(enable_chunked_prefill=0), "enable_chunked_prefill", "True or False", "0"),
    "policy unknown": (dict(scheduling_policy="lifo"), "scheduling_policy", "'lifo'", "fcfs", "prefill_first"),
    "policy wrong case": (dict(scheduling_policy="FCFS"), "scheduling_policy", "'FCFS'", "fcfs"),
    "policy None": (dict(scheduling_policy=None), "scheduling_policy", "None"),
    "tensor_parallel_size zero": (dict(tensor_parallel_size=0), "tensor_parallel_size", ">= 1", "0"),
    "tensor_parallel_size negative": (dict(tensor_parallel_size=-1), "tensor_parallel_size", ">= 1", "-1"),
    "tensor_parallel_size float": (dict(tensor_parallel_size=1.5), "tensor_parallel_size", "1.5"),
    "enforce_eager str": (dict(enforce_eager="no"), "enforce_eager", "True or False", "'no'"),
    "seed float": (dict(seed=1.5), "seed", "integer", "1.5"),
    "seed str": (dict(seed="0"), "seed", "integer", "'0'"),
    "seed bool": (dict(seed=True), "seed", "True"),
    "seed too large": (dict(seed=2**64), "seed", "2**64", str(2**64)),
    "seed too small": (dict(seed=-2**63 - 1), "seed", "-2**63", str(-2**63 - 1)),
    "unknown option": (dict(blocksize=16), "unknown engine option", "blocksize", "block_size"),
}
if not torch.cuda.is_available():
    ENGINE_CONFIG["device cuda without CUDA"] = (dict(device="cuda"), "device='cuda'", "no CUDA", "cpu")


@pytest.mark.parametrize("kwargs, fragments", [pytest.param(v[0], v[1:], id=k) for k, v in ENGINE_CONFIG.items()])
def test_bad_engine_config(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# Options only the model can judge (it has max_position_embeddings 1024), and bad models.
LLM_ONLY = {
    "max_model_len beyond the model": (dict(max_model_len=2048), "max_model_len=2048", "1024"),
    "kv cache too small (blocks)": (dict(max_model_len=256, block_size=16, num_kv_blocks=3),
                                    "3 blocks of 16 tokens", "max_model_len=256", "16 blocks"),
    "kv cache too small (memory)": (dict(kv_cache_memory_gb=1e-9), "1 blocks", "cannot hold one request",
                                    "kv_cache_memory_gb"),
    "no chunking, budget below max_model_len": (dict(enable_chunked_prefill=False, max_num_batched_tokens=100),
                                                "max_num_batched_tokens (100)", "max_model_len (1024)"),
}


@pytest.mark.parametrize("kwargs, fragments",
                         [pytest.param(v[0], v[1:], id=k) for k, v in {**ENGINE_CONFIG, **LLM_ONLY}.items()])
def test_bad_llm_constructor_options(tiny_llama_tok_dir, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama_tok_dir, **{"device": "cpu", **kwargs})
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("model, fragments", [
    pytest.param("/nonexistent/model", ("'/nonexistent/model'", "Hugging Face directory", ".gguf"), id="missing path"),
    pytest.param(123, ("123", "Hugging Face directory"), id="int"),
    pytest.param("", ("''", "Hugging Face directory"), id="empty string"),
    pytest.param(["model"], ("['model']",), id="list"),
])
def test_bad_model_argument(model, fragments):
    with pytest.raises(ValueError) as info:
        LLM(model, device="cpu")
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_model_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(tmp_path, device="cpu")


# ------------------------------------------------------------------------ generate
TOO_LONG = [5] * 65
GENERATE = {
    "no prompts": (([],), ValueError, "non-empty", "[]"),
    "prompts None": ((None,), ValueError, "None"),
    "empty string": (("",), ValueError, "prompt is empty"),
    "empty string in list": (([""],), ValueError, "prompt is empty"),
    "empty token list": (([[]],), ValueError, "prompt is empty"),
    "negative token id": (([-1, 5],), ValueError, f"[0, {VOCAB})", "-1"),
    "token id = vocab": (([[VOCAB]],), ValueError, f"[0, {VOCAB})", str(VOCAB)),
    "bool token": (([[1, True]],), ValueError, f"[0, {VOCAB})", "True"),
    "float token": (([[1, 2.0]],), ValueError, f"[0, {VOCAB})", "2.0"),
    "str token": (([[1, "a"]],), ValueError, f"[0, {VOCAB})", "'a'"),
    "None token": (([[1, None]],), ValueError, f"[0, {VOCAB})", "None"),
    "NaN token": (([[NAN]],), ValueError, f"[0, {VOCAB})", "nan"),
    "float prompt": (([1.5],), TypeError, "a string or a list of token ids", "1.5"),
    "tensor prompt": (([torch.tensor([1, 2])],), TypeError, "a string or a list of token ids", "Tensor"),
    "ids longer than max_model_len": (([TOO_LONG],), ValueError, "65 tokens", "max_model_len is 64"),
    "text longer than max_model_len": ((["word " * 200],), ValueError, "tokens but max_model_len is 64"),
    "one bad prompt among good": ((["fine", [VOCAB + 1], "also fine"],), ValueError, str(VOCAB + 1)),
    "params list too short": ((["a", "b", "c"], [GOOD, GOOD]), ValueError, "2 SamplingParams for 3 prompts"),
    "params list too long": ((["a"], [GOOD, GOOD]), ValueError, "2 SamplingParams for 1 prompts"),
    "params float": ((["a"], 0.5), TypeError, "SamplingParams", "0.5"),
    "params dict": ((["a"], {"temperature": 0}), TypeError, "SamplingParams", "{'temperature': 0}"),
    "params str": ((["a"], "greedy"), TypeError, "SamplingParams", "'greedy'"),
    "params None in list": ((["a"], [None]), TypeError, "SamplingParams", "None"),
    "stop token outside vocab": ((["a"], SamplingParams(stop_token_ids=[VOCAB])), ValueError, "stop_token_ids",
                                 str(VOCAB), f"[0, {VOCAB})"),
    "top_k above the vocabulary": ((["a"], SamplingParams(top_k=VOCAB + 1)), ValueError, "top_k",
                                   f"vocabulary size ({VOCAB})", str(VOCAB + 1)),
    "top_k 2**62": ((["a"], SamplingParams(top_k=2**62)), ValueError, "top_k", str(2**62)),
    "huge token id": (([[10**30]],), ValueError, f"[0, {VOCAB})", "an integer of 100 bits"),
}


@pytest.mark.parametrize("args, exc, fragments", [pytest.param(v[0], v[1], v[2:], id=k) for k, v in GENERATE.items()])
def test_bad_generate(llm, args, exc, fragments):
    assert_rejected(llm, lambda: llm.generate(*args), exc, *fragments)


def test_top_k_of_the_whole_vocabulary_is_allowed(llm):
    out = llm.generate([PROBE_PROMPT], SamplingParams(top_k=VOCAB, temperature=1.0, seed=0, max_tokens=2))[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) >= 1


def test_prompt_of_exactly_max_model_len_is_allowed(llm):
    out = llm.generate([[5] * 64], GOOD)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1  # no room for a second token


# ---------------------------------------------------------------------------- chat
HELLO = {"role": "user", "content": "hello"}
CHAT = {
    "empty list": (([],), "non-empty", "[]"),
    "None": ((None,), "non-empty", "None"),
    "bare string": (("hello",), "non-empty list", "'hello'"),
    "message without content": (([{"role": "user"}],), "'content': str", "{'role': 'user'}"),
    "content not a string": (([{"role": "user", "content": 5}],), "'content': str", "5"),
    "role not a string": (([{"role": 1, "content": "hi"}],), "'role': str", "1"),
    "empty conversation": (([[]],), "non-empty", "[]"),
    "string in a conversation": (([HELLO, "oops"],), "'oops'"),
    "bad second conversation": (([[HELLO], "oops"],), "'oops'"),
    "params count mismatch": (([[HELLO], [HELLO]], [GOOD]), "1 SamplingParams for 2 prompts"),
}


@pytest.mark.parametrize("args, fragments", [pytest.param(v[0], v[1:], id=k) for k, v in CHAT.items()])
def test_bad_chat(llm, args, fragments):
    assert_rejected(llm, lambda: llm.chat(*args), ValueError, *fragments)


def test_chat_without_a_chat_template(make_llm):
    bare = make_llm(with_tokenizer=False)
    assert_rejected(bare, lambda: bare.chat([HELLO]), ValueError, "no chat template")


# -------------------------------------------------------------------------- stream
STREAM = {
    "empty string": (("",), ValueError, "prompt is empty"),
    "negative id": (([-1],), ValueError, f"[0, {VOCAB})", "-1"),
    "None": ((None,), TypeError, "a string or a list of token ids", "None"),
    "too long": ((TOO_LONG,), ValueError, "max_model_len is 64"),
    "params list": (("hi", [GOOD]), TypeError, "SamplingParams", "[SamplingParams("),
}


@pytest.mark.parametrize("args, exc, fragments", [pytest.param(v[0], v[1], v[2:], id=k) for k, v in STREAM.items()])
def test_bad_stream(llm, args, exc, fragments):
    stream = llm.stream(*args)  # a generator: the checks run on the first next()
    assert_rejected(llm, lambda: next(stream), exc, *fragments)
    assert list(stream) == []


# ---------------------------------------------------------------- abort / add_request
@pytest.mark.parametrize("request_id, fragment", [
    ("nope", "'nope'"), (None, "None"), (5, "5"), (["x"], "['x']"), ("", "''")], ids=repr)
def test_abort_unknown_request(llm, request_id, fragment):
    assert_rejected(llm, lambda: llm.engine.abort(request_id), ValueError, "unknown request id", fragment)


def test_abort_finished_or_already_aborted_request(llm):
    done = llm.generate([PROBE_PROMPT], PROBE)[0].request_id
    assert_rejected(llm, lambda: llm.engine.abort(done), ValueError, "unknown request id", repr(done))
    rid = llm.engine.add_request("to abort", GOOD)
    assert llm.engine.abort(rid).finish_reason == "abort"
    assert_rejected(llm, lambda: llm.engine.abort(rid), ValueError, "unknown request id", repr(rid))


ADD_REQUEST = {
    "duplicate id": (("hi", GOOD, "bg"), ValueError, "'bg'", "already in use"),
    "empty id": (("hi", GOOD, ""), ValueError, "request_id", "non-empty string", "''"),
    "int id": (("hi", GOOD, 5), ValueError, "request_id", "non-empty string", "5"),
    "params str": (("hi", "greedy"), TypeError, "SamplingParams", "'greedy'"),
    "params dict": (("hi", {"temperature": 0}), TypeError, "SamplingParams", "'temperature'"),
    "prompt None": ((None, GOOD), TypeError, "a string or a list of token ids", "None"),
    "prompt bytes": ((b"hi", GOOD), TypeError, "a string or a list of token ids", "b'hi'"),
    "prompt int": ((7, GOOD), TypeError, "a string or a list of token ids", "7"),
    "prompt numpy array": ((np.array([1, 2]), GOOD), TypeError, "a string or a list of token ids", "array"),
    "numpy ints": (([np.int64(3)], GOOD), ValueError, f"[0, {VOCAB})", "3"),
    "empty prompt": (("", GOOD), ValueError, "prompt is empty"),
    "prompt too long": ((TOO_LONG, GOOD), ValueError, "65 tokens", "max_model_len is 64"),
    "token outside vocab": (([VOCAB + 5], GOOD), ValueError, f"[0, {VOCAB})", str(VOCAB + 5)),
    "stop token outside vocab": (("hi", SamplingParams(stop_token_ids=[VOCAB + 1])), ValueError, "stop_token_ids",
                                 str(VOCAB + 1)),
}


@pytest.mark.parametrize("args, exc, fragments", [pytest.param(v[0], v[1], v[2:], id=k)
                                                  for k, v in ADD_REQUEST.items()])
def test_bad_add_request(llm, args, exc, fragments):
    assert_rejected(llm, lambda: llm.engine.add_request(*args), exc, *fragments)


def test_max_num_seqs_left_unset_fits_a_small_budget():
    assert EngineConfig.from_kwargs(max_num_batched_tokens=16).max_num_seqs == 16
    assert EngineConfig.from_kwargs().max_num_seqs == 256
    assert EngineConfig.from_kwargs(max_num_batched_tokens=8, max_num_seqs=8).max_num_seqs == 8


def test_stop_strings_without_a_tokenizer_are_refused(make_llm):
    bare = make_llm(with_tokenizer=False)
    params = SamplingParams(max_tokens=4, stop=["end"])
    assert_rejected(bare, lambda: bare.engine.add_request([5, 6, 7], params), ValueError, "stop=['end']",
                    "no", "tokenizer", "stop_token_ids")
    assert_rejected(bare, lambda: bare.generate([[5, 6, 7]], params), ValueError, "stop=['end']")


def test_text_prompt_without_a_tokenizer(make_llm):
    bare = make_llm(with_tokenizer=False)
    assert_rejected(bare, lambda: bare.engine.add_request("hello", GOOD), ValueError, "no tokenizer",
                    "list of token ids")
    assert_rejected(bare, lambda: bare.generate("hello", GOOD), ValueError, "no tokenizer")


# --------------------------------------------------------------- next_token_logits
NEXT_TOKEN_LOGITS = {
    "empty string": ("", ValueError, "prompt is empty"),
    "empty list": ([], ValueError, "prompt is empty"),
    "negative id": ([-1], ValueError, f"[0, {VOCAB})", "-1"),
    "id = vocab": ([VOCAB], ValueError, f"[0, {VOCAB})", str(VOCAB)),
    "bool id": ([True], ValueError, "True"),
    "too long": (TOO_LONG, ValueError, "max_model_len is 64"),
    "int": (5, TypeError, "a string or a list of token ids", "5"),
    "None": (None, TypeError, "a string or a list of token ids", "None"),
}


@pytest.mark.parametrize("prompt, exc, fragments", [pytest.param(v[0], v[1], v[2:], id=k)
                                                    for k, v in NEXT_TOKEN_LOGITS.items()])
def test_bad_next_token_logits(llm, prompt, exc, fragments):
    assert_rejected(llm, lambda: llm.engine.next_token_logits(prompt), exc, *fragments)


def test_next_token_logits_with_a_full_pool(make_llm):
    full = make_llm(max_model_len=64, num_kv_blocks=8, block_size=8)
    full.engine.add_request([7] * 60, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    full.engine.step()  # its 60-token prompt now holds all 8 blocks
    assert full.engine.snapshot().num_free_blocks == 0
    assert_rejected(full, lambda: full.engine.next_token_logits([9] * 30), RuntimeError,
                    "not enough free KV blocks", "30-token prompt", "0 free")
    while full.engine.has_unfinished_requests():
        full.engine.step()
    logits = full.engine.next_token_logits([9] * 30)
    assert logits.shape == (VOCAB,) and math.isfinite(float(logits.max()))
