"""Tests for widgets.spec_decode_stepper: one live request stepped draft -> verify -> accept/reject.

On a tiny random model (greedy decoding falls into loops, so prompt lookup finds drafts in
the request's own output and both accepted and rejected drafts occur). What the stepper
records must be what the engine did: its counters, its output without speculation, its
blocks.
"""

from __future__ import annotations

import html

import pytest

from nanoengine import SamplingParams
from nanoengine.events import DraftsVerified, StepFinished
from nanoengine.spec_decode import propose_ngram
from widgets import single_thread, tiny_engine
from widgets._common import token_label
from widgets.spec_decode_stepper import (SpecDecodeStepper, SpecDecodeStepperController, chip, find_ngram_match,
                                         parse_token_ids)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPT = [101, 102, 103, 104, 105, 106] * 3  # a phrase repeated: something to look up
MAX_TOKENS = 40


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():  # tiny matmuls: thread wake-ups cost more than the work
        yield


def make_engine(speculate: bool = True, **kwargs):
    # seed 2: its greedy output loops, so drafts are accepted, and it leaves the loop, so some are rejected
    options = dict(seed=2, max_model_len=128, num_kv_blocks=64, block_size=4)
    options.update(kwargs)
    return tiny_engine(speculative_config=NGRAM if speculate else None, **options)


def plain_output(prompt: list[int], params: SamplingParams) -> tuple[int, ...]:
    """The same greedy request on the same weights without speculation."""
    engine = make_engine(speculate=False)
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("the request never finished")


def block_ids(controller: SpecDecodeStepperController) -> tuple[int, ...]:
    snap = controller.engine.snapshot()
    return next((r.block_ids for r in (*snap.running, *snap.waiting) if r.request_id == controller.request_id), ())


