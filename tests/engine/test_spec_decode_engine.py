"""Speculative decoding in the engine: the output does not change, everything else still works.

Tiny random models fall into loops under greedy decoding, so prompt lookup finds its drafts
in their own output and many are accepted: both the accept and the reject paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoengine import LLM, LLMEngine, SamplingParams
from nanoengine.engine.model_runner import SamplingRunner
from nanoengine.events import DraftsVerified, RequestPreempted, StepFinished
from nanoengine.layers.sampler import Sampler
from nanoengine.metrics import Counter, Vector
from nanoengine.models.config import ModelConfig
from nanoengine.sampling_params import RequestOutputKind

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """Prompts that repeat a phrase of their own, so there is something to look up."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        prompts.append(noise + phrase * rng.randint(2, 4))
    return prompts


def _run(engine: LLMEngine, prompts, params, seen=None) -> list:
    if seen is not None:
        engine.events.subscribe(seen.append)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        _check_cached_blocks_hold_accepted_tokens(engine)
    return [done[i] for i in ids]


def _check_cached_blocks_hold_accepted_tokens(engine: LLMEngine) -> None:
    """Every block a running request has hashed holds exactly that request's tokens there."""
    size = engine.config.block_size
    for request in engine.scheduler.running:
        for i, digest in enumerate(request.block_hashes):
            block = engine.block_manager.blocks[request.block_ids[i]]
            if block.block_hash == digest:
                assert block.token_ids == tuple(request.all_token_ids[i * size:(i + 1) * size])
        assert len(request.block_ids) <= engine.block_manager.blocks_needed(request.num_tokens + len(request.spec_token_ids))


def _engine(path, speculate: bool, **kwargs) -> LLMEngine:
    options = dict(max_model_len=256, num_kv_blocks=128, block_size=8)
    options.update(kwargs)
    return LLMEngine.from_pretrained(path, speculative_config=NGRAM if speculate else None, **options)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_is_token_for_token_the_engines_without_speculation(tiny_llama_dir, k):
    prompts = _prompts(6, seed=k)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    plain = _run(_engine(tiny_llama_dir, False), prompts, params)
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=128, block_size=8,
                                       speculative_config={**NGRAM, "num_speculative_tokens": k})
    seen = []
    spec = _run(engine, prompts, params, seen)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = engine.spec_decode_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    verified = [e for e in seen if isinstance(e, DraftsVerified)]
    assert len(verified) == stats.num_drafts
    assert sum(e.num_accepted for e in verified) == stats.num_accepted_tokens
    assert max(len(e.draft_token_ids) for e in verified) <= k
    # fewer steps than tokens: accepted drafts are tokens gained
    steps = [e for e in seen if isinstance(e, StepFinished)]
    assert len(steps) < sum(len(o.outputs[0].token_ids) for o in spec) / len(prompts) + 10
    assert engine.block_manager.num_free_blocks == 128  # nothing leaked


def test_speculation_with_chunked_prefill_prefix_caching_and_preemption(tiny_llama_dir):
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(24)]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(_prompts(12, seed=11))]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * len(prompts)
    alone = [_run(_engine(tiny_llama_dir, False, num_kv_blocks=64), [p], [sp])[0] for p, sp in zip(prompts, params)]
    engine = _engine(tiny_llama_dir, True, max_model_len=128, num_kv_blocks=24, max_num_batched_tokens=32)
    seen = []
    together = _run(engine, prompts, params, seen)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert any(isinstance(e, RequestPreempted) for e in seen), "the small pool should force preemptions"
    assert engine.spec_decode_stats.num_accepted_tokens > 0
    steps = [e for e in seen if isinstance(e, StepFinished)]
    assert max(e.num_prefill_tokens + e.num_decode_tokens for e in steps) <= 32
    assert engine.block_manager.num_free_blocks == 24


def test_a_stop_or_the_length_inside_an_accepted_run_ends_the_request_there(tiny_llama_dir):
    prompts = _prompts(4, seed=5)
    free = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    reference = _run(_engine(tiny_llama_dir, False), prompts, free)
    cases = []
    for prompt, out in zip(prompts, reference):
        tokens = out.outputs[0].token_ids
        stop = tokens[len(tokens) // 2]  # a token the run reaches mid-way (perhaps earlier too)
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])))
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=len(tokens) // 2 + 1, ignore_eos=True)))
    prompts2, params2 = zip(*cases)
    plain = _run(_engine(tiny_llama_dir, False), prompts2, params2)
    engine = _engine(tiny_llama_dir, True)
    seen = []
    spec = _run(engine, prompts2, params2, seen)
    last_verify = {e.request_id: e for e in seen if isinstance(e, DraftsVerified)}
    cut = [rid for rid, e in last_verify.items()
           if not spec[int(rid)].outputs[0].token_ids[-len(e.emitted):] == e.emitted]
    assert cut, "some request should have stopped inside an accepted run, leaving tokens of it out"
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (a.outputs[0].finish_reason,
                                                                           a.outputs[0].stop_reason)
    assert engine.spec_decode_stats.num_accepted_tokens > 0


