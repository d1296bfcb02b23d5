"""A fault is kept to the request that caused it (issue: no single request can stop the engine).

The inputs a request brings are checked before it is queued (``test_bad_input``), so what
is tested here is the safety net behind those checks: a bug that one request's data
reaches inside a step. Each test plants such a bug (a sampler, detokenizer or output
builder that raises on one request) and checks that

* that request ends with ``finish_reason == "error"`` and the exception in its output,
  its KV blocks freed;
* every other request of the same steps gives exactly the tokens it gives without the
  faulty one beside it (a seeded sampled request too: its generator is restored);
* the engine keeps its invariants and serves a plain request afterwards;

and that a fault no single request explains (the forward pass, or every request of a
batch) still stops the engine, as a bug of the engine itself must.
"""

from __future__ import annotations

import pytest

from nanoengine import SamplingParams
from nanoengine.engine.output_processor import OutputProcessor
from nanoengine.engine.scheduler import Scheduler
from nanoengine.layers.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

CONFIG = dict(device="cpu", max_model_len=64, num_kv_blocks=32, block_size=8)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PLAIN = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)  # no filter: the softmax path
MARKED_TOP_K = 7  # the planted bugs raise on requests with this top_k (or logprobs)
MARKED = SamplingParams(temperature=1.0, top_k=MARKED_TOP_K, max_tokens=8, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "Hello there", "Numbers: 1 2 3 1 2 3 1 2"]


@pytest.fixture(params=[False, True], ids=["plain", "speculative"])
def make_llm(request, build_tiny_llm):
    speculate = request.param
    return lambda: build_tiny_llm({**CONFIG, **({"speculative_config": NGRAM} if speculate else {})})


def _plant(monkeypatch, owner, name: str, raises_for) -> None:
    """Replace ``owner.name`` by a wrapper that raises when ``raises_for(*args)`` holds."""
    real = getattr(owner, name)

    def planted(*args, **kwargs):
        if raises_for(*args):
            raise RuntimeError("a planted bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(planted) if isinstance(owner.__dict__[name], staticmethod)
                        else planted)


def _plant_marked_sampler_bug(monkeypatch) -> None:
    """A sampler that raises on every batch holding a request with ``top_k == MARKED_TOP_K``."""
    _plant(monkeypatch, Sampler, "_candidate_probs",
           lambda logits, params: any(p.top_k == MARKED_TOP_K for p in params))


def _innocent_tokens(llm) -> list[tuple[int, ...]]:
    return [out.token_ids for out in llm.generate(PROMPTS[:3], [SEEDED, GREEDY, PLAIN])]


def _check_clean(llm) -> None:
    engine = llm.engine
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks  # nothing leaked
    assert llm.generate(PROMPTS[0], GREEDY)[0].finish_reason == "length"  # and it still serves


def test_a_sampler_fault_finishes_only_its_request(make_llm, monkeypatch):
    llm = make_llm()
    expected = _innocent_tokens(llm)
    _plant_marked_sampler_bug(monkeypatch)
    outs = llm.generate(PROMPTS, [SEEDED, GREEDY, PLAIN, MARKED])
    assert [out.token_ids for out in outs[:3]] == expected  # the seeded request drew as if alone
    assert all(out.finish_reason == "length" for out in outs[:3])
    failed = outs[3]
    assert failed.finish_reason == "error" and failed.outputs[0].error == "RuntimeError: a planted bug"
    assert failed.finished and failed.token_ids == ()
    monkeypatch.undo()
    _check_clean(llm)


def test_a_stream_that_the_engine_could_not_finish_raises_after_its_text(build_tiny_llm, monkeypatch):
    llm = build_tiny_llm(CONFIG)
    _plant_marked_sampler_bug(monkeypatch)
    with pytest.raises(RuntimeError, match="could not finish this request: RuntimeError: a planted bug"):
        list(llm.stream(PROMPTS[0], MARKED))
    monkeypatch.undo()
    _check_clean(llm)


def test_a_fault_on_every_request_of_a_batch_is_the_engines_and_stops_it(build_tiny_llm, monkeypatch):
    llm = build_tiny_llm(CONFIG)
    _plant(monkeypatch, Sampler, "_candidate_probs", lambda logits, params: True)
    filtered = SamplingParams(temperature=1.0, top_k=5, max_tokens=4)
    with pytest.raises(RuntimeError, match="a planted bug"):
        llm.generate(PROMPTS[:2], filtered)


def test_a_forward_pass_fault_is_the_engines_and_stops_it(build_tiny_llm, monkeypatch):
    llm = build_tiny_llm(CONFIG)
    runner = llm.engine.runner

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(runner, "sampled_hidden", broken)
    with pytest.raises(RuntimeError, match="the device fell over"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_a_detokenizer_fault_finishes_only_its_request(make_llm, monkeypatch):
    llm = make_llm()
    streamed = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=["never-seen"])
    expected = [out.token_ids for out in llm.generate(PROMPTS[:2], [SEEDED, streamed])]
    # Requests with stop strings are detokenized every step: the third one's raises at its third token.
    _plant(monkeypatch, OutputProcessor, "_detokenize",
           lambda self, request, detokenizer: request.sampling_params.max_tokens == 9
           and request.num_output_tokens >= 3)
    marked = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop=["never-seen"])
    outs = llm.generate(PROMPTS[:3], [SEEDED, streamed, marked])
    assert [out.token_ids for out in outs[:2]] == expected
    assert outs[2].finish_reason == "error" and "a planted bug" in outs[2].outputs[0].error
    monkeypatch.undo()
    _check_clean(llm)


def test_an_output_fault_finishes_only_its_request(build_tiny_llm, monkeypatch):
    llm = build_tiny_llm(CONFIG)
    expected = _innocent_tokens(llm)
    _plant(monkeypatch, OutputProcessor, "_token_logprobs", lambda self, token, entry: True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, [SEEDED, GREEDY, PLAIN, with_logprobs])
    assert [out.token_ids for out in outs[:3]] == expected
    assert outs[3].finish_reason == "error" and outs[3].logprobs is None
    monkeypatch.undo()
    _check_clean(llm)


def test_a_failed_request_with_several_completions_ends_as_a_whole(build_tiny_llm, monkeypatch):
    llm = build_tiny_llm(CONFIG)
    _plant_marked_sampler_bug(monkeypatch)
    events = []
    llm.engine.events.subscribe(events.append)
    four = SamplingParams(temperature=1.0, top_k=MARKED_TOP_K, max_tokens=8, n=4)
    outs = llm.generate(PROMPTS[:2], [four, GREEDY])
    assert [c.finish_reason for c in outs[0].outputs] == ["error"] * 4
    assert outs[1].finish_reason == "length"
    reasons = [e.finish_reason for e in events if type(e).__name__ == "RequestFinished"]
    assert reasons.count("error") == 4  # every completion, the ones still held back too
    monkeypatch.undo()
    _check_clean(llm)


def test_a_fault_in_the_stop_decision_stops_the_engine(build_tiny_llm, monkeypatch):
    """The scheduler's own bookkeeping is the engine's: a fault there is not contained."""
    llm = build_tiny_llm(CONFIG)
    _plant(monkeypatch, Scheduler, "finish_if_stopped", lambda self, request, stop=None: True)
    with pytest.raises(RuntimeError, match="a planted bug"):
        llm.generate(PROMPTS[:1], GREEDY)
