"""End-to-end behaviour of LLMEngine / LLM on tiny random checkpoints."""

from __future__ import annotations

import ast
import inspect
import random
import textwrap

import pytest

from nanoengine import LLM, LLMEngine, SamplingParams
from nanoengine.events import BlockStored, PrefixCacheHit, RequestPreempted, StepFinished

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int, vocab: int = 512, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run_all(engine: LLMEngine, prompts, params, check=True) -> dict[str, tuple[int, ...]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if check:
            engine.check_invariants()
    return [done[i] for i in ids]


@pytest.mark.slow
def test_batch_invariance_with_chunking_prefix_cache_and_preemption(tiny_llama_dir):
    """32 mixed requests together give exactly the greedy tokens each gives alone."""
    rng = random.Random(7)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = _prompts(32, seed=1)
    prompts = [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts)]  # some share a prefix
    alone_engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64,
                                             enable_prefix_caching=False)
    alone = [_run_all(alone_engine, [p], [GREEDY])[0] for p in prompts]

    # A pool far smaller than 32 requests need, a small token budget: chunked prefills,
    # prefix hits and preemptions all happen.
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=40, block_size=8,
                                       max_num_batched_tokens=64)
    seen = []
    engine.events.subscribe(seen.append)
    together = _run_all(engine, prompts, [GREEDY] * len(prompts))
    assert together == alone
    assert any(isinstance(e, RequestPreempted) for e in seen), "the small pool should force preemptions"
    assert any(isinstance(e, PrefixCacheHit) for e in seen)
    steps = [e for e in seen if isinstance(e, StepFinished)]
    assert max(e.num_prefill_tokens + e.num_decode_tokens for e in steps) <= 64
    assert any(e.num_prefill_tokens and e.num_decode_tokens for e in steps), "prefill chunks mix with decodes"
    assert engine.snapshot().num_free_blocks == 40  # everything returned


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=128)
    prompt = _prompts(1, seed=3)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _run_all(engine, [prompt], [seeded])[0]
    others = _prompts(7, seed=4)
    mixed = _run_all(engine, [prompt] + others,
                     [seeded] + [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * 7)
    assert mixed[0] == alone
    other_seed = _run_all(engine, [prompt], [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                                            max_tokens=20, ignore_eos=True)])[0]
    assert other_seed != alone


def test_from_engine_wraps_the_engine_it_is_given(tiny_llama_dir):
    """``LLM.from_engine`` drives that very engine: same greedy tokens as stepping it by hand."""
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    prompt = _prompts(1, seed=6)[0]
    by_hand = _run_all(engine, [prompt], [GREEDY])[0]
    llm = LLM.from_engine(engine)
    assert llm.engine is engine
    assert llm.generate([prompt], GREEDY)[0].token_ids == by_hand
    assert engine.snapshot().num_free_blocks == 64


def test_prefix_cache_hit_gives_the_same_output_and_reports_cached_tokens(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64, block_size=16)
    prompt = _prompts(1, seed=5, lo=70, hi=70)[0]
    llm = LLM.from_engine(engine)
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # 4 full blocks of 16; the last token is recomputed
    assert second.token_ids == first.token_ids
    cold = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64,
                                     enable_prefix_caching=False)
    assert _run_all(cold, [prompt], [GREEDY])[0] == first.token_ids
    assert engine.snapshot().prefix_cache_hits == 64


def test_full_blocks_are_stored_in_the_prefix_cache(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64, block_size=16)
    stored = []
    engine.events.subscribe(lambda e: stored.append(e) if isinstance(e, BlockStored) else None)
    _run_all(engine, [list(range(1, 41))], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)])
    # 40 prompt + 29 computed output tokens = 69 computed -> 4 full blocks
    assert len(stored) == 4
    assert engine.snapshot().num_cached_blocks == 4


