"""v02 checks - the engine step loop: add_request, step, generate (card 6)."""

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end


def test_add_request_queues_waiting_sequences(lab) -> None:
    """add_request gives ids 0, 1, 2, ... and queues WAITING sequences in order.

    Hint: adding a request only records it: every request gets its own id, in arrival order, and
    waits; nothing runs until the engine steps.
    """
    mods = lab.load("llm_engine", "sequence")
    engine = mods.llm_engine.LLMEngine()
    ids = [engine.add_request(p, 3) for p in PROMPTS[:3]]
    assert ids == [0, 1, 2]
    assert [s.seq_id for s in engine.waiting] == [0, 1, 2]
    assert all(s.status == mods.sequence.SequenceStatus.WAITING for s in engine.waiting)
    assert not engine.running and not engine.is_finished()


def test_step_runs_one_request_at_a_time(lab) -> None:
    """step runs the oldest request to completion before the next one starts.

    Hint: v02 serves one request at a time: a new one starts only when nobody is running, and
    each step advances the running request by exactly one token.
    """
    mods = lab.load("llm_engine", "sequence")
    engine = mods.llm_engine.LLMEngine()
    for p in PROMPTS[:3]:
        engine.add_request(p, 3)
    out = engine.step()
    assert out.scheduled_seq_ids == (0,) and out.new_tokens == ((0, reference(PROMPTS[0])[0]),)
    assert [s.seq_id for s in engine.running] == [0]
    assert engine.running[0].status == mods.sequence.SequenceStatus.RUNNING
    assert [s.seq_id for s in engine.waiting] == [1, 2]
    steps = [out] + run_to_end(engine)
    order = [s.scheduled_seq_ids[0] for s in steps]
    assert order == sorted(order), f"requests ran interleaved: {order}"
    finished = [r for step in steps for r in step.finished]
    assert [r.seq_id for r in finished] == [0, 1, 2]
    assert engine.is_finished()


def test_finished_requests_report_their_completion(lab) -> None:
    """A request is FINISHED on EOS or max_tokens and reported once in StepOutput.finished.

    Hint: the step that produces a request's last token is also the one that retires it and
    reports its full completion; a finished request must never be stepped again.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    engine.add_request(PROMPTS[0], 10)  # ends early on EOS
    engine.add_request(PROMPTS[1], 2)  # ends on its budget
    steps = run_to_end(engine)
    finished = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert finished == {0: reference(PROMPTS[0], 10), 1: reference(PROMPTS[1], 2)}
    assert len(steps) == len(finished[0]) + len(finished[1]), "one token per step"


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt, in prompt order.

    Hint: requests can finish in any order, but the caller wants the completions in the order of
    the prompts.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v02_engine_step/expected_output.txt.

    Hint: run `python run.py` in your copy and diff its output with expected_output.txt; the
    first differing line tells you which step went another way.
    """
    check_transcript(lab)
