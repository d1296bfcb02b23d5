"""v04 checks - continuous batching: waiting/running queues and a scheduler (card 8)."""

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end

BUDGETS = [6, 2, 5, 3, 4, 6]  # different max_tokens, so requests finish at different steps


def test_decodes_of_several_requests_share_one_step(lab) -> None:
    """One DECODE step carries every running request, never more than max_num_seqs.

    Hint: when nobody can be admitted, every running request advances together in one step, one
    token each: that is what batching the decodes means.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(max_num_seqs=3)
    for p in PROMPTS:
        engine.add_request(p, MAX_TOKENS)
    steps = run_to_end(engine)
    decode_sizes = [len(s.scheduled_seq_ids) for s in steps if not s.is_prefill]
    assert decode_sizes and max(decode_sizes) >= 2, f"no decode step batched several requests: {decode_sizes}"
    assert max(len(s.scheduled_seq_ids) for s in steps) <= 3, "max_num_seqs=3 exceeded"
    assert all(s.num_input_tokens == len(s.scheduled_seq_ids) for s in steps if not s.is_prefill)


def test_a_freed_slot_is_refilled_while_others_still_decode(lab) -> None:
    """Continuous, not static: when a request finishes, a waiting one is prefilled on the very next step.

    Hint: continuous batching does not wait for the whole batch to drain: a finished request
    must leave the running set at once, and the very next schedule admits someone into its place
    while the others keep decoding.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(max_num_seqs=3)
    for p, budget in zip(PROMPTS, BUDGETS):
        engine.add_request(p, budget)
    steps, waiting_after, running_after = [], [], []
    while not engine.is_finished():
        steps.append(engine.step())
        waiting_after.append([s.seq_id for s in engine.scheduler.waiting])
        running_after.append([s.seq_id for s in engine.scheduler.running])
        assert len(steps) < 1000, "the engine did not finish"
    refills_mid_flight = 0
    for i, out in enumerate(steps[:-1]):
        if out.finished and waiting_after[i] and len(running_after[i]) < 3:
            nxt = steps[i + 1]
            assert nxt.is_prefill, (
                f"step {i}: seq {[r.seq_id for r in out.finished]} finished and {waiting_after[i]} waited, "
                f"but step {i + 1} was a decode of {list(nxt.scheduled_seq_ids)} - that is static batching")
            refills_mid_flight += bool(running_after[i])
    assert refills_mid_flight > 0, "no request was ever admitted while others were still decoding"


def test_prefill_respects_the_token_budget_and_the_seq_limit(lab) -> None:
    """A PREFILL admits only what fits max_num_batched_tokens, and never more than max_num_seqs run.

    Hint: a step has a token budget and a seat limit; requests are admitted first come, first
    served, and the first one that does not fit stops admission for this step (no jumping the
    queue).
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(max_num_seqs=2, max_num_batched_tokens=12)
    for p in PROMPTS:
        engine.add_request(p, 3)
    for out in run_to_end(engine):
        if out.is_prefill:
            assert out.num_input_tokens <= 12, f"prefill of {out.num_input_tokens} tokens > budget 12"
        assert len(engine.scheduler.running) <= 2


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt: batching changes the work, not the result.

    Hint: in a batch every sampled token must go back to the request it was computed for, and
    each request stops by its own rule.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(max_num_seqs=3)
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]
    steps = run_to_end(engine)
    assert steps == []


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v04_continuous_batching/expected_output.txt.

    Hint: run `python run.py` in your copy and diff its output with expected_output.txt; the
    first differing line tells you which step went another way.
    """
    check_transcript(lab)
