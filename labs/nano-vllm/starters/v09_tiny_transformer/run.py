"""v09 - watch a real Transformer's logits being sampled, over paged KV (card 13).

Three requests run through the unchanged engine, now driving ``TinyTransformer``
(untrained, seeded weights). Two share an 8-token prefix, so the prefix cache is in play.
The trace shows, per step, where the new tokens' KV is written (``slot_mapping``) and,
for each sequence, the top real logits and the token the sampler chose. At the end:
- the greedy outputs equal a no-cache recomputation with the same model
  (``TinyTransformer.reference_logits``): paging, batching and prefix reuse changed
  nothing but the work;
- a seeded request sampled twice gives the same tokens.

Run:  python labs/nano-vllm/versions/v09_tiny_transformer/run.py
"""

import torch

from llm_engine import LLMEngine
from sampling_params import SamplingParams

SYSTEM_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=10, seed=1, max_tokens=4, ignore_eos=True)
REQUESTS = [(SYSTEM_PROMPT + [1, 2, 3], GREEDY), (SYSTEM_PROMPT + [9, 9], GREEDY),
            ([11, 4, 7], SEEDED)]


def greedy_without_cache(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """v00's naive loop, with the Transformer: recompute everything, take the argmax."""
    token_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = engine.model_runner.model.reference_logits(token_ids)  # (T, vocab)
            token_ids.append(int(logits[-1].argmax()))
    return token_ids[len(prompt):]


def main() -> None:
    engine = LLMEngine(num_blocks=16, block_size=4, max_num_seqs=4)
    model = engine.model_runner.model
    config = engine.model_config
    num_params = sum(p.numel() for p in model.parameters())
    print(f"v09 tiny Transformer runner: {type(model).__name__}(torch.nn.Module), {config.num_layers} "
          f"layers, {config.num_heads} heads, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{num_params} parameters (untrained, seed {config.seed})")
    print(f"KV pool: kv_cache {tuple(engine.model_runner.kv_cache.shape)} "
          f"= (K/V, layers, blocks, block_size, heads, head_dim)")
    for prompt, params in REQUESTS:
        engine.add_request(prompt, params)
    outputs: dict[int, list[int]] = {}
    step = 0
    while not engine.is_finished():
        out = engine.step()
        inp, logits = engine.model_runner.last_input, engine.model_runner.last_logits
        kind = "PREFILL" if out.is_prefill else "DECODE "
        print(f"step {step} {kind} seqs={list(out.scheduled_seq_ids)}  "
              f"KV written to slots {inp.slot_mapping.tolist()}  logits {tuple(logits.shape)}")
        for row, (seq_id, token_id) in enumerate(out.new_tokens):
            top = logits[row].topk(3)
            shown = ", ".join(f"{int(i)}:{float(v):+.2f}" for v, i in zip(top.values, top.indices))
            print(f"    seq {seq_id}: top logits [{shown}] -> sampled {token_id}")
        for done in out.finished:
            outputs[done.seq_id] = list(done.completion_token_ids)
            print(f"    seq {done.seq_id} FINISHED -> {outputs[done.seq_id]}")
        step += 1
    bm = engine.block_manager
    print(f"prefix hits: {bm.num_prefix_hits} block(s); ref counts all zero: "
          f"{all(b.ref_count == 0 for b in bm.blocks)}")
    matches = all(outputs[i] == greedy_without_cache(engine, REQUESTS[i][0], GREEDY.max_tokens)
                  for i in (0, 1))
    print(f"greedy outputs match a no-cache forward pass of the same model: {matches}")
    again = LLMEngine(num_blocks=16, block_size=4).generate([REQUESTS[2][0]], SEEDED)[0]
    print(f"same seed -> same output: {again == outputs[2]}")


if __name__ == "__main__":
    main()
