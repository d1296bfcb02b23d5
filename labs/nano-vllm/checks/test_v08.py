"""v08 checks - sampling params: temperature, top-k and per-request seeds (card 12).

The temperature and top-k checks are *fitted*: they draw thousands of tokens from the
``Sampler`` and compare the observed frequencies with the distribution the parameters
define, softmax(logits / temperature) restricted to the top k. A sampler that ignores
temperature, or only applies top-k, lands far from it.
"""

import math

import pytest

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end

LOGITS = [0.0, 1.0, 2.0, 3.0]  # one row, vocabulary of 4
DRAWS = 4000


def _frequencies(lab, temperature: float, top_k: int, seed: int = 0) -> list[float]:
    import torch

    sampler = lab.load("sampler").sampler.Sampler()
    generator = torch.Generator().manual_seed(seed)
    logits = torch.tensor([LOGITS] * DRAWS)  # (N, V): the same row N times
    tokens = sampler(logits, torch.full((DRAWS,), temperature), torch.full((DRAWS,), top_k, dtype=torch.int64),
                     [generator] * DRAWS)
    return [tokens.count(v) / DRAWS for v in range(len(LOGITS))]


def _expected(temperature: float, top_k: int) -> list[float]:
    kept = sorted(LOGITS, reverse=True)[:top_k] if top_k > 0 else LOGITS
    weights = [math.exp(x / temperature) if x >= min(kept) else 0.0 for x in LOGITS]
    return [w / sum(weights) for w in weights]


def _entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def _total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def test_sampling_params_are_validated(lab) -> None:
    """SamplingParams rejects temperature < 0, top_k 0 or < -1, a negative seed, max_tokens < 1.

    Hint: reject a sampling setting that has no meaning when it is created, and say what is
    allowed (temperature 0 means greedy; top-k -1 means off).
    """
    SamplingParams = lab.load("sampling_params").sampling_params.SamplingParams
    for bad in (dict(temperature=-0.1), dict(top_k=0), dict(top_k=-2), dict(seed=-1), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(temperature=0.0, top_k=1, seed=0, max_tokens=1)  # the edges are allowed


def test_greedy_and_top_1_take_the_best_logit(lab) -> None:
    """Temperature 0 is the argmax; top_k=1 is the argmax at any temperature.

    Hint: greedy decoding always takes the single most likely token, and keeping only the best
    one candidate must give the same answer.
    """
    import torch

    sampler = lab.load("sampler").sampler.Sampler()
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3)  # (B=3, V=4)
    temperatures = torch.tensor([0.0, 1.0, 100.0])
    top_ks = torch.tensor([-1, 1, 2])
    for seed in range(20):
        gens = [None] + [torch.Generator().manual_seed(seed) for _ in range(2)]
        greedy, top1, top2 = sampler(logits, temperatures, top_ks, gens)
        assert greedy == 2 and top1 == 2 and top2 in (2, 3)


def test_temperature_reshapes_the_distribution(lab) -> None:
    """Draws follow softmax(logits / T): sharper below T=1, flatter above it (fitted on 4000 draws).

    Hint: temperature changes the shape of the distribution before it becomes probabilities:
    scaling after the softmax is not the same thing. Then draw from it with the request's own
    random source.
    """
    observed = {t: _frequencies(lab, t, -1) for t in (0.5, 1.0, 2.0)}
    for t, freq in observed.items():
        distance = _total_variation(freq, _expected(t, -1))
        assert distance < 0.05, (f"temperature {t}: observed {[round(f, 3) for f in freq]}, expected "
                                 f"{[round(p, 3) for p in _expected(t, -1)]} (total variation {distance:.3f})")
    entropies = [_entropy(observed[t]) for t in (0.5, 1.0, 2.0)]
    assert entropies[0] < entropies[1] < entropies[2], f"entropy must grow with temperature: {entropies}"


def test_top_k_keeps_the_k_best_in_proportion(lab) -> None:
    """top_k=2 draws only the two best tokens, in the ratio softmax gives them (fitted).

    Hint: top-k removes every candidate outside the k most likely and renormalises the rest: the
    survivors keep their relative weights.
    """
    freq = _frequencies(lab, 1.0, 2)
    assert freq[0] == freq[1] == 0.0, f"tokens outside the top 2 were drawn: {freq}"
    assert _total_variation(freq, _expected(1.0, 2)) < 0.05, freq


def test_same_seed_same_output_whatever_the_batch(lab) -> None:
    """A seeded request gives the same tokens alone or batched; another seed differs; greedy = v00.

    Hint: a seeded request's draws must depend only on its own seed, so it needs its own random
    source: a shared one lets its neighbours in the batch shift its draws.
    """
    mods = lab.load("llm_engine", "sampling_params")
    SamplingParams, LLMEngine = mods.sampling_params.SamplingParams, mods.llm_engine.LLMEngine
    seeded = SamplingParams(temperature=1.0, top_k=8, seed=7, max_tokens=10, ignore_eos=True)
    noisy = SamplingParams(temperature=1.5, max_tokens=10)
    alone = LLMEngine().generate([PROMPTS[2]], seeded)[0]
    again = LLMEngine().generate([PROMPTS[2]], seeded)[0]
    batched = LLMEngine().generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [noisy, seeded, noisy])[1]
    assert alone == again == batched
    other = LLMEngine().generate([PROMPTS[2]], SamplingParams(temperature=1.0, top_k=8, seed=8,
                                                             max_tokens=10, ignore_eos=True))[0]
    assert other != alone
    assert alone != reference(PROMPTS[2], 10)  # sampling really samples
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert LLMEngine().generate(PROMPTS, greedy) == [reference(p) for p in PROMPTS]
    top1 = SamplingParams(temperature=2.0, top_k=1, seed=1, max_tokens=MAX_TOKENS)
    assert LLMEngine().generate(PROMPTS, top1) == [reference(p) for p in PROMPTS]


def test_seeded_outputs_survive_preemption(lab) -> None:
    """Preemption does not change a seeded request's tokens (its generator lives on the Sequence).

    Hint: a request's random source is part of its state and must live as long as the request,
    across steps and across an eviction.
    """
    mods = lab.load("llm_engine", "sampling_params")
    params = [mods.sampling_params.SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(4)]
    alone = [mods.llm_engine.LLMEngine(num_blocks=32).generate([p], [sp])[0]
             for p, sp in zip(PROMPTS[:4], params)]
    engine = mods.llm_engine.LLMEngine(num_blocks=6, block_size=4, max_num_seqs=4)
    seq_ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params)]
    steps = run_to_end(engine)
    assert sum(len(s.preempted_seq_ids) for s in steps) > 0
    outputs = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert [outputs[i] for i in seq_ids] == alone


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v08_sampling_params/expected_output.txt.

    Hint: with the same seeds, a correct sampler draws exactly the solution's tokens.
    """
    check_transcript(lab)
