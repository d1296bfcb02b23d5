"""v03 checks - the prefill / decode split and a KV cache (card 7)."""

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end


def test_model_prefill_caches_every_prompt_token(lab) -> None:
    """ToyModel.prefill caches one feature per prompt token and returns v00's next token.

    Hint: a prefill computes the per-token state (the 'KV') once for every prompt token and
    keeps it, so nothing about the prompt is ever computed again; the next token comes from that
    state.
    """
    toy = lab.load("toy_model").toy_model
    model = toy.ToyModel()
    prompt = PROMPTS[2]
    first = model.prefill(7, prompt)
    assert first == reference(prompt, 1)[0]
    assert model.kv_cache[7] == [toy.token_feature(t, p) for p, t in enumerate(prompt)]
    assert model.num_features_computed == len(prompt)


def test_model_decode_computes_only_the_new_token(lab) -> None:
    """ToyModel.decode adds one feature, at the next position, and returns v00's next token.

    Hint: with a cache, a decode computes state for one token only, the newest; its position is
    how many tokens are already cached.
    """
    model = lab.load("toy_model").toy_model.ToyModel()
    prompt = PROMPTS[2]
    tokens = reference(prompt, 3)
    assert model.prefill(0, prompt) == tokens[0]
    assert model.decode(0, tokens[0]) == tokens[1]
    assert model.decode(0, tokens[1]) == tokens[2]
    assert len(model.kv_cache[0]) == len(prompt) + 2
    assert model.num_features_computed == len(prompt) + 2


def test_engine_prefills_once_then_decodes_one_token(lab) -> None:
    """A request gets one PREFILL step (whole prompt), then DECODE steps of one token.

    Hint: a request's first step feeds its whole prompt; every later step feeds one token. When
    it finishes, its cache has no further use.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    engine.add_request(PROMPTS[2], MAX_TOKENS)
    steps = run_to_end(engine)
    assert steps[0].is_prefill and steps[0].num_input_tokens == len(PROMPTS[2])
    assert all(not s.is_prefill and s.num_input_tokens == 1 for s in steps[1:])
    n, m = len(PROMPTS[2]), len(steps)
    assert engine.model.num_features_computed == n + m - 1  # each token's feature computed once
    assert [tok for s in steps for _, tok in s.new_tokens] == reference(PROMPTS[2])
    assert engine.model.kv_cache == {}, "a finished request's cache must be freed"


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt: caching changes the work, not the result.

    Hint: a cached feature must be exactly the one the naive loop would recompute: check the
    position each new token is given.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v03_prefill_decode/expected_output.txt.

    Hint: run `python run.py` in your copy and diff its output with expected_output.txt; the
    first differing line tells you which step went another way.
    """
    check_transcript(lab)
