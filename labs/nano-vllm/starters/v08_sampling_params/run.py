"""v08 - watch the sampler: seeds make sampling reproducible (card 12).

The toy model now returns logits; a ``Sampler`` picks the token per request. The trace:
- one step's logits for a request, and the token each kind of sampling picked;
- the same prompt sampled at temperature 1.0 / top-k 8 with seed 7, twice - once alone,
  once in a batch with other requests: identical outputs (the seed is per request);
- the same prompt with seed 8: a different output;
- temperature 0 (greedy) and top_k=1: both give the toy rule's tokens, as in v00-v07.

Run:  python labs/nano-vllm/versions/v08_sampling_params/run.py
"""

from llm_engine import LLMEngine
from sampling_params import SamplingParams

PROMPT = [3, 14, 15, 9, 2, 6, 5]
OTHERS = [[5, 9, 13, 2, 8], [7, 7, 1]]


def sample(params: SamplingParams, with_others: bool = False) -> list[int]:
    engine = LLMEngine(num_blocks=16, block_size=4)
    prompts = [PROMPT] + (OTHERS if with_others else [])
    others = [SamplingParams(temperature=1.5, max_tokens=8)] * (len(prompts) - 1)  # unseeded
    return engine.generate(prompts, [params] + others)[0]


def main() -> None:
    print("v08 sampling params: the model returns logits, a Sampler turns them into tokens")
    engine = LLMEngine(num_blocks=16, block_size=4)
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()
    logits = engine.model_runner.last_logits[0]
    top = logits.topk(3)
    print(f"logits for seq 0 after prefill: shape {tuple(logits.shape)}, top-3 "
          f"{[(int(i), round(float(v), 2)) for v, i in zip(top.values, top.indices)]}")

    seeded = SamplingParams(temperature=1.0, top_k=8, seed=7, max_tokens=8, ignore_eos=True)
    alone = sample(seeded)
    batched = sample(seeded, with_others=True)
    other_seed = sample(SamplingParams(temperature=1.0, top_k=8, seed=8, max_tokens=8, ignore_eos=True))
    greedy = sample(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    top1 = sample(SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=8, ignore_eos=True))
    print(f"seed 7, alone            : {alone}")
    print(f"seed 7, in a batch of 3  : {batched}")
    print(f"seed 8, alone            : {other_seed}")
    print(f"temperature 0 (greedy)   : {greedy}")
    print(f"top_k=1, temperature 1.0 : {top1}")
    print(f"same seed -> same output: {alone == batched}")
    print(f"different seed -> different output: {alone != other_seed}")
    print(f"top_k=1 equals greedy: {top1 == greedy}")


if __name__ == "__main__":
    main()
