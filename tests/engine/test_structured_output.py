"""Structured output in the engine (chapter 14): every output satisfies its constraint, nothing else changes.

A tiny Llama with random weights and SmolLM2's tokenizer writes nonsense, which is the point:
whatever it prefers, the mask leaves it only tokens its constraint allows, so every finished
output must parse, and an unfinished one must be a prefix the grammar accepts. The real
model's outputs are checked against their schemas in ``test_structured_output_model.py``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output import allocate_token_bitmask, apply_token_bitmask
from nanoengine.structured_output.guidance import GuidanceBackend

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "pattern": "^[a-z]{2}$"}},
          "required": ["ok", "level", "tag"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: sum "=" NUMBER\nsum: NUMBER ("+" NUMBER)?\nNUMBER: /[1-9]/'
# With no optional whitespace, each of these ends within a few dozen tokens whatever the model says.
CONFIG = {"structured_outputs_config": {"disable_any_whitespace": True}}


def constraint(kind: str) -> StructuredOutputsParams:
    return {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES),
            "grammar": StructuredOutputsParams(grammar=GRAMMAR)}[kind]


def satisfies(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"[1-9](\+[1-9])?=[1-9]", text) is not None


def run(engine: LLMEngine, prompts, params) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert not engine.structured_output.pending
    return [done[i] for i in ids]


PROMPTS = ["The answer is", "Write JSON:", "x" * 40, "Hello, my name is", "1 2 3 4 5 6 7 8"]


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_satisfies_its_constraint(build_tiny_llm, kind, temperature):
    llm = build_tiny_llm(CONFIG)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured_outputs=constraint(kind))
              for i in range(len(PROMPTS))]
    outputs = run(llm.engine, PROMPTS, params)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert satisfies(kind, completion.text), completion.text
        assert completion.stop_reason is None


def test_constrained_and_free_requests_share_a_step_and_the_free_ones_do_not_change(build_tiny_llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=12, ignore_eos=True)]
    alone = run(build_tiny_llm(CONFIG).engine, PROMPTS[:2], free)
    engine = build_tiny_llm(CONFIG).engine
    steps_shared = []
    engine.events.subscribe(lambda e: steps_shared.append(e) if type(e).__name__ == "BatchPrepared" else None)
    mixed = run(engine, PROMPTS[:4], free + [SamplingParams(temperature=0.0, max_tokens=40,
                                                            structured_outputs=constraint(k)) for k in ("json", "regex")])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert any(len(e.rows) == 4 for e in steps_shared)  # all four in one step
    assert satisfies("json", mixed[2].outputs[0].text) and satisfies("regex", mixed[3].outputs[0].text)


@pytest.mark.parametrize("kind", ["json", "grammar"])
def test_greedy_output_is_the_same_with_speculation(build_tiny_llm, kind):
    # Prompts that repeat themselves give prompt lookup drafts; some of them the grammar refuses.
    prompts = ['{"ok":true,"level":1,"tag":"ab"} {"ok":true,"level":1,"tag":"ab"} {"ok":',
               "1+2=3 1+2=3 1+2=3 1+2=3 1+", "tag tag tag tag level level"]
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=constraint(kind))] * len(prompts)
    plain = run(build_tiny_llm(CONFIG).engine, prompts, params)
    speculating = build_tiny_llm({**CONFIG, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1}})
    spec = run(speculating.engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert speculating.engine.spec_decode_stats.num_draft_tokens > 0  # drafts were checked under the mask
    for out in spec:
        assert satisfies(kind, out.outputs[0].text)


def test_sampled_output_with_speculation_satisfies_the_constraint(build_tiny_llm):
    llm = build_tiny_llm({**CONFIG, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 2, "prompt_lookup_min": 1}})
    prompts = ["1+1=2 1+1=2 1+1=2 1+"] * 4
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, structured_outputs=constraint("grammar"))
              for i in range(4)]
    for out in run(llm.engine, prompts, params):
        assert satisfies("grammar", out.outputs[0].text)


def test_n_completions_each_have_their_own_grammar(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    out, = run(llm.engine, ["Pick one:"], [SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20,
                                                         structured_outputs=constraint("choice"))])
    assert len(out.outputs) == 4
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.outputs)


def test_preemption_chunked_prefill_and_the_prefix_cache_change_nothing(build_tiny_llm):
    prompts = ["shared prefix " * 6 + str(i) for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint("json"))] * len(prompts)
    roomy = run(build_tiny_llm(CONFIG).engine, prompts, params)
    engine = build_tiny_llm({**CONFIG, "num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 24,
                             "max_num_seqs": 6, "max_model_len": 96}).engine
    tight = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_logprobs_are_those_of_the_masked_distribution(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    out, = run(llm.engine, ["Say:"], [SamplingParams(temperature=1.0, seed=0, max_tokens=8, logprobs=20,
                                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))])
    completion = out.outputs[0]
    assert completion.text in ("yes", "no")
    first = completion.logprobs[0]  # the top 20 of the masked distribution at the first position
    allowed = [lp for lp in first if lp.logprob > float("-inf")]
    assert 2 <= len(allowed) < 20  # "y", "yes", "n", "no", ...: every token that starts a choice, and nothing else
    assert all("yes".startswith(lp.text) or "no".startswith(lp.text) for lp in allowed), allowed
    assert float(torch.tensor([lp.logprob for lp in allowed]).exp().sum()) == pytest.approx(1.0, abs=1e-5)
    assert completion.token_ids[0] in {lp.token_id for lp in allowed}


def test_a_constraint_that_does_not_compile_is_refused_before_anything_changes(build_tiny_llm):
    engine = build_tiny_llm(CONFIG).engine
    engine.add_request("ok", SamplingParams(max_tokens=2))
    before = (len(engine.scheduler.waiting), engine.block_manager.num_free_blocks)
    for bad, reason in [(StructuredOutputsParams(regex="[0-9"), "unclosed character class"),
                        (StructuredOutputsParams(grammar="start: missing_rule"), "missing_rule"),
                        (StructuredOutputsParams(json={"type": "no-such-type"}), "no-such-type")]:
        with pytest.raises(ValueError, match=re.escape(reason)) as err:
            engine.add_request("x", SamplingParams(structured_outputs=bad))
        assert "does not compile" in str(err.value)
    assert (len(engine.scheduler.waiting), engine.block_manager.num_free_blocks) == before
    assert not engine.structured_output.pending
    run(engine, [], [])


def test_a_grammar_that_fails_to_compile_on_its_thread_ends_its_request_with_the_reason(build_tiny_llm, monkeypatch):
    engine = build_tiny_llm(CONFIG).engine
    backend = engine.structured_output.backend

    def broken(kind, spec):
        raise ValueError("the library ran out of states")

    monkeypatch.setattr(backend, "compile_grammar", broken)
    bad = engine.add_request("x", SamplingParams(max_tokens=4, structured_outputs=constraint("regex")))
    good = engine.add_request("y", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[bad].outputs[0].finish_reason == "error"
    assert "ran out of states" in done[bad].outputs[0].error
    assert len(done[good].outputs[0].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_a_token_the_grammar_refuses_is_never_emitted(build_tiny_llm, monkeypatch):
    """Without its mask the model samples freely; the grammar then refuses the token: the
    request ends with an error naming it, and the token is not in the output."""
    import nanoengine.engine.model_runner as model_runner

    engine = build_tiny_llm(CONFIG).engine
    monkeypatch.setattr(model_runner, "apply_token_bitmask", lambda logits, bitmask: None)
    rid = engine.add_request("x", SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint("regex")))
    other = engine.add_request("y", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    completion = done[rid].outputs[0]
    assert completion.finish_reason == "error" and "does not allow it" in completion.error
    assert re.fullmatch(r"[0-9]{0,3}", completion.text)  # what it emitted before was allowed
    assert len(done[other].outputs[0].token_ids) == 8


def test_aborting_a_request_that_waits_for_its_grammar(build_tiny_llm):
    engine = build_tiny_llm(CONFIG).engine
    rid = engine.add_request("x", SamplingParams(max_tokens=4, structured_outputs=constraint("json")))
    out = engine.abort(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.step() == [] and not engine.structured_output.pending and not engine.has_unfinished_requests()


def test_an_engine_without_a_tokenizer_says_structured_output_needs_one(build_tiny_llm):
    engine = build_tiny_llm({}, with_tokenizer=False).engine
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=constraint("regex")))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, regex, choice, grammar or json_object=True; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON text"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": 3}, "a dict or its text"),
    ({"choice": []}, "1 to 1024 strings"),
    ({"choice": "abc"}, "a list of strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": "x" * 70_000}, "at most 65536"),
    ({"json_object": "yes"}, "True, False or None"),
])
def test_params_refuse_a_bad_constraint_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_and_engine_config_refuse_the_wrong_types():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="backend='xgrammarx' is not available"):
        EngineConfig(device="cpu", structured_outputs_config={"backend": "xgrammarx"})
    with pytest.raises(ValueError, match=r"unknown structured_outputs_config key\(s\) \['whitespace'\]"):
        EngineConfig(device="cpu", structured_outputs_config={"whitespace": False})
    assert StructuredOutputsParams(json={"type": "object"}).spec == '{"type": "object"}'
    assert StructuredOutputsParams(json_object=True, regex=None).kind == "json_object"


def test_the_bitmask_forbids_exactly_the_cleared_bits():
    logits = torch.zeros(2, 70)
    bitmask = allocate_token_bitmask(2, 70)
    assert bitmask.shape == (2, 3)
    bitmask[0, 0] = 0b101  # row 0: tokens 0 and 2 of the first 32, all of 32..69
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 5  # row 1: token 69 only
    apply_token_bitmask(logits, bitmask)
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert allowed[0] == {0, 2} | set(range(32, 70))
    assert allowed[1] == {69}


def test_draft_rows_get_the_mask_after_each_draft_and_the_grammar_is_left_as_it_was(tiny_llama_tok_dir):
    from nanoengine.engine.request import Request
    from nanoengine.loader.weights import load_tokenizer
    from nanoengine.structured_output.manager import StructuredOutputRequest, fill_rows

    tokenizer = load_tokenizer(tiny_llama_tok_dir)
    backend = GuidanceBackend(tokenizer, 49152, (tokenizer.eos_token_id,))
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab][cd]")))
    request.structured_output = StructuredOutputRequest(None)
    request.structured_output.grammar = backend.compile_grammar("regex", "[ab][cd]")
    a, c = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "c"))
    bitmask = allocate_token_bitmask(3, 49152)
    fill_rows(request, (a, c), bitmask, 0)
    logits = torch.zeros(3, 49152)
    apply_token_bitmask(logits, bitmask)
    allowed = [torch.nonzero(row > float("-inf")).flatten().tolist() for row in logits]
    assert a in allowed[0] and c not in allowed[0]
    assert c in allowed[1] and a not in allowed[1]
    assert allowed[2] == [tokenizer.eos_token_id]  # complete: only EOS may follow
    assert request.structured_output.grammar.validate_tokens([a, c]) == [a, c]  # rolled back to the start


def test_a_copy_of_the_input_processor_in_another_process_still_refuses_what_does_not_compile(build_tiny_llm):
    """A server whose engine core runs in a process of its own checks requests with a pickled copy
    of the engine's input processor: its constraint check goes with it, without threads or grammars."""
    import pickle

    engine = build_tiny_llm(CONFIG).engine
    engine.add_request("x", SamplingParams(max_tokens=2, structured_outputs=constraint("regex")))  # a thread, a grammar
    copy = pickle.loads(pickle.dumps(engine.input_processor))
    with pytest.raises(ValueError, match="does not compile"):
        copy.check_params(SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert copy.check_params(SamplingParams(structured_outputs=constraint("json"))).structured_outputs.json == SCHEMA
    run(engine, [], [])


def test_a_stop_string_ends_a_constrained_request_where_it_appears(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    out, = run(llm.engine, ["Pick:"], [SamplingParams(temperature=0.0, max_tokens=20, stop=["delta"],
                                                     structured_outputs=StructuredOutputsParams(choice=["gamma delta"]))])
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "delta"
    assert completion.text == "gamma "  # the constraint's text up to the stop string, as without a constraint


def test_an_idle_step_waits_for_a_slow_compile_only_briefly(build_tiny_llm, monkeypatch):
    """Nothing else to run: the step waits for the compile, but returns within WAIT_S so that its
    caller (a server's engine loop) can still take an abort."""
    import threading
    import time

    from nanoengine.structured_output import manager

    engine = build_tiny_llm(CONFIG).engine
    backend = engine.structured_output.backend
    release = threading.Event()
    compile_grammar = backend.compile_grammar

    def slow(kind, spec):
        release.wait(10)
        return compile_grammar(kind, spec)

    monkeypatch.setattr(backend, "compile_grammar", slow)
    rid = engine.add_request("x", SamplingParams(max_tokens=2, structured_outputs=constraint("regex")))
    start = time.perf_counter()
    assert engine.step() == []
    assert 0.9 * manager.WAIT_S <= time.perf_counter() - start < 5  # it waited, and came back
    assert engine.abort(rid).outputs[0].finish_reason == "abort"
    release.set()
    assert engine.step() == [] and not engine.structured_output.pending
