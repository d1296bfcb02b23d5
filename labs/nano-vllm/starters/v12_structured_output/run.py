"""v12 - watch structured output: masks before sampling, drafts cut, the machine advanced (card 17).

Six requests run through the engine with speculative decoding on (``k=3``): a ``choice``,
three ``regex`` constraints (a time, a number, an e-mail-like address), a seeded sampled
``choice`` and one unconstrained request. The model is v09's Transformer over the toy
vocabulary (``TOY_VOCAB``: 64 tokens, single characters and a few pieces such as
``"green"`` or ``"ue"``). Per step and request: how many tokens each logits row allowed
(one row after a prefill, k + 1 in a verify pass), the drafts the grammar cut before
verification, how many drafts were kept, and the text emitted. At the end:
- every completion that stopped matches its constraint (Python's ``re.fullmatch``); one that
  ran out of tokens is still a prefix of a match;
- greedy output is the same with and without speculation;
- after every step each machine had processed exactly its request's generated tokens;
- a seeded sampled request gives the same text twice.

Run:  python labs/nano-vllm/versions/v12_structured_output/run.py
"""

import re

from llm_engine import LLMEngine
from sampling_params import SamplingParams
from structured_output import TOY_VOCAB, choice_to_regex, detokenize
from tiny_transformer import TinyConfig

CONFIG = TinyConfig(vocab_size=len(TOY_VOCAB), seed=4)
GREEDY = dict(temperature=0.0, max_tokens=16)
REQUESTS = [
    ([5, 9, 13, 2, 8], SamplingParams(**GREEDY, choice=("red", "green", "blue"))),
    ([2, 3, 41, 4, 5, 12, 2, 3], SamplingParams(**GREEDY, regex="[0-9][0-9]:[0-9][0-9]")),
    ([3, 4, 15, 3, 4, 16, 2], SamplingParams(temperature=0.0, max_tokens=24, regex=r"-?[0-9]+(\.[0-9])?")),
    ([11, 4, 11, 4], SamplingParams(**GREEDY, regex=r"[a-z]+@[a-z]+\.[a-z][a-z]")),
    ([2, 6, 2, 6, 2], SamplingParams(temperature=1.0, seed=1, max_tokens=8, choice=("yes", "no", "ok"))),
    ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
]


def pattern(params: SamplingParams) -> str | None:
    """The constraint as a Python regex (a choice is the alternation of its escaped strings)."""
    return choice_to_regex(params.choice) if params.choice is not None else params.regex


def describe(params: SamplingParams) -> str:
    if params.choice is not None:
        return "choice " + "|".join(params.choice)
    return f"regex {params.regex}" if params.regex is not None else "unconstrained"


def make_engine(k: int) -> LLMEngine:
    return LLMEngine(num_blocks=48, block_size=4, max_num_seqs=8, model_config=CONFIG, num_speculative_tokens=k)


def generate(k: int) -> dict[int, list[int]]:
    engine = make_engine(k)
    for prompt, params in REQUESTS:
        engine.add_request(prompt, params)
    outputs = {}
    while not engine.is_finished():
        for done in engine.step().finished:
            outputs[done.seq_id] = list(done.completion_token_ids)
    return outputs


def main() -> None:
    engine = make_engine(3)
    print(f"v12 structured output: TinyTransformer(vocab {CONFIG.vocab_size}, seed {CONFIG.seed}) over the toy "
          f"vocabulary; n-gram drafts k={engine.scheduler.num_speculative_tokens}")
    for seq_id, (prompt, params) in enumerate(REQUESTS):
        engine.add_request(prompt, params)
        print(f"  seq {seq_id}: {describe(params)}")
    seqs = {seq.seq_id: seq for seq in engine.scheduler.waiting}
    done: dict[int, tuple[list[int], str]] = {}
    only_accepted = True
    step = 0
    while not engine.is_finished():
        out = engine.step()
        print(f"step {step:2d} {'PREFILL' if out.is_prefill else 'VERIFY '} seqs={list(out.scheduled_seq_ids)}")
        row = 0
        for seq_id in out.scheduled_seq_ids:
            drafts = list(out.draft_token_ids[seq_id])
            num_rows = 1 if out.is_prefill else len(drafts) + 1
            emitted = [t for s, t in out.new_tokens if s == seq_id]
            if out.grammar_bitmask is None or seqs[seq_id].grammar is None:
                allowed = "unconstrained"
            else:
                counts = out.grammar_bitmask[row:row + num_rows].sum(dim=1).tolist()
                allowed = f"allowed {counts}/{CONFIG.vocab_size}"
            spec = "" if out.is_prefill else (f" drafts {drafts} (cut {out.num_drafts_cut[seq_id]}) "
                                              f"accepted {out.num_accepted_drafts[seq_id]}/{len(drafts)}")
            eos = " + EOS" if CONFIG.eos_token_id in emitted else ""
            print(f"    seq {seq_id}: {allowed}{spec} -> {emitted} {detokenize(emitted)!r}{eos}")
            row += num_rows
        for request_output in out.finished:
            tokens = list(request_output.completion_token_ids)
            done[request_output.seq_id] = (tokens, request_output.finish_reason)
            print(f"    seq {request_output.seq_id} FINISHED ({request_output.finish_reason}) -> "
                  f"{detokenize(tokens)!r}")
        for seq in engine.scheduler.running:
            if seq.grammar is not None:
                only_accepted &= seq.grammar.num_processed_tokens == seq.num_completion_tokens
        step += 1
    print("constraints:")
    for seq_id, (prompt, params) in enumerate(REQUESTS):
        tokens, reason = done[seq_id]
        text = detokenize(tokens)
        regex = pattern(params)
        if regex is None:
            verdict = "no constraint"
        elif reason == "stop":
            verdict = f"re.fullmatch: {re.fullmatch(regex, text) is not None}"
        else:
            verdict = f"ran out of tokens; still open, machine alive: {bool(seqs[seq_id].grammar.state)}"
        print(f"  seq {seq_id} ({describe(params)}): {text!r} [{reason}] {verdict}")
    plain = generate(0)
    greedy = [i for i, (_, params) in enumerate(REQUESTS) if params.temperature == 0]
    print(f"greedy output equal with and without speculation: {all(plain[i] == done[i][0] for i in greedy)}")
    print(f"after every step each machine held exactly its accepted tokens: {only_accepted}")
    again = generate(3)
    print(f"same seed -> same output: {again[4] == done[4][0]}")
    bare = make_engine(0).generate([REQUESTS[0][0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    print(f"seq 0's prompt without its constraint: {detokenize(bare)!r} (with it: {detokenize(done[0][0])!r})")


if __name__ == "__main__":
    main()
