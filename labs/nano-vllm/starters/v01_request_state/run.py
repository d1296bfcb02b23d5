"""v01 - the naive loop, now driven by ``Sequence`` objects (card 5).

Same toy model and same one-token-at-a-time loop as v00. What changed is where the
state lives: each prompt becomes a ``Sequence`` and the loop asks the Sequence whether
it is finished instead of counting steps itself. Requests are still served one after
another: the second waits until the first has finished (v04 fixes that).

Run:  python labs/nano-vllm/versions/v01_request_state/run.py
"""

from sequence import Sequence
from toy_model import toy_next_token


def generate(prompts: list[list[int]], max_tokens: int, verbose: bool = False) -> list[list[int]]:
    """Serve each prompt to completion, in order. Returns one completion per prompt."""
    seqs = [Sequence(seq_id, prompt, max_tokens) for seq_id, prompt in enumerate(prompts)]
    for seq in seqs:
        while not seq.is_finished:
            seq.append_token(toy_next_token(seq.token_ids))
            if verbose:
                print(f"  {seq}")
    return [seq.completion_token_ids for seq in seqs]


def main() -> None:
    prompts = [[5, 9, 13, 2, 8], [7, 7, 1]]
    print("v01 request state: each prompt becomes a Sequence; served one after another")
    completions = generate(prompts, max_tokens=5, verbose=True)
    for prompt, completion in zip(prompts, completions):
        print(f"prompt {prompt} -> completion {completion}")


if __name__ == "__main__":
    main()
