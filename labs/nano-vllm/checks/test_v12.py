"""v12 checks - structured output: a state machine's mask before sampling, advanced with accepted tokens (card 17).

The machine is checked against Python's ``re`` (the automaton, the mask, the final text);
the mask's place is *fitted*: thousands of draws with top-k must renormalise over the allowed
tokens only. Its state is checked on the engine after every step: it may only ever hold the
request's accepted tokens, never a draft. And greedy output under a constraint must not
change with speculation.
"""

import random
import re

import pytest
import torch

from lab_harness import check_transcript, run_to_end

PATTERNS = ["[0-9]+(\\.[0-9][0-9])?", "(yes|no)", "a(b|c)*d", "-?[0-9]+", "x|", "[a-c-]+@[a-c]\\.z?"]
CHOICE = ("red", "green", "blue", "re")
DRAWS = 4000
G = dict(temperature=0.0, max_tokens=16)


def _requests(sp):
    return [
        ([5, 9, 13, 2, 8], sp.SamplingParams(**G, choice=("red", "green", "blue"))),
        ([2, 3, 41, 4, 5, 12, 2, 3], sp.SamplingParams(**G, regex="[0-9][0-9]:[0-9][0-9]")),
        ([3, 4, 15, 3, 4, 16, 2], sp.SamplingParams(temperature=0.0, max_tokens=24, regex="-?[0-9]+(\\.[0-9])?")),
        ([11, 4, 11, 4], sp.SamplingParams(**G, regex="[a-z]+@[a-z]+\\.[a-z][a-z]")),
        ([7, 7, 1], sp.SamplingParams(**G, regex="(ab|ba)+c?")),
        ([1, 2, 3], sp.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ]


def _sampled(sp):
    return [([2, 6, 2, 6, 2], sp.SamplingParams(temperature=1.0, seed=s, max_tokens=10, choice=("yes", "no", "ok")))
            for s in range(3)] + [
        ([9, 9, 4], sp.SamplingParams(temperature=1.5, top_k=20, seed=s, max_tokens=12, regex="[0-9][0-9]?:[0-5][0-9]"))
        for s in range(3)]


def _engine(lab, k: int):
    mods = lab.load("llm_engine", "tiny_transformer", "structured_output")
    config = mods.tiny_transformer.TinyConfig(vocab_size=len(mods.structured_output.TOY_VOCAB), seed=4)
    return mods.llm_engine.LLMEngine(num_blocks=64, block_size=4, max_num_seqs=8, model_config=config,
                                     num_speculative_tokens=k)


def _pattern(so, params) -> str | None:
    return so.choice_to_regex(params.choice) if params.choice is not None else params.regex


def test_the_automaton_reads_text_as_re_does(lab) -> None:
    """Walking a text through the compiled automaton ends in an accepting state exactly when Python's re matches it whole.

    Hint: a state is the set of places the text so far can have reached; each character moves
    every one of them along the edges that read it, then through every edge that reads nothing.
    Once the set is empty it stays empty.
    """
    so = lab.load("structured_output").structured_output
    rnd = random.Random(0)
    for pattern in PATTERNS:
        fsm = so.parse_regex(pattern)
        for _ in range(1500):
            text = "".join(rnd.choice("0123456789.-abcdxyesno@z") for _ in range(rnd.randint(0, 6)))
            want = re.fullmatch(pattern, text) is not None
            assert fsm.accepts(fsm.walk(fsm.start, text)) == want, (
                f"pattern {pattern!r}, text {text!r}: re says {'match' if want else 'no match'}")
    fsm = so.parse_regex("ab")
    assert fsm.walk(fsm.start, "x") == frozenset() and fsm.walk(fsm.start, "xab") == frozenset()


def _allowed_text(so, mask) -> set:
    return {so.TOY_VOCAB[t] for t in mask.nonzero().flatten().tolist()}


def test_the_mask_allows_exactly_the_tokens_that_keep_a_match_possible(lab) -> None:
    """A token is allowed iff its whole text keeps a match possible; EOS only where the text so far matches.

    Hint: a token is a string of several characters, and all of them must fit; the end of
    text is allowed only once the text is already complete; a machine with nothing left to
    allow but the end allows exactly that.
    """
    so = lab.load("structured_output").structured_output
    eos = so.EOS_TOKEN_ID
    for prefix in ["", "r", "re", "gr", "bl", "blue", "red"]:
        grammar = so.compile_grammar(CHOICE, None)
        assert grammar.accept_tokens([so.TOY_VOCAB.index(c) for c in prefix])
        mask = grammar.allowed(grammar.state)
        want = {so.TOY_VOCAB[t] for t in range(1, len(so.TOY_VOCAB))
                if any(c.startswith(prefix + so.TOY_VOCAB[t]) for c in CHOICE)}
        got = _allowed_text(so, mask) - {None}
        assert got == want, f"choice {CHOICE}, after {prefix!r}: allowed {sorted(got)}, expected {sorted(want)}"
        assert bool(mask[eos]) == (prefix in CHOICE), f"after {prefix!r}: EOS allowed is {bool(mask[eos])}"
    for pattern, text in [("[0-9]+", "12"), ("[0-9]+", ""), ("a(b|c)*d", "abd"), ("a(b|c)*d", "abc")]:
        grammar = so.compile_grammar(None, pattern)
        assert grammar.accept_tokens([so.TOY_VOCAB.index(c) for c in text])
        assert bool(grammar.allowed(grammar.state)[eos]) == (re.fullmatch(pattern, text) is not None), (
            f"regex {pattern!r} after {text!r}: EOS must be allowed iff the text already matches")
    done = so.compile_grammar(("yes", "no"), None)
    assert done.accept_tokens([so.TOY_VOCAB.index("yes")])
    assert done.is_terminated() and _allowed_text(so, done.allowed(done.state)) == {None}, \
        "after 'yes' nothing can follow: only EOS is allowed, and the machine is terminated"


def test_drafts_are_cut_to_what_the_grammar_accepts(lab) -> None:
    """Validating proposed tokens returns the prefix the machine accepts and leaves its state where it was.

    Hint: validation is a question, not a move: try the tokens one by one from the current
    state, stop at the first one that cannot follow, and do not remember any of them.
    """
    so = lab.load("structured_output").structured_output
    v = so.TOY_VOCAB.index
    grammar = so.compile_grammar(None, "[0-9]+(\\.[0-9])?")
    assert grammar.accept_tokens([v("1")])
    before = (grammar.state, grammar.num_processed_tokens)
    assert grammar.validate_tokens([v("2"), v(".5"), v("3")]) == [v("2"), v(".5")]
    assert grammar.validate_tokens([v("a"), v("2")]) == []
    assert grammar.validate_tokens([v("19"), v("00"), so.EOS_TOKEN_ID, v("1")]) == [v("19"), v("00"), so.EOS_TOKEN_ID]
    assert (grammar.state, grammar.num_processed_tokens) == before, "validating drafts moved the machine"


def test_masks_come_before_temperature_and_top_k(lab) -> None:
    """With top-k, the sampler draws from the k best *allowed* tokens, in softmax proportions over them.

    Hint: forbidding must happen on the raw scores, before the temperature and the top-k cut:
    then the cut picks among allowed tokens and the softmax renormalises over them, and a
    forbidden token can never be drawn, greedy or not.
    """
    mods = lab.load("model_runner", "sequence", "sampling_params", "tiny_transformer")
    runner = mods.model_runner.ModelRunner(4, 4, mods.tiny_transformer.TinyConfig(vocab_size=8))
    fixed = torch.tensor([[5.0, 4.5, 1.0, 0.0, -1.0, 0.5, 3.0, 2.0]])  # (1, V)
    runner.model = lambda model_input, kv_cache: fixed.clone()
    mask = torch.tensor([[False, False, True, True, False, True, False, True]])  # allowed: 2, 3, 5, 7
    params = mods.sampling_params.SamplingParams(temperature=1.0, top_k=2, seed=0, max_tokens=4)
    seq = mods.sequence.Sequence(0, [1, 2, 3], params, 4)
    seq.block_table = [0]
    draws = [runner.run([seq], True, mask)[0][0] for _ in range(DRAWS)]
    assert set(draws) <= {2, 7}, f"drew {sorted(set(draws) - {2, 7})}: only the 2 best allowed tokens (7, 2) may come"
    p7 = draws.count(7) / DRAWS
    want = 1 / (1 + torch.exp(torch.tensor(1.0 - 2.0)).item())  # softmax over logits 2.0 and 1.0
    assert abs(p7 - want) < 0.03, f"token 7 drawn {p7:.3f} of the time; softmax over the allowed top 2 gives {want:.3f}"
    greedy = mods.sequence.Sequence(1, [1, 2, 3], mods.sampling_params.SamplingParams(temperature=0.0), 4)
    greedy.block_table = [1]
    assert runner.run([greedy], True, mask) == [[7]], "greedy must take the best allowed token"


def test_verify_rows_get_the_mask_after_their_drafts(lab) -> None:
    """In a verify pass, row i's mask is the machine's after the first i drafts, and the machine ends where it began.

    Hint: each row is judged after the drafts before it, so the machine must walk through them
    while the rows are filled; but drafts are guesses, so every step it took must be undone.
    """
    mods = lab.load("structured_output", "sequence", "sampling_params")
    so = mods.structured_output
    v = so.TOY_VOCAB.index
    params = mods.sampling_params.SamplingParams(temperature=0.0, choice=("green", "grey", "red"))
    seq = mods.sequence.Sequence(0, [1, 2], params, 4)
    seq.grammar = so.compile_grammar(params.choice, None)
    plain = mods.sequence.Sequence(1, [1, 2], mods.sampling_params.SamplingParams(), 4)
    assert seq.grammar.accept_tokens([v("g")])
    seq.draft_token_ids = [v("r"), v("e")]
    plain.draft_token_ids = [v("r")]
    bitmask = so.grammar_bitmask([plain, seq], is_prefill=False)
    assert bitmask is not None and tuple(bitmask.shape) == (5, len(so.TOY_VOCAB)), "rows: 2 for seq 1, 3 for seq 0"
    assert bitmask[:2].all(), "an unconstrained request's rows allow everything"
    for i, text in enumerate(["g", "gr", "gre"]):
        fresh = so.compile_grammar(params.choice, None)
        assert fresh.accept_tokens([v(c) for c in text])
        assert torch.equal(bitmask[2 + i], fresh.allowed(fresh.state)), f"row {i} must be the mask after {text!r}"
    assert seq.grammar.num_processed_tokens == 1, "the drafts were left in the machine"
    assert so.grammar_bitmask([plain], is_prefill=True) is None


def _finished(engine, requests) -> dict:
    for prompt, params in requests:
        engine.add_request(prompt, params)
    steps = run_to_end(engine)
    return {done.seq_id: done for step in steps for done in step.finished}, steps


def test_constrained_outputs_satisfy_their_constraints(lab) -> None:
    """Every constrained completion that stops matches its constraint; one cut short by its budget is still a prefix of a match.

    Hint: the mask decides what can be produced; sampled or greedy, with or without drafts, a
    request must end only where the text is complete, and a finished text must pass Python's
    whole-string match.
    """
    mods = lab.load("sampling_params", "structured_output")
    so = mods.structured_output
    requests = _requests(mods.sampling_params) + _sampled(mods.sampling_params)
    stops = 0
    for k in (3, 0):
        finished, _ = _finished(_engine(lab, k), requests)
        for seq_id, (prompt, params) in enumerate(requests):
            pattern = _pattern(so, params)
            if pattern is None:
                continue
            out = finished[seq_id]
            text = so.detokenize(out.completion_token_ids)
            if out.finish_reason == "stop":
                stops += 1
                assert re.fullmatch(pattern, text), f"k={k} request {seq_id}: {text!r} stopped but does not match {pattern!r}"
            else:
                fsm = so.parse_regex(pattern)
                assert fsm.walk(fsm.start, text), f"k={k} request {seq_id}: {text!r} is not a prefix of {pattern!r}"
    assert stops >= 12, f"only {stops} constrained requests stopped; most should complete their constraint"


def test_greedy_output_is_the_same_with_and_without_speculation(lab) -> None:
    """Under constraints, greedy output with speculative decoding equals greedy output without it, token for token.

    Hint: drafts may change how many tokens a pass produces, never which ones: each verified
    position must see the constraint as it stands after the drafts before it, and drafts the
    constraint forbids are dropped before they are verified.
    """
    mods = lab.load("sampling_params")
    requests = _requests(mods.sampling_params)
    spec, steps = _finished(_engine(lab, 3), requests)
    plain, _ = _finished(_engine(lab, 0), requests)
    for seq_id in plain:
        assert spec[seq_id].completion_token_ids == plain[seq_id].completion_token_ids, (
            f"request {seq_id}: {list(plain[seq_id].completion_token_ids)} without speculation, "
            f"{list(spec[seq_id].completion_token_ids)} with it")
        assert spec[seq_id].finish_reason == plain[seq_id].finish_reason
    assert sum(sum(step.num_accepted_drafts.values()) for step in steps) > 0, "no draft was ever kept"
    assert sum(sum(step.num_drafts_cut.values()) for step in steps) > 0, "no draft was ever cut by a grammar"


def test_the_machine_advances_only_with_accepted_tokens(lab) -> None:
    """After every step each constrained request's machine has processed exactly its generated tokens, and is where they lead.

    Hint: the machine moves in the step's bookkeeping, with the tokens the request keeps, one
    by one; never when drafts are proposed or checked, and never twice for one token.
    """
    mods = lab.load("sampling_params", "structured_output")
    so = mods.structured_output
    requests = _requests(mods.sampling_params) + _sampled(mods.sampling_params)
    engine = _engine(lab, 3)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    checked = 0
    while not engine.is_finished():
        engine.step()
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            if seq.grammar is None:
                continue
            completion = seq.completion_token_ids
            assert seq.grammar.num_processed_tokens == len(completion), (
                f"seq {seq.seq_id} generated {len(completion)} tokens but its machine processed "
                f"{seq.grammar.num_processed_tokens}")
            params = requests[seq.seq_id][1]
            fresh = so.compile_grammar(params.choice, params.regex)
            assert fresh.accept_tokens(completion)
            assert seq.grammar.state == fresh.state, f"seq {seq.seq_id}'s machine is not where its tokens lead"
            checked += 1
    assert checked > 20


def test_a_token_the_machine_refuses_is_an_engine_bug(lab) -> None:
    """Handing the bookkeeping a token the constraint forbids raises an error instead of continuing.

    Hint: the mask made every legal token the only ones that can be sampled; a token the
    machine refuses afterwards means the engine is wrong, and must stop loudly rather than
    produce text outside the constraint.
    """
    mods = lab.load("sampling_params", "structured_output")
    so = mods.structured_output
    engine = _engine(lab, 0)
    engine.add_request([1, 2, 3], mods.sampling_params.SamplingParams(temperature=0.0, choice=("yes", "no")))
    batch = engine.scheduler.schedule()
    engine.scheduler.postprocess(batch.seqs, [[so.TOY_VOCAB.index("y")]])  # a legal token: the machine moves
    seq = batch.seqs[0]
    assert seq.grammar.num_processed_tokens == 1, "an accepted token must advance the machine"
    batch = engine.scheduler.schedule()
    with pytest.raises(RuntimeError, match="."):
        engine.scheduler.postprocess(batch.seqs, [[so.TOY_VOCAB.index("7")]])  # 'y7' fits neither choice


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly the snapshot's expected_output.txt.

    Hint: the transcript shows how many tokens each row allowed, the drafts a grammar cut, each
    finish reason, and that every stopped text matches; compare your output line by line with
    expected_output.txt.
    """
    check_transcript(lab)
