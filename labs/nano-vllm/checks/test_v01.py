"""v01 checks - request state: a ``Sequence`` bundles prompt, completion and budget (card 5).

Each check takes a ``lab`` (the copy under test) and imports that copy's modules with
``lab.load``. The first line of a check's docstring is what ``./course lab-check`` prints;
its ``Hint:`` paragraph is shown when the check fails.
"""

import pytest

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference


def test_sequence_keeps_prompt_and_completion_in_one_list(lab) -> None:
    """A Sequence stores prompt + completion in token_ids and derives the rest.

    Hint: a request is one growing list of tokens: the prompt is its first part and everything
    generated follows it, so the completion is what lies past the prompt's length. Keep your own
    copy, or the caller's list changes under you.
    """
    Sequence = lab.load("sequence").sequence.Sequence
    prompt = [5, 9]
    seq = Sequence(0, prompt, max_tokens=3)
    assert (seq.seq_id, seq.num_tokens, seq.last_token, seq.completion_token_ids) == (0, 2, 9, [])
    seq.append_token(3)
    prompt.append(99)  # the caller's list is not the sequence's
    assert seq.token_ids == [5, 9, 3], "token_ids must be a copy of the prompt plus the generated tokens"
    assert seq.prompt_token_ids == [5, 9] and seq.completion_token_ids == [3]
    assert seq.num_completion_tokens == 1 and not seq.is_finished


def test_sequence_finishes_on_budget_or_eos(lab) -> None:
    """A Sequence is finished after max_tokens tokens or a generated EOS, and then refuses tokens.

    Hint: a request ends for one of two reasons: it has used its whole token budget, or the
    model itself said stop by generating the end-of-sequence token (a prompt that happens to end
    in it has not said anything yet). Once it has ended, nothing more may be added.
    """
    mods = lab.load("sequence", "toy_model")
    Sequence, eos = mods.sequence.Sequence, mods.toy_model.EOS_TOKEN
    seq = Sequence(0, [5, 9], max_tokens=2)
    seq.append_token(3)
    seq.append_token(4)
    assert seq.is_finished, "two tokens of a budget of two: finished"
    with pytest.raises(RuntimeError):
        seq.append_token(5)
    early = Sequence(1, [7, eos], max_tokens=5)
    assert not early.is_finished, "a prompt ending in EOS is not a finished request"
    early.append_token(eos)
    assert early.is_finished, "a generated EOS finishes the request"


def test_sequence_rejects_bad_input(lab) -> None:
    """An empty prompt or max_tokens < 1 is a ValueError.

    Hint: refuse what can never run (nothing to condition on, nothing allowed to generate) at
    construction time, with a message naming the bad value, so the mistake shows where it was
    made.
    """
    Sequence = lab.load("sequence").sequence.Sequence
    with pytest.raises(ValueError):
        Sequence(0, [], max_tokens=2)
    with pytest.raises(ValueError):
        Sequence(0, [1], max_tokens=0)


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """run.generate gives exactly v00's tokens for every prompt.

    Hint: the engine changes how work is organised, never which tokens come out: if the other
    checks pass, compare your stopping rule with v00's loop, token by token.
    """
    run = lab.load("run").run
    assert run.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v01_request_state/expected_output.txt.

    Hint: run `python run.py` in your copy and diff its output with expected_output.txt; the
    first differing line tells you which step went another way.
    """
    check_transcript(lab)