def test_abort_running_request_frees_blocks_and_spares_others(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    a = engine.add_request(list(range(1, 50)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = engine.add_request(list(range(60, 90)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.snapshot().num_free_blocks < 64
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    engine.check_invariants()
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert finished[b].finish_reason == "length" and len(finished[b].token_ids) == 10
    alone = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    assert _run_all(alone, [list(range(60, 90))], [SamplingParams(temperature=0, max_tokens=10,
                                                                  ignore_eos=True)])[0] == finished[b].token_ids
    assert engine.snapshot().num_free_blocks == 64


@pytest.mark.slow
def test_prefill_first_policy_gives_same_tokens(tiny_llama_dir):
    prompts = _prompts(10, seed=11)
    fcfs = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=48, block_size=8,
                                     max_num_batched_tokens=96)
    pf = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=48, block_size=8,
                                   max_num_batched_tokens=96, scheduling_policy="prefill_first")
    seen = []
    pf.events.subscribe(lambda e: seen.append(e) if isinstance(e, StepFinished) else None)
    assert _run_all(pf, prompts, [GREEDY] * 10) == _run_all(fcfs, prompts, [GREEDY] * 10)
    assert not any(e.num_prefill_tokens and e.num_decode_tokens for e in seen), "prefill_first never mixes"


def test_max_model_len_ends_a_request_with_length(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=40, num_kv_blocks=16)
    out = _run_all(engine, [list(range(1, 31))], [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)])
    assert len(out[0]) == 10


def test_stop_token_ids_end_generation(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    free_run = _run_all(engine, [list(range(5, 25))], [GREEDY])[0]
    stop_at = free_run[5]
    stopped = _run_all(engine, [list(range(5, 25))],
                       [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True)])[0]
    assert stopped == free_run[:free_run.index(stop_at) + 1]


def test_logprobs_are_returned_and_consistent(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    llm = LLM.from_engine(engine)
    out = llm.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                            ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token, entries in zip(out.token_ids, out.logprobs):
        assert entries[0].token_id == token
        assert entries[0].logprob == max(e.logprob for e in entries)  # greedy picks the top token
        assert all(e.logprob <= 0 for e in entries)


def test_metrics_are_ordered(tiny_llama_dir):
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=64)
    llm = LLM.from_engine(engine)
    m = llm.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft > 0 and m.tpot > 0 and m.num_output_tokens == 6


@pytest.mark.slow
def test_streaming_deltas_concatenate_to_the_final_text(tiny_llama_tok_dir):
    llm = LLM(tiny_llama_tok_dir, max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)
    streamed = "".join(llm.stream("안녕하세요 🙂 tell me", params))
    final = llm.generate(["안녕하세요 🙂 tell me"], params)[0]
    assert streamed == final.text
    assert "\ufffd" not in streamed or "\ufffd" in final.text


@pytest.mark.slow
def test_stream_closed_early_aborts_and_frees(tiny_llama_tok_dir):
    llm = LLM(tiny_llama_tok_dir, max_model_len=256, num_kv_blocks=64)
    stream = llm.stream("hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.snapshot().num_free_blocks == 64


def test_a_model_object_serves_one_engine_only():
    from nanoengine.loader.weights import build_model, init_random_weights
    from nanoengine.models.config import ModelConfig

    import torch

    config = ModelConfig(architecture="LlamaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                         max_position_embeddings=64)
    net = build_model(config, torch.device("cpu"), torch.float32)
    init_random_weights(net)
    LLMEngine.from_model(net, num_kv_blocks=8, max_model_len=64, device="cpu")
    with pytest.raises(ValueError, match="already bound to another engine"):
        LLMEngine.from_model(net, num_kv_blocks=8, max_model_len=64, device="cpu")


def test_reset_prefix_cache_and_eviction_count(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", block_size=4, num_kv_blocks=8, max_model_len=32)
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.snapshot().num_cached_blocks == 3
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens == 12
    assert llm.reset_prefix_cache() == 3 and llm.engine.snapshot().num_cached_blocks == 0
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens == 0
    assert llm.engine.reset_prefix_cache() == 3
    # A pool of 8 blocks: a 30-token request needs all of them, evicting every cached block.
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    llm.generate([list(range(100, 130))], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.snapshot().num_evictions >= 3


class _NoScans(dict):
    """A dict that refuses to be walked: add_request must not look at every live request."""

    def __iter__(self):
        raise AssertionError("add_request walked every live request")

    keys = values = items = __iter__


def test_add_request_checks_ids_without_walking_the_live_requests():
    from nanoengine.loader.weights import random_model

    engine = LLMEngine.from_model(random_model("tiny-llama", std=0.08), None, device="cpu", block_size=4,
                                  num_kv_blocks=64, max_model_len=32, max_num_seqs=4)
    for i in range(50):
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=2), request_id=f"r{i}")
    engine.output_processor.states = _NoScans(engine.output_processor.states)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, n=2), request_id="fan")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], SamplingParams(max_tokens=1), request_id="r7")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], SamplingParams(max_tokens=1), request_id="1_fan")  # a completion's id
    engine.output_processor.states = dict(dict.items(engine.output_processor.states))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert not engine.output_processor.completions_by_id  # every id was given back when its request finished
    engine.add_request([3], SamplingParams(max_tokens=1), request_id="r7")  # free again
    engine.abort("r7")
    assert not engine.output_processor.id_in_use("r7")


def test_step_and_the_methods_only_it_calls_fit_in_40_lines():
    """Engine v4's budget for the loop a reader opens first: ``step`` plus every private ``LLMEngine``
    method that only its path calls, docstrings included (one that ``add_request`` or ``abort`` also
    calls, such as ``_finish_all``, is not the step's). The rest lives with its owner: scheduler,
    runner, output processor, structured output, proposer."""
    (cls,) = ast.parse(textwrap.dedent(inspect.getsource(LLMEngine))).body
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}

    def called(function: ast.FunctionDef) -> set[str]:
        return {node.func.attr for node in ast.walk(function) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self" and node.func.attr in methods}

    path, todo = {"step"}, ["step"]
    while todo:
        for name in called(methods[todo.pop()]) - path:
            if name.startswith("_"):
                path.add(name)
                todo.append(name)
    shared = {name for name in path if any(name in called(f) for other, f in methods.items() if other not in path)}
    owned = path - shared
    lines = {name: methods[name].end_lineno - methods[name].lineno + 1 for name in owned}
    assert {"step", "_step"} <= owned and "_finish_all" in shared  # the walk sees the path it is meant to
    assert sum(lines.values()) <= 40, f"step and the methods only it calls take {sum(lines.values())} lines: {lines}"
