"""v00 - the naive generate loop (card 4).

The smallest thing that "serves" a language model: one prompt in, tokens out, one
token per loop iteration. There is deliberately nothing else here:

- no request object: the state is a bare ``list[int]`` of token ids;
- no scheduler: there is exactly one prompt, so nothing to choose between;
- no KV cache: every iteration hands the *whole* context back to the model.

The "model" is a deterministic toy rule, not a neural network, so the mechanics stay
visible without any ML. The rule is built like attention is: each token at each
position contributes a small number (``token_feature``, the toy stand-in for the K/V
vectors a real model computes per token), and the next token depends on all of them
plus the last token. Because the rule reads every earlier token, a loop that does not
remember anything has to recompute every feature at every step - the trace counts that
work, and v03 removes it with a cache.

Run:  python labs/nano-vllm/versions/v00_naive_loop/run.py
"""

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position.

    In a Transformer this would be the key and value vectors of that token; here it
    is one small integer. From v03 on it is computed once and cached.
    """
    return (7 * token_id + 3 * position) % 97


def toy_next_token(token_ids: list[int]) -> int:
    """The toy model: next token from the full context (every feature + the last token)."""
    total = sum(token_feature(t, pos) for pos, t in enumerate(token_ids))
    return (total + 13 * token_ids[-1]) % VOCAB_SIZE


def generate(prompt: list[int], max_tokens: int, verbose: bool = False) -> list[int]:
    """Generate up to ``max_tokens`` tokens after ``prompt``; stop early on EOS.

    Returns only the generated tokens (the completion), like every later version.
    """
    token_ids = list(prompt)
    features_computed = 0
    for step in range(max_tokens):
        # The whole context goes back into the model every time: O(n) work per token.
        next_token = toy_next_token(token_ids)
        features_computed += len(token_ids)
        if verbose:
            print(f"step {step:2d}: re-read {len(token_ids):2d} tokens -> next token {next_token:2d}"
                  f"   (features computed so far: {features_computed})")
        token_ids.append(next_token)
        if next_token == EOS_TOKEN:
            break
    return token_ids[len(prompt):]


def main() -> None:
    prompt = [5, 9, 13, 2, 8]
    print("v00 naive loop: one prompt, no request object, no scheduler, no KV cache")
    print(f"prompt: {prompt}")
    completion = generate(prompt, max_tokens=8, verbose=True)
    print(f"completion: {completion}")
    n, m = len(prompt), len(completion)
    print(f"a KV cache would have computed only {n + m - 1} features; "
          f"the naive loop computed {sum(range(n, n + m))}")


if __name__ == "__main__":
    main()