def test_stepping_to_the_end_matches_the_engine_and_plain_decoding() -> None:
    engine = make_engine()
    seen = []
    engine.events.subscribe(seen.append, DraftsVerified)
    c = SpecDecodeStepperController(engine, PROMPT, max_tokens=MAX_TOKENS)
    held: list[int] = []
    while not c.finished:
        proposed_before = c.next_drafts
        record = c.step()
        assert record is not None and not record.elsewhere
        # the drafts checked are the ones proposed after the previous step (all fit: one request)
        assert record.proposed == proposed_before and record.drafts == proposed_before
        assert record.emitted[:record.num_accepted] == record.accepted
        assert record.appended == record.emitted  # no stop cut a run here
        # blocks: what the events say was allocated and freed is what the request holds
        held = [b for b in held + list(record.blocks_allocated) if b not in record.blocks_freed]
        assert sorted(held) == sorted(block_ids(c)) or c.finished
        # the next drafts are the engine's, and the match shown is where they came from
        assert record.next_drafts == c.next_drafts
        if c.next_drafts:
            tokens = PROMPT + c.output_token_ids
            spec = c.spec_config
            assert list(c.next_drafts) == propose_ngram(tokens, len(c.next_drafts), spec.prompt_lookup_max,
                                                        spec.prompt_lookup_min)
            match = c.ngram_match()
            assert match.drafts == c.next_drafts
            assert tokens[match.start:match.start + match.n] == tokens[len(tokens) - match.n:]
            # earliest occurrence of the longest suffix: no longer suffix occurs before the last token
            assert all(not propose_ngram(tokens, 1, n, n) for n in range(match.n + 1, spec.prompt_lookup_max + 1))
            assert all(tokens[i:i + match.n] != tokens[len(tokens) - match.n:] for i in range(match.start))
        engine.check_invariants()
    assert c.finish_reason == "length" and held == [] and block_ids(c) == ()

    stats = engine.spec_decode_stats
    assert sum(s.num_accepted for s in c.steps) == stats.num_accepted_tokens == c.stats.num_accepted_tokens
    assert sum(len(s.drafts) for s in c.steps) == stats.num_draft_tokens
    assert c.stats.as_dict() == stats.as_dict()  # one request: its counters are the engine's
    assert [(s.drafts, s.emitted) for s in c.steps if s.drafts] == [(e.draft_token_ids, e.emitted) for e in seen]
    assert c.stats.num_accepted_tokens > 0 and any(s.rejected is not None for s in c.steps)

    assert tuple(c.output_token_ids) == plain_output(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert c.num_output_tokens == MAX_TOKENS
    assert any(len(s.appended) > 1 for s in c.steps)
    assert c.num_steps < c.num_output_tokens
    assert c.steps_saved == c.num_output_tokens - c.num_steps == c.stats.num_accepted_tokens  # a one-chunk prefill
    origins = c.token_origins
    assert origins.count("draft") == c.stats.num_accepted_tokens and len(origins) == MAX_TOKENS
    with pytest.raises(ValueError, match="has finished"):
        c.step()
    c.close()


def test_a_stop_inside_an_accepted_run_cuts_it() -> None:
    # Drafts are copies of earlier context, so for a stop token to show up first inside an
    # accepted run, the run must copy the prompt: give the prompt the start of the loop the
    # model falls into (its greedy continuation is then the rest of the loop).
    prompt = PROMPT + list(plain_output(PROMPT, SamplingParams(temperature=0.0, max_tokens=12)))
    reference = SpecDecodeStepperController(make_engine(), prompt, max_tokens=12)
    reference.run_to_end()
    output, start, candidates = reference.output_token_ids, 0, []
    for s in reference.steps:  # an accepted draft, not the run's first token, new to the output
        candidates += [(token, start + i) for i, token in enumerate(s.emitted[:-1])
                       if i and token not in output[:start + i]]
        start += len(s.appended)
    assert candidates, "no accepted run to cut on this model"
    stop, position = candidates[0]
    view = SpecDecodeStepper(make_engine(), prompt, max_tokens=12,
                             params=SamplingParams(temperature=0.0, stop_token_ids=(stop,)))
    view.run_button.click()
    c = view.controller
    last = c.steps[-1]
    assert c.finish_reason == "stop" and last.finish_reason == "stop"
    assert last.appended[-1] == stop and last.num_cut > 0 and last.appended == last.emitted[:len(last.appended)]
    assert c.output_token_ids == output[:position + 1]  # what plain decoding would stop with
    assert "ne-chip-cut" in view.last_step.value and "cut off by the stop" in view.last_step.value
    assert last.blocks_freed and "the request finished" in view.last_step.value


def test_the_view_shows_accepted_rejected_and_unchecked_chips() -> None:
    view = SpecDecodeStepper(make_engine(), PROMPT, max_tokens=MAX_TOKENS)
    c = view.controller
    assert "no step yet" in view.last_step.value
    view.step_button.click()
    assert "prefill of 18 prompt token(s)" in view.last_step.value and "ne-chip-model" in view.last_step.value
    kinds_seen = set()
    while not c.finished:
        if c.next_drafts:  # the proposed drafts and where they were found
            match = c.ngram_match()
            assert view.lookup.value.count("ne-chip-proposed") == len(c.next_drafts)
            assert f'data-match-start="{match.start}" data-n="{match.n}"' in view.lookup.value
        view.step_button.click()
        s, shown = c.steps[-1], view.last_step.value
        assert f'data-step="{s.step}"' in shown and "ne-msg-ok" in view.message.value
        assert shown.count("ne-chip-accepted") == 2 * s.num_accepted  # in the check row and in the output row
        assert shown.count("ne-chip-rejected") == (s.rejected is not None)
        assert shown.count("ne-chip-unchecked") == len(s.unchecked)
        if s.drafts:
            kinds_seen.add(s.model_token_kind)
            assert f"the model's {s.model_token_kind} token" in shown
        if s.rejected is not None and s.accepted:
            kinds_seen.add("accepted and rejected")
    assert {"bonus", "correction", "accepted and rejected"} <= kinds_seen
    # the text: every accepted draft highlighted apart from the model's own tokens
    assert view.text.value.count("ne-spec-draft") == c.stats.num_accepted_tokens
    assert view.text.value.count("ne-spec-model") == MAX_TOKENS - c.stats.num_accepted_tokens
    assert "finished: length" in view.text.value and "finished: nothing more to draft" in view.lookup.value
    assert view.step_button.disabled and view.run_button.disabled
    totals = view.totals.value
    rate = c.stats.acceptance_rate
    assert f"<b>{100 * rate:.0f}%</b>" in totals and f"<b>{c.stats.mean_acceptance_length:.2f}</b>" in totals
    assert f'data-name="steps saved"><td style="text-align:left">steps saved</td><td><b>{c.steps_saved}</b>' in totals


def test_a_text_prompt_is_escaped(build_tiny_llm) -> None:
    engine = build_tiny_llm(dict(device="cpu", max_model_len=128, num_kv_blocks=64, block_size=8,
                                 speculative_config=NGRAM)).engine
    prompt = "<b>bold</b> & <i>x</i> " * 3
    view = SpecDecodeStepper(engine, prompt, max_tokens=12)
    view.run_button.click()
    c = view.controller
    assert c.finished and "ne-msg-ok" in view.message.value
    text = view.text.value
    assert html.escape(prompt) in text and "<b>bold</b>" not in text and "<i>" not in text
    assert view.prompt.value == prompt
    # chips escape token labels too: a token whose text is markup never reaches the page raw
    lt = engine.tokenize_prompt("<")[1][0]
    shown = chip(engine, lt, "accepted")
    assert f">{html.escape(token_label(engine, lt))}</span>" in shown and "><</span>" not in shown


def test_an_engine_without_speculation_is_refused() -> None:
    engine = make_engine(speculate=False)
    with pytest.raises(ValueError, match="speculative_config"):
        SpecDecodeStepperController(engine, PROMPT)
    with pytest.raises(ValueError, match="speculative_config"):
        SpecDecodeStepper(engine, PROMPT)
    assert not engine.has_unfinished_requests() and not engine.events.wants(StepFinished)


def test_a_busy_engine_is_refused_unless_shared() -> None:
    engine = make_engine()
    other = engine.add_request([7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="unfinished request.*share_engine=True"):
        SpecDecodeStepperController(engine, PROMPT)
    assert list(engine.requests) == [other] and not engine.events.wants(StepFinished)
    c = SpecDecodeStepperController(engine, PROMPT, max_tokens=8, share_engine=True)
    c.run_to_end()
    assert c.finished and c.num_output_tokens == 8
    assert all(s.num_scheduled_tokens >= 1 for s in c.steps)  # its own steps only
    c.close()


def test_bad_input_is_refused_and_leaves_the_engine_as_it_was() -> None:
    engine = make_engine(max_model_len=64)
    view = SpecDecodeStepper(engine, PROMPT, max_tokens=8)
    c = view.controller
    view.step_button.click()
    view.step_button.click()
    before, steps, rid = engine.snapshot(), list(c.steps), c.request_id
    cases = [
        (" ", 8, "prompt is empty"),
        ("hello", 8, "no tokenizer"),
        ("101 102", 0, "max tokens must be between 1 and 64"),
        ("101 102", 10**6, "max tokens must be between 1 and 64"),
        (" ".join(["101"] * 70), 1, "max_model_len is 64"),
        (" ".join(["101"] * 50), 20, "exceeds max_model_len"),
        ("101 99999", 4, "99999"),
    ]
    for prompt, max_tokens, expected in cases:
        view.prompt.value, view.max_tokens.value = prompt, max_tokens
        view.reset_button.click()
        assert "ne-msg-error" in view.message.value and expected in html.unescape(view.message.value), prompt
        assert engine.snapshot() == before and c.request_id == rid and c.steps == steps
    with pytest.raises(ValueError, match="prompt is empty"):
        parse_token_ids(" , ")
    fresh = make_engine()
    for prompt, max_tokens in (([], 4), (PROMPT, 0), (PROMPT, 200), ([5] * 200, 4)):
        with pytest.raises(ValueError):
            SpecDecodeStepperController(fresh, prompt, max_tokens=max_tokens)
        assert not fresh.has_unfinished_requests() and not fresh.events.wants(StepFinished)


def test_reset_starts_the_same_prompt_again_and_aborts_the_old_request() -> None:
    view = SpecDecodeStepper(make_engine(), PROMPT, max_tokens=MAX_TOKENS)
    c, engine = view.controller, view.controller.engine
    for _ in range(3):
        view.step_button.click()
    old = c.request_id
    view.reset_button.click()
    assert f"new request {c.request_id}" in view.message.value and c.request_id != old
    assert old not in engine.requests and c.steps == [] and "no step yet" in view.last_step.value
    view.run_button.click()
    assert tuple(c.output_token_ids) == plain_output(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    view.prompt.value, view.max_tokens.value = "101 102 103 101 102 103", 6  # a new prompt and length
    view.reset_button.click()
    assert c.prompt_token_ids == [101, 102, 103] * 2 and c.params.max_tokens == 6
    engine.check_invariants()


def test_steps_run_elsewhere_are_recorded_and_close_stops_listening() -> None:
    view = SpecDecodeStepper(make_engine(), PROMPT, max_tokens=MAX_TOKENS)
    c, engine = view.controller, view.controller.engine
    engine.step()  # a notebook cell, not the Step button
    assert len(c.steps) == 1 and c.steps[0].elsewhere and c.steps[0].is_prefill
    assert "run elsewhere" in view.last_step.value  # the view redrew on its own
    assert engine.events.wants(DraftsVerified, keep=False)
    view.close()
    assert not engine.events.wants(DraftsVerified, keep=False) and not engine.events.wants(StepFinished, keep=False)
    engine.step()
    assert len(c.steps) == 1


def test_find_ngram_match_takes_the_longest_suffix_at_its_earliest_place() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    match = find_ngram_match(tokens, 2, max_n=3, min_n=2)
    assert (match.n, match.start, match.suffix_start, match.drafts) == (3, 0, 7, (9, 2))
    assert list(match.drafts) == propose_ngram(tokens, 2, 3, 2)
    assert find_ngram_match([1, 2, 3, 4], 2, 3, 2) is None


def test_blocks_that_held_only_rejected_drafts_go_back() -> None:
    # 2-token blocks: four drafts span new blocks, and a rejection early in the run frees some
    view = SpecDecodeStepper(make_engine(block_size=2), PROMPT, max_tokens=MAX_TOKENS)
    c = view.controller
    released = None
    while not c.finished:
        view.step_button.click()
        s = c.steps[-1]
        if s.blocks_freed and s.finish_reason is None:
            released = s
            assert s.rejected is not None and set(s.blocks_freed) <= set(s.blocks_allocated)
            assert "they held only rejected drafts" in view.last_step.value
            assert len(block_ids(c)) == -(-(len(PROMPT) + len(c.output_token_ids)) // 2)  # no more than its tokens need
    assert released is not None


def test_sampling_parameters_reach_the_request() -> None:
    # (On this tiny model even a low temperature leaves the greedy loop at once, so sampled
    # runs draft almost nothing here; the rejection rule itself is tested with the engine.)
    engine = make_engine()
    c = SpecDecodeStepperController(engine, PROMPT, max_tokens=9, params=SamplingParams(temperature=0.3, seed=0,
                                                                                       max_tokens=99))
    assert engine.requests[c.request_id].sampling_params == SamplingParams(temperature=0.3, seed=0, max_tokens=9)
    c.run_to_end()
    assert c.num_output_tokens == 9 and c.stats.as_dict() == engine.spec_decode_stats.as_dict()
    with pytest.raises(ValueError, match="params.n must be 1"):
        SpecDecodeStepperController(make_engine(), PROMPT, params=SamplingParams(n=2))


def test_chat_needs_text_and_a_chat_template():
    with pytest.raises(ValueError, match="chat=True takes the user's message as text"):
        SpecDecodeStepper(make_engine(), PROMPT, chat=True)
    with pytest.raises(ValueError, match="has no chat template"):  # the tiny engine has no tokenizer
        SpecDecodeStepper(make_engine(), "repeat after me", chat=True)


@pytest.mark.slow
def test_a_message_typed_in_the_box_is_answered_through_the_chat_template():
    """The prompt box holds the user's message; the request is the model's chat template over it, so
    the instruction-tuned default model answers (a bare question often ends after a token)."""
    from nanoengine import LLM

    llm = LLM(speculative_config=dict(NGRAM), max_model_len=256, num_kv_blocks=64)
    message = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    view = SpecDecodeStepper(llm.engine, message, max_tokens=24, chat=True)
    assert view.prompt.value == message and view.chat.value and not view.chat.disabled
    assert view.controller.prompt == llm.apply_chat_template([{"role": "user", "content": message}])
    view.controller.run_to_end()
    assert view.controller.num_output_tokens > 4
    view.prompt.value = "Say hello."
    view.reset_button.click()
    assert view.controller.prompt == llm.apply_chat_template([{"role": "user", "content": "Say hello."}])
    view.chat.value = False  # the box's text as the whole prompt
    view.reset_button.click()
    assert view.controller.prompt == "Say hello."
