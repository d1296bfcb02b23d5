"""Chapter 2's exercise checks: change one engine setting, watch what the engine core does.

Each check builds a tiny randomly initialised engine (``widgets.tiny_engine``: two layers,
hidden size 32; only the mechanics matter here, not the text) with the learner's setting,
runs a fixed workload through the public API (``add_request``, ``step``, ``events``) and
judges what the engine did, never the code that set it up.

=========  ===================================  ==========================================
exercise   setting changed                      effect observed
=========  ===================================  ==========================================
2.1        ``max_num_batched_tokens``           a 40-token prompt is prefilled in 3 chunks
2.2        ``scheduling_policy``                the step that admits a new request runs
                                                its prefill alone
2.3        ``max_num_seqs``                     8 requests take twice as many steps
=========  ===================================  ==========================================
"""

from __future__ import annotations

from nanoengine import SamplingParams
from nanoengine.config import POLICIES
from nanoengine.events import RequestScheduled, StepFinished
from widgets._common import tiny_engine
from widgets.exercises import CheckResult, todo, verdict

PROMPT_TOKENS = 40  # exercise 2.1's prompt
TARGET_CHUNKS = 3
NUM_REQUESTS = 8  # exercise 2.3's workload
OUTPUT_TOKENS = 6


def _prompt(n: int, start: int = 100) -> list[int]:
    """``n`` token ids above the tiny vocabulary's low end (no special tokens)."""
    return [start + i % 150 for i in range(n)]


def _whole_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------ exercise 2.1
def prefill_chunks(max_num_batched_tokens: int) -> list[int]:
    """Prompt tokens computed in each step that works on one 40-token prompt, under this token budget.

    Counted from ``RequestScheduled`` events while the prompt is not all in the cache. (Their
    ``is_prefill`` flag names the kernel: a last chunk of exactly one token runs through the
    decode kernel and says False, yet it is still prompt work.)
    """
    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64,
                         max_num_batched_tokens=max_num_batched_tokens)
    chunks: list[int] = []

    def record(e) -> None:
        if isinstance(e, RequestScheduled) and e.num_computed_tokens < PROMPT_TOKENS:
            chunks.append(min(e.num_tokens, PROMPT_TOKENS - e.num_computed_tokens))

    unsubscribe = engine.events.subscribe(record)
    try:
        engine.add_request(_prompt(PROMPT_TOKENS), SamplingParams(temperature=0.0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        unsubscribe()
    return chunks


def check_prefill_chunks(budget) -> CheckResult:
    """Exercise 2.1: a token budget that prefills the 40-token prompt in exactly 3 steps."""
    if todo(budget):
        return verdict("2.1", False, "", "set budget to a whole number of tokens per step "
                                         "(max_num_batched_tokens); the prompt has 40 tokens.")
    if not _whole_number(budget) or budget < 1:
        return verdict("2.1", False, "", f"the budget must be a whole number of tokens >= 1, got {budget!r}.")
    chunks = prefill_chunks(budget)
    return verdict(
        "2.1", len(chunks) == TARGET_CHUNKS,
        f"with max_num_batched_tokens={budget} the scheduler gave the 40-token prompt {len(chunks)} prefill "
        f"chunks {chunks}: each step computes at most the budget, and the last chunk takes what is left.",
        f"with max_num_batched_tokens={budget} the prompt was prefilled in {len(chunks)} chunk(s) {chunks}; "
        f"a step computes at most the budget, so you need ceil(40 / budget) = 3.")


# ------------------------------------------------------------------ exercise 2.2
def admission_step(policy: str) -> dict[str, tuple[int, bool]]:
    """What the step after a second request arrives schedules: {request id: (tokens, is_prefill)}.

    Request "A" (8 prompt tokens) is prefilled and decodes for two steps; then "B" (8 prompt
    tokens) arrives and the engine steps once more.
    """
    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64, scheduling_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    engine.add_request(_prompt(8), params, request_id="A")
    for _ in range(3):
        engine.step()
    engine.add_request(_prompt(8, start=180), params, request_id="B")
    seen: dict[str, tuple[int, bool]] = {}
    unsubscribe = engine.events.subscribe(
        lambda e: seen.__setitem__(e.request_id, (e.num_tokens, e.is_prefill))
        if isinstance(e, RequestScheduled) else None)
    try:
        engine.step()
    finally:
        unsubscribe()
    return seen


def _describe_step(seen: dict[str, tuple[int, bool]]) -> str:
    if not seen:
        return "nothing"
    return ", ".join(f"{rid} ({'prefill' if pre else 'decode'}, {n} token{'s' * (n != 1)})"
                     for rid, (n, pre) in sorted(seen.items()))


def check_policy(policy) -> CheckResult:
    """Exercise 2.2: the policy under which B's prefill runs alone, A's decode paused for a step."""
    if todo(policy):
        return verdict("2.2", False, "", f"set policy to one of {list(POLICIES)}.")
    if policy not in POLICIES:
        return verdict("2.2", False, "", f"the engine knows the policies {list(POLICIES)}, got {policy!r}.")
    seen = admission_step(policy)
    return verdict(
        "2.2", set(seen) == {"B"},
        f"under {policy!r} the step after B arrived ran {_describe_step(seen)}: a step that admits new requests "
        f"runs prefills only (nano-vLLM's rule), so A's decode waits one step.",
        f"under {policy!r} the step after B arrived ran {_describe_step(seen)}. Look for the policy whose "
        f"admission step is prefill-only (the EngineConfig docstring describes all three).")


# ------------------------------------------------------------------ exercise 2.3
def steps_for_workload(max_num_seqs: int) -> tuple[int, int]:
    """(engine steps, largest number of requests in one step) for 8 requests of 6 output tokens."""
    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=max_num_seqs)
    steps: list[StepFinished] = []
    unsubscribe = engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    try:
        for i in range(NUM_REQUESTS):
            engine.add_request(_prompt(4, start=100 + 10 * i),
                               SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        unsubscribe()
    return len(steps), max(s.num_scheduled_requests for s in steps)


def check_max_num_seqs(max_num_seqs) -> CheckResult:
    """Exercise 2.3: a sequence limit under which the 8 requests take twice the steps (12, not 6)."""
    if todo(max_num_seqs):
        return verdict("2.3", False, "", "set max_num_seqs to a whole number >= 1: how many requests may run "
                                         "at once.")
    if not _whole_number(max_num_seqs) or max_num_seqs < 1:
        return verdict("2.3", False, "", f"max_num_seqs must be a whole number >= 1, got {max_num_seqs!r}.")
    baseline = 2 * OUTPUT_TOKENS  # twice the 6 steps all 8 requests take together
    steps, widest = steps_for_workload(max_num_seqs)
    return verdict(
        "2.3", steps == baseline,
        f"with max_num_seqs={max_num_seqs} at most {widest} requests ran per step and the 8 requests took "
        f"{steps} steps: two rounds of {OUTPUT_TOKENS} steps, because the rest waited for seats.",
        f"with max_num_seqs={max_num_seqs} at most {widest} requests ran per step and the 8 requests took "
        f"{steps} steps; the target is {baseline}. Each request needs {OUTPUT_TOKENS} steps; how many seats "
        f"make exactly two rounds?")
