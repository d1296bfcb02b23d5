"""v11 checks - speculative decoding: propose, verify in one pass, accept, roll back (card 16).

The acceptance rule is *fitted*: thousands of verify passes over fixed distributions must
emit each token with exactly the probability plain sampling would. The roll-back is checked
on the engine's own state after every step: the computed-token count, the block table and
the prefix cache may only ever reflect accepted tokens. And greedy output must equal v09's
engine (always the finished snapshot) token for token.
"""


import torch

from lab_harness import VERSIONS, V, Lab, check_transcript, run_to_end

PROMPTS = [[5, 1, 3, 2, 6, 5, 1, 3], [1, 2, 3, 4, 1, 2, 3], [7, 7, 1, 7, 7, 1], [3, 4, 7]]
DRAWS = 6000


def _config(lab):
    return lab.load("tiny_transformer").tiny_transformer.TinyConfig(vocab_size=8, seed=7)


def test_ngram_proposer_takes_the_earliest_longest_match(lab) -> None:
    """propose_ngram proposes what followed the earliest earlier match of the longest suffix.

    Hint: try the longest suffix first and stop at the first length that matches; among its
    matches take the earliest; a match must lie before the suffix itself, and at most k tokens
    are proposed.
    """
    propose = lab.load("ngram_proposer").ngram_proposer.propose_ngram
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [9, 1], "earliest match of [1, 2, 3]"
    assert propose([4, 2, 8, 5, 2, 6, 4, 2], 3, 3, 1) == [8, 5, 2], "[4, 2] beats the later [2]"
    assert propose([1, 5, 2, 5, 3], 2, 2, 1) == [], "no earlier 3, nothing to propose"
    assert propose([7, 7, 7], 4, 3, 1) == [7], "the suffix [7, 7] matches at 0; one token follows"
    assert propose([1, 2, 1], 0, 3, 1) == []
    assert propose([3, 1, 2, 3, 1], 5, 1, 1) == [2, 3, 1], "n=1: what follows the earliest 1"


def test_greedy_acceptance_keeps_drafts_until_the_first_mismatch(lab) -> None:
    """accept_greedy keeps drafts that equal the argmax, then emits the model's own token.

    Hint: a greedy pass emits exactly the tokens greedy decoding would: while the guesses agree
    with the model they are kept; at the first disagreement the model's choice is emitted and
    the rest is thrown away; if all agree, the last row still gives one more token.
    """
    accept = lab.load("rejection_sampler").rejection_sampler.accept_greedy
    assert accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7], "all kept, plus the bonus"
    assert accept([4, 9, 6, 7], [4, 5, 6]) == [4, 9], "kept 4, then the model's 9 instead of 5"
    assert accept([3, 5, 6, 7], [4, 5, 6]) == [3], "the first draft already differs"
    assert accept([8], []) == [8], "no drafts: a plain decode"


def _distribution(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(v) / max(len(tokens), 1) for v in range(vocab)]


def _total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def test_sampled_acceptance_leaves_the_distribution_unchanged(lab) -> None:
    """accept_sampled emits every position's token with that row's probabilities, over 6000 passes.

    Hint: a draft is judged against the row computed just before it: kept with the probability
    that row gives it; after a rejection the replacement must never be the draft itself (it already had its chance),
    so it is drawn from the rest of that row, renormalised; only when all drafts are kept does the
    last row give a bonus.
    """
    accept = lab.load("rejection_sampler").rejection_sampler.accept_sampled
    rows = [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.05, 0.05, 0.65]]
    probs = torch.tensor(rows)  # (k+1, V) with k = 2 drafts
    drafts = [0, 1]
    generator = torch.Generator().manual_seed(0)
    runs = [accept(probs, drafts, generator) for _ in range(DRAWS)]
    assert all(1 <= len(r) <= 3 for r in runs), "a pass emits 1 to k+1 tokens"
    for r in runs:
        kept = 0
        while kept < len(r) - 1 and r[kept] == drafts[kept]:
            kept += 1
        assert kept == len(r) - 1, f"emitted {r}: every token but the last must be a kept draft"
    for position in range(3):
        reached = [r[position] for r in runs if len(r) > position]  # passes that got this far
        expected = 0.5 * (0.6 if position == 2 else 1.0) if position else 1.0
        assert abs(len(reached) / DRAWS - expected) < 0.03, (
            f"{len(reached) / DRAWS:.3f} of the passes reached position {position}; the rule gives "
            f"{expected:.3f} (draft i is kept with probability p_i(draft))")
        observed = _distribution(reached, 4)
        tv = _total_variation(observed, rows[position])
        assert tv < 0.04, (f"position {position}: tokens emitted with frequencies "
                           f"{[round(x, 3) for x in observed]}, expected row {position} = {rows[position]} "
                           f"(total variation {tv:.3f})")