def test_stop_strings_streaming_and_logprobs_agree_with_plain_decoding(tiny_llama_tok_dir):
    rng = random.Random(2)
    phrase = [rng.randrange(1000, 20000) for _ in range(5)]
    prompt = phrase * 3
    plain = LLM(str(tiny_llama_tok_dir), max_model_len=256, num_kv_blocks=64)
    spec = LLM(str(tiny_llama_tok_dir), max_model_len=256, num_kv_blocks=64, speculative_config=NGRAM)
    free = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    reference = plain.generate([prompt], free, use_tqdm=False)[0].outputs[0]
    stop = reference.text[len(reference.text) // 2:][:6]
    assert stop
    for params in (free, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop], logprobs=1)):
        a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                         a.stop_reason)
        assert [[t.token_id for t in lp] for lp in b.logprobs] == [[t.token_id for t in lp] for lp in a.logprobs]
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    # A stream's deltas add up to the final text, several tokens at a time when drafts are accepted.
    streamed = "".join(spec.stream(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)))
    assert streamed == plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
    assert spec.engine.spec_decode_stats.num_accepted_tokens > 0
    names = {m.name: m for m in spec.get_metrics()}
    assert names["nanoengine:spec_decode_num_accepted_tokens"] == Counter(
        "nanoengine:spec_decode_num_accepted_tokens", spec.engine.spec_decode_stats.num_accepted_tokens)
    per_pos = names["nanoengine:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and sum(per_pos.values) == spec.engine.spec_decode_stats.num_accepted_tokens
    assert "nanoengine:spec_decode_num_drafts" not in {m.name for m in plain.get_metrics()}


def test_parallel_sampling_seeds_and_abort_with_speculation(tiny_llama_dir):
    prompts = _prompts(3, seed=9)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True, seed=123, n=3)
    first = _run(_engine(tiny_llama_dir, True), prompts, [params] * 3)
    again = _run(_engine(tiny_llama_dir, True), prompts, [params] * 3)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 30 for c in o.outputs) for o in first)
    engine = _engine(tiny_llama_dir, True)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)) for p in prompts]
    for _ in range(6):
        engine.step()
    final = engine.abort(ids[0])
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == 128


def test_verify_sampling_keeps_the_targets_filtered_distribution():
    """The runner's acceptance step with top-k and top-p: the first emitted token is distributed
    as the request's own filtered distribution, whatever the draft."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8) * 2
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    target = Sampler().distribution(logits[:1], [params])[0]
    config = ModelConfig(architecture="LlamaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=8,
                         max_position_embeddings=64)
    runner = SamplingRunner(config, num_blocks=1, block_size=16, device=torch.device("cpu"), seed=1)  # sampling only

    class Stub:  # what sample_requests reads of a request
        sampling_params, generator, request_id = params, None, "r"

    draft = int(target.argsort()[-2])  # a likely, not the likeliest, token
    counts = torch.zeros(8)
    n = 20_000
    for _ in range(n):
        tokens, _ = runner.sample_requests(logits, [Stub()], [(draft,)])
        counts[tokens[0][0]] += 1
    assert torch.allclose(counts / n, target, atol=0.012), (counts / n, target)
    assert counts[target == 0].sum() == 0  # a filtered-out token is never emitted


def test_bad_speculative_configs_are_refused_before_anything_loads(tmp_path):
    missing = tmp_path / "no-such-model"
    for config, message in [({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                            ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                            ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
                            ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config key"),
                            ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            LLM(str(missing), speculative_config=config)


def test_delta_outputs_hand_out_every_accepted_token_once(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, True)
    prompt = _prompts(1, seed=4)[0]
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                    output_kind=RequestOutputKind.DELTA))
    pieces, sizes = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces += out.outputs[0].token_ids
            sizes.append(len(out.outputs[0].token_ids))
    assert len(pieces) == 40 and max(sizes) > 1
    plain = _run(_engine(tiny_llama_dir, False), [prompt], [SamplingParams(temperature=0.0, max_tokens=40,
                                                                           ignore_eos=True)])
    assert tuple(pieces) == plain[0].outputs[0].token_ids
    assert rid not in engine.requests


def test_a_batch_size_schedule_drafts_only_at_the_sizes_it_allows(tiny_llama_dir):
    """k=4 for a step of one request, none for two or more (vLLM's dynamic speculative decoding)."""
    prompts = _prompts(3, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts)
    plain = _run(_engine(tiny_llama_dir, False), prompts, params)
    engine = LLMEngine.from_pretrained(tiny_llama_dir, max_model_len=256, num_kv_blocks=128, block_size=8,
                                       speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size":
                                                           [[1, 1, 4], [2, 256, 0]]})
    seen = []
    together = _run(engine, prompts, params, seen)  # three at once: nothing drafted
    assert not any(isinstance(e, DraftsVerified) for e in seen)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in plain]
    alone = [_run(engine, [p], [sp], seen)[0] for p, sp in zip(prompts, params)]  # one at a time: drafts
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in plain]
    assert engine.spec_decode_stats.num_drafts > 0
    assert all(len(e.draft_token_ids) <= 4 for e in seen if isinstance(e, DraftsVerified))
