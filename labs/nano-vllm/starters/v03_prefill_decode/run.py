"""v03 - watch prefill and decode steps, and what the KV cache saves (card 7).

Each step prints whether it was a PREFILL (the whole prompt goes in) or a DECODE (one
token goes in), and the size of the request's cache. At the end the number of token
features computed is compared with what v00's cache-less loop would have computed for
the same outputs.

Run:  python labs/nano-vllm/versions/v03_prefill_decode/run.py
"""

from llm_engine import LLMEngine


def main() -> None:
    engine = LLMEngine()
    prompts = [[5, 9, 13, 2, 8], [7, 7, 1]]
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=4)
    completions: dict[int, int] = {}
    step = 0
    while not engine.is_finished():
        out = engine.step()
        kind = "PREFILL" if out.is_prefill else "DECODE "
        (seq_id, token_id), = out.new_tokens
        cache = engine.model.kv_cache.get(seq_id)
        cache_size = len(cache) if cache is not None else "freed"
        print(f"step {step:2d} {kind} seq {seq_id}: {out.num_input_tokens} token(s) in"
              f" -> +{token_id:2d}   KV cache entries: {cache_size}")
        for done in out.finished:
            print(f"        seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)}"
                  f" (its cache is freed)")
            completions[done.seq_id] = len(done.completion_token_ids)
        step += 1
    # v00 re-reads the whole context for every generated token.
    naive_work = sum(sum(range(len(p), len(p) + completions[i])) for i, p in enumerate(prompts))
    print(f"features computed with the cache: {engine.model.num_features_computed}; "
          f"v00's naive loop would compute {naive_work}")


if __name__ == "__main__":
    main()