def test_verify_pass_scores_every_draft_in_one_pass(lab) -> None:
    """A decode step feeds the last token plus k drafts and gets k + 1 rows of logits that match the model.

    Hint: the drafts ride after the last token, at the positions they would have if accepted,
    over the request's whole cached context; every one of those rows needs its own logits, and
    they must equal what the model gives without any cache for the same tokens.
    """
    mods = lab.load("model_runner", "sequence", "sampling_params", "tiny_transformer")
    config = _config(lab)
    runner = mods.model_runner.ModelRunner(8, 4, config)
    params = mods.sampling_params.SamplingParams(temperature=0.0, max_tokens=8)
    seq = mods.sequence.Sequence(0, [5, 1, 3, 2, 6, 5], params, 4)
    seq.block_table = [6, 2, 4]  # scattered pages, room for 12 tokens
    runner.run([seq], is_prefill=True)
    seq.num_computed_tokens = len(seq)
    seq.append_token(3)
    seq.draft_token_ids = [2, 6, 5]
    runner.run([seq], is_prefill=False)
    inp, logits = runner.last_input, runner.last_logits
    assert inp.input_ids.tolist() == [3, 2, 6, 5], f"rows fed {inp.input_ids.tolist()}: the last token, then the drafts"
    assert inp.positions.tolist() == [6, 7, 8, 9], f"positions {inp.positions.tolist()}, expected [6, 7, 8, 9]"
    assert inp.cu_seqlens_q.tolist() == [0, 4] and inp.context_lens.tolist() == [10]
    assert logits.shape == (4, config.vocab_size), f"logits {tuple(logits.shape)}: one row per draft plus one"
    with torch.inference_mode():
        want = runner.model.reference_logits(seq.token_ids + [2, 6, 5])[6:]  # (4, V)
    assert torch.allclose(logits, want, atol=1e-4), "the verify rows differ from the model without cache"


def _check_state(engine, seqs: dict) -> None:
    bm, bs = engine.block_manager, engine.block_size
    owners: dict[int, int] = {}
    for seq in engine.scheduler.running:
        assert seq.num_computed_tokens == len(seq) - 1, (
            f"seq {seq.seq_id} has {len(seq)} tokens but counts {seq.num_computed_tokens} computed; "
            f"after a step every token but the last is computed, rejected drafts are not")
        assert len(seq.block_table) <= -(-len(seq) // bs), (
            f"seq {seq.seq_id}: {len(seq)} tokens in {len(seq.block_table)} blocks {seq.block_table}; "
            f"blocks only rejected drafts used must go back to the pool")
        assert len(seq.block_table) >= -(-seq.num_computed_tokens // bs), (
            f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens but only {len(seq.block_table)} blocks")
        for i, block_id in enumerate(seq.block_table):
            owners[block_id] = owners.get(block_id, 0) + 1
            block = bm.blocks[block_id]
            if block.hash != -1:
                assert (i + 1) * bs <= seq.num_computed_tokens and list(block.token_ids) == seq.block(i), (
                    f"seq {seq.seq_id}'s block {block_id} is in the prefix cache with tokens "
                    f"{list(block.token_ids)}, but holds {seq.block(i)}")
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), (
            f"block {block.block_id} has ref_count {block.ref_count} but {owners.get(block.block_id, 0)} "
            f"running request(s) hold it")
        assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0), f"block {block.block_id} lost"
    assert len(bm.free_block_ids) == len(set(bm.free_block_ids)), "a block was freed twice"


def test_roll_back_keeps_only_accepted_tokens(lab) -> None:
    """After every verify pass only accepted tokens count: computed tokens, block tables, free pool, prefix cache.

    Hint: the pass wrote KV for every draft, but only the kept ones (and the token before
    them) now hold the request's real tokens; count exactly those as computed, give back the
    blocks that hold nothing else, and never let a block with a guess in it into the cache.
    """
    mods = lab.load("llm_engine", "sampling_params")
    params = mods.sampling_params.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = mods.llm_engine.LLMEngine(num_blocks=32, block_size=4, max_num_seqs=8, model_config=_config(lab),
                                       num_speculative_tokens=3)
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    seqs = {seq.seq_id: seq for seq in engine.scheduler.waiting}
    freed = accepted = partial = 0
    while not engine.is_finished():
        out = engine.step()
        _check_state(engine, seqs)
        for seq_id, drafts in out.draft_token_ids.items():
            a = out.num_accepted_drafts[seq_id]
            accepted += a
            partial += 0 < a < len(drafts)
            if not seqs[seq_id].is_finished:
                freed += len(set(out.block_tables[seq_id]) - set(seqs[seq_id].block_table))
        assert len(engine.scheduler.running) + len(engine.scheduler.waiting) <= len(PROMPTS)
    assert freed and accepted and partial, "this run should reject drafts past a block boundary and accept some"
    assert engine.block_manager.num_free_blocks == 32, "every block must be back when all requests finish"


def test_greedy_output_equals_v09_token_for_token(lab) -> None:
    """Greedy decoding with speculation gives v09's output token for token, in fewer passes.

    Hint: speculation may change how many tokens one pass produces, never which tokens: a
    greedy request must emit exactly what plain decoding emits, and some drafts must be kept.
    """
    mods = lab.load("llm_engine", "sampling_params")
    config = _config(lab)
    params = mods.sampling_params.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = mods.llm_engine.LLMEngine(num_blocks=32, block_size=4, max_num_seqs=8, model_config=config,
                                       num_speculative_tokens=3)
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    steps = run_to_end(engine)
    outputs = {done.seq_id: list(done.completion_token_ids) for step in steps for done in step.finished}
    v09 = Lab(VERSIONS / V["v09"], "v09").load("llm_engine", "sampling_params", "tiny_transformer")
    plain = v09.llm_engine.LLMEngine(num_blocks=32, block_size=4, max_num_seqs=8,
                                     model_config=v09.tiny_transformer.TinyConfig(vocab_size=8, seed=7))
    want = plain.generate(PROMPTS, v09.sampling_params.SamplingParams(temperature=0.0, max_tokens=16,
                                                                      ignore_eos=True))
    for i, tokens in enumerate(want):
        assert outputs.get(i) == tokens, f"request {i}: v09 gives {tokens}, speculation gave {outputs.get(i)}"
    assert len(steps) < 1 + 16, f"{len(steps)} steps: no pass emitted more than one token per request"


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly the snapshot's expected_output.txt.

    Hint: the transcript shows drafts, how many were accepted per pass, the blocks given back,
    and that greedy output equals v09's; compare your output line by line with expected_output.txt.
    """
    check_transcript(lab)
