"""v11 - watch speculative decoding: drafts proposed, verified in one pass, rolled back (card 16).

Four greedy requests and one seeded sampled request run through the engine with
``num_speculative_tokens=3``. Each decode step is a verify pass: per request, the n-gram
proposer's drafts (found in the request's own prompt + output), how many the model kept,
the tokens the pass emitted, and the blocks given back because only rejected drafts used
them. The model is v09's Transformer with a vocabulary of 8 (``TinyConfig(vocab_size=8,
seed=7)``): an untrained model with 64 tokens almost never repeats itself, this one soon
falls into loops, as real models do over code or quoted text, so drafts start to hit. At
the end:
- greedy output equals plain decoding (``num_speculative_tokens=0``, v09's decode step)
  and a no-cache recomputation, token for token, while it took fewer model passes;
- tokens per verify pass, against 1.0 without speculation;
- a seeded sampled request gives the same tokens twice.

Run:  python labs/nano-vllm/versions/v11_speculative_decoding/run.py
"""

import torch

from llm_engine import LLMEngine
from sampling_params import SamplingParams
from tiny_transformer import TinyConfig

CONFIG = TinyConfig(vocab_size=8, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=4, seed=1, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 1, 3, 2, 6, 5, 1, 3], [1, 2, 3, 4, 1, 2, 3], [7, 7, 1, 7, 7, 1], [3, 4, 7]]
REQUESTS = [(p, GREEDY) for p in PROMPTS] + [([2, 6, 2, 6, 2], SEEDED)]


def greedy_without_cache(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """v00's naive loop, with the Transformer: recompute everything, take the argmax."""
    token_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = engine.model_runner.model.reference_logits(token_ids)  # (T, vocab)
            token_ids.append(int(logits[-1].argmax()))
    return token_ids[len(prompt):]


def main() -> None:
    engine = LLMEngine(num_blocks=32, block_size=4, max_num_seqs=8, model_config=CONFIG, num_speculative_tokens=3)
    print(f"v11 speculative decoding: n-gram drafts (k={engine.scheduler.num_speculative_tokens}, "
          f"n={engine.scheduler.prompt_lookup_max}..{engine.scheduler.prompt_lookup_min}) verified by "
          f"TinyTransformer(vocab {CONFIG.vocab_size}, seed {CONFIG.seed}); block_size {engine.block_size}")
    for prompt, params in REQUESTS:
        engine.add_request(prompt, params)
    seqs = {seq.seq_id: seq for seq in engine.scheduler.waiting}
    outputs: dict[int, list[int]] = {}
    step = num_verifies = num_emitted = 0
    while not engine.is_finished():
        out = engine.step()
        if out.is_prefill:
            print(f"step {step:2d} PREFILL seqs={list(out.scheduled_seq_ids)}")
        else:
            rows = out.model_input.cu_seqlens_q.diff().tolist()
            print(f"step {step:2d} VERIFY  seqs={list(out.scheduled_seq_ids)} query rows {rows} "
                  f"logits {tuple(engine.model_runner.last_logits.shape)}")
            for seq_id in out.scheduled_seq_ids:
                drafts = list(out.draft_token_ids[seq_id])
                emitted = [t for s, t in out.new_tokens if s == seq_id]
                freed = sorted(set(out.block_tables[seq_id]) - set(seqs[seq_id].block_table))
                rollback = f", blocks freed {freed}" if freed and not seqs[seq_id].is_finished else ""
                print(f"    seq {seq_id}: drafts {drafts} accepted {out.num_accepted_drafts[seq_id]}/{len(drafts)} "
                      f"-> emitted {emitted}{rollback}")
                num_verifies += 1
                num_emitted += len(emitted)
        for done in out.finished:
            outputs[done.seq_id] = list(done.completion_token_ids)
            print(f"    seq {done.seq_id} FINISHED -> {outputs[done.seq_id]}")
        step += 1
    bm = engine.block_manager
    print(f"verify passes: {num_verifies} (request-steps); tokens per verify: {num_emitted / num_verifies:.2f} "
          f"(1.00 without speculation)")
    print(f"free blocks: {bm.num_free_blocks}/{bm.num_blocks}; ref counts all zero: "
          f"{all(b.ref_count == 0 for b in bm.blocks)}")
    plain = LLMEngine(num_blocks=32, block_size=4, max_num_seqs=8, model_config=CONFIG, num_speculative_tokens=0)
    v09 = plain.generate(PROMPTS, GREEDY)
    for i, tokens in enumerate(v09):
        print(f"seq {i}: v09 decode {tokens}")
        print(f"       v11 decode {outputs[i]}  equal: {tokens == outputs[i]}")
    print(f"greedy output equals v09's decode token for token: {all(v09[i] == outputs[i] for i in range(len(v09)))}")
    matches = all(outputs[i] == greedy_without_cache(engine, PROMPTS[i], GREEDY.max_tokens) for i in range(len(PROMPTS)))
    print(f"greedy outputs match a no-cache forward pass of the same model: {matches}")
    again = LLMEngine(num_blocks=32, block_size=4, model_config=CONFIG).generate([REQUESTS[-1][0]], SEEDED)[0]
    print(f"same seed -> same output: {again == outputs[len(PROMPTS)]}")


if __name__ == "__main__":
    main()
