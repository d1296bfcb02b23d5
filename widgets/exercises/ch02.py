"""Chapter 2's exercise checks: change one engine setting, watch what the engine core does.

Each check builds a tiny randomly initialised engine (``widgets.tiny_engine``: two layers,
hidden size 32; only the mechanics matter here, not the text) with the learner's setting,
runs a fixed workload through the public API (``add_request``, ``step``, ``events``) and
judges what the engine did, never the code that set it up.

=========  ===================================  ==========================================
exercise   setting changed                      effect observed
=========  ===================================  ==========================================
2.1        ``max_num_batched_tokens``           a 40-token prompt is prefilled in 3 chunks
2.2        ``scheduling_policy``                a running answer finishes one step later
                                                than under fcfs, a newcomer's first token
                                                no later
2.3        ``max_num_seqs``                     the fewest seats with which a mixed workload
                                                finishes as soon as with no limit
=========  ===================================  ==========================================

Section 6's reading of a step's time split is here too (``control_plane_share``,
``control_plane_reading``, ``compare_control_planes``): the chapter prints it from the
medians it measured, so the words follow the numbers on any machine.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

from nanoengine import SamplingParams
from nanoengine.config import POLICIES
from nanoengine.events import RequestScheduled, StepFinished
from translations import tr
from widgets._common import tiny_engine
from widgets.exercises import CheckResult, todo, verdict

PROMPT_TOKENS = 40  # exercise 2.1's prompt
TARGET_CHUNKS = 3
OUTPUT_LENGTHS = (10, 10) + (2,) * 12  # exercise 2.3: two long answers arrive first, then twelve short ones


def _prompt(n: int, start: int = 100) -> list[int]:
    """``n`` token ids above the tiny vocabulary's low end (no special tokens)."""
    return [start + i % 150 for i in range(n)]


def _whole_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------ section 6's reading
PHASES = ("schedule", "block manager", "prepare inputs", "model", "sample", "update + outputs")
CONTROL_PHASES = ("schedule", "block manager", "prepare inputs", "update + outputs")  # CPU bookkeeping
THIN, LARGE, MAJORITY = 0.10, 0.33, 0.50  # control-plane shares where the reading changes its words


def control_plane_share(medians: Mapping[str, float]) -> float:
    """The share of a step that is CPU bookkeeping around the model: (schedule + block manager
    + prepare inputs + update) / all phases, from each phase's median time (any unit).

    Phases are looked up by name (``PHASES``), so the share cannot pick up the wrong entries
    of a reordered table; a missing phase is an error, not a silent zero.
    """
    missing = [p for p in PHASES if p not in medians]
    if missing:
        raise ValueError(f"the split has no {missing} phase(s); it needs all of {list(PHASES)}")
    total = sum(medians[p] for p in PHASES)
    if total <= 0:
        raise ValueError(f"the phases add up to {total}; a step takes some time")
    return sum(medians[p] for p in CONTROL_PHASES) / total


def _share_words(share: float) -> str:
    if share < THIN:
        return tr("a thin slice next to the model")
    if share < LARGE:
        return tr("a noticeable share of the step")
    if share < MAJORITY:
        return tr("a large share of the step")
    return tr("more than the model itself: the CPU bookkeeping, not the model, sets the pace")


def control_plane_reading(label: str, medians: Mapping[str, float]) -> str:
    """One line: the model's and the control plane's medians and what the share means."""
    share = control_plane_share(medians)
    control = sum(medians[p] for p in CONTROL_PHASES)
    total = sum(medians[p] for p in PHASES)
    return tr("{label}: decode step (sum of medians) {total:.2f} ms: model {model:.2f} ms, schedule + block "
              "manager + prepare + update {control:.2f} ms ({percent:.0f}%): {words}", label=label, total=total,
              model=medians['model'], control=control, percent=100 * share, words=_share_words(share))


def compare_control_planes(big: tuple[str, Mapping[str, float]], cheap: tuple[str, Mapping[str, float]]) -> str:
    """What changes between two splits of the same engine code: the control plane's time or the model's?

    ``big`` and ``cheap`` are (label, phase medians in ms). The reading says which side moved
    more (as a ratio of the two runs' times) and whether the control plane's share grew.
    """
    (big_label, a), (cheap_label, b) = big, cheap
    control_a = sum(a[p] for p in CONTROL_PHASES)
    control_b = sum(b[p] for p in CONTROL_PHASES)
    model_ratio = a["model"] / b["model"]
    control_ratio = max(control_a, control_b) / min(control_a, control_b)
    share_a, share_b = control_plane_share(a), control_plane_share(b)
    first = tr("the model's median moved {model_ratio:.1f}x between the two ({model_a:.2f} vs {model_b:.2f} ms), "
               "the control plane's {control_ratio:.1f}x ({control_a:.2f} vs {control_b:.2f} ms)",
               model_ratio=model_ratio, model_a=a['model'], model_b=b['model'], control_ratio=control_ratio,
               control_a=control_a, control_b=control_b)
    if model_ratio >= 2 * control_ratio:
        second = tr("the model's cost follows the model, the bookkeeping's does not")
    else:
        second = tr("here the bookkeeping changed about as much as the model")
    shares = dict(share_a=100 * share_a, big=big_label, share_b=100 * share_b, cheap=cheap_label)
    if share_b > share_a:
        third = tr("so the control plane's share grows from {share_a:.0f}% ({big}) to {share_b:.0f}% ({cheap})",
                   **shares)
    else:
        third = tr("yet the control plane's share does not grow: {share_a:.0f}% ({big}), {share_b:.0f}% ({cheap})",
                   **shares)
    return tr("{first}: {second}, {third}.", first=first, second=second, third=third)


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
        return verdict("2.1", False, "", tr("set budget to a whole number of tokens per step "
                                            "(max_num_batched_tokens); the prompt has 40 tokens."))
    if not _whole_number(budget) or budget < 1:
        return verdict("2.1", False, "", tr("the budget must be a whole number of tokens >= 1, got {value!r}.",
                                            value=budget))
    chunks = prefill_chunks(budget)
    fields = dict(budget=budget, n=len(chunks), chunks=chunks)
    return verdict(
        "2.1", len(chunks) == TARGET_CHUNKS,
        tr("with max_num_batched_tokens={budget} the scheduler gave the 40-token prompt {n} prefill chunks "
           "{chunks}: each step computes at most the budget, and the last chunk takes what is left.", **fields),
        tr("with max_num_batched_tokens={budget} the prompt was prefilled in {n} chunk(s) {chunks}; a step "
           "computes at most the budget, so you need ceil(40 / budget) = 3.", **fields))


# ------------------------------------------------------------------ exercise 2.2
A_TOKENS = B_TOKENS = 10  # both answers' lengths
B_ARRIVES_AFTER = 3  # engine steps A runs alone before B is added


@functools.lru_cache(maxsize=None)
def policy_timeline(policy: str) -> tuple[int, int]:
    """(step in which A's last token comes out, step in which B's first token comes out).

    Request "A" (8 prompt tokens, 10 output tokens) runs alone for three engine steps; then
    "B" (8 prompt tokens, 10 output tokens) is added and the engine steps until both are done.
    Steps are counted from 1, the step that prefilled A.
    """
    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64, scheduling_policy=policy)
    engine.add_request(_prompt(8), SamplingParams(temperature=0.0, max_tokens=A_TOKENS, ignore_eos=True),
                       request_id="A")
    a_done = b_first = 0
    step = 0
    while engine.has_unfinished_requests():
        if step == B_ARRIVES_AFTER:
            engine.add_request(_prompt(8, start=180),
                               SamplingParams(temperature=0.0, max_tokens=B_TOKENS, ignore_eos=True),
                               request_id="B")
        step += 1
        for out in engine.step():
            if out.request_id == "A" and out.finished:
                a_done = step
            if out.request_id == "B" and out.token_ids and not b_first:
                b_first = step
    return a_done, b_first


def check_policy(policy) -> CheckResult:
    """Exercise 2.2: the policy under which A finishes one step later than under fcfs, B's first token no later."""
    if todo(policy):
        return verdict("2.2", False, "", tr("set policy to one of {policies}.", policies=list(POLICIES)))
    if policy not in POLICIES:
        return verdict("2.2", False, "", tr("the engine knows the policies {policies}, got {value!r}.",
                                            policies=list(POLICIES), value=policy))
    a_done, b_first = policy_timeline(policy)
    base_done, base_first = policy_timeline("fcfs")
    what = tr("under {policy!r} A's last token came out in step {a_done} and B's first token in step {b_first}",
              policy=policy, a_done=a_done, b_first=b_first)
    if a_done == base_done + 1 and b_first <= base_first:
        return verdict("2.2", True,
                       tr("{what} (under 'fcfs': steps {base_done} and {base_first}). A step that admits a new "
                          "request runs prefills only (nano-vLLM's rule), so A's decode skipped exactly that one "
                          "step while B's prompt went in at once.", what=what, base_done=base_done,
                          base_first=base_first), "")
    if b_first > base_first:
        hint = tr("{what}, later than under 'fcfs' (step {base_first}): this policy keeps B waiting. Which policy "
                  "admits B at once but does not let A decode in that step?", what=what, base_first=base_first)
    else:
        hint = tr("{what}, the same as under 'fcfs': A was not held back at all. Read how each policy builds the "
                  "step in which a request is admitted (EngineConfig's docstring).", what=what)
    return verdict("2.2", False, "", hint)


# ------------------------------------------------------------------ exercise 2.3
@functools.lru_cache(maxsize=None)
def steps_for_workload(max_num_seqs: int) -> tuple[int, int]:
    """(engine steps, largest number of requests in one step) for ``OUTPUT_LENGTHS``.

    The requests are added in that order (the two long answers first), each with a 4-token
    prompt; a request that finishes frees its seat for the next step.
    """
    engine = tiny_engine(num_kv_blocks=128, block_size=4, max_model_len=64, max_num_seqs=max_num_seqs)
    steps: list[StepFinished] = []
    unsubscribe = engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    try:
        for i, tokens in enumerate(OUTPUT_LENGTHS):
            engine.add_request(_prompt(4, start=100 + 7 * i),
                               SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        unsubscribe()
    return len(steps), max(s.num_scheduled_requests for s in steps)


def fewest_seats() -> int:
    """The smallest max_num_seqs whose step count equals the unlimited one's (found by running the engine)."""
    unlimited = steps_for_workload(len(OUTPUT_LENGTHS))[0]
    return next(s for s in range(1, len(OUTPUT_LENGTHS) + 1) if steps_for_workload(s)[0] == unlimited)


def check_max_num_seqs(max_num_seqs) -> CheckResult:
    """Exercise 2.3: the fewest seats with which the mixed workload finishes as soon as with no limit."""
    n = len(OUTPUT_LENGTHS)
    if todo(max_num_seqs):
        return verdict("2.3", False, "", tr("set max_num_seqs to a whole number >= 1: how many requests may run "
                                            "at once."))
    if not _whole_number(max_num_seqs) or max_num_seqs < 1:
        return verdict("2.3", False, "", tr("max_num_seqs must be a whole number >= 1, got {value!r}.",
                                            value=max_num_seqs))
    unlimited = steps_for_workload(n)[0]
    steps, widest = steps_for_workload(max_num_seqs)
    what = tr("with max_num_seqs={seats} at most {widest} requests ran per step and the {n} requests took "
              "{steps} steps", seats=max_num_seqs, widest=widest, n=n, steps=steps)
    if steps > unlimited:
        return verdict("2.3", False, "", tr("{what}, more than the {unlimited} they take with no limit: the short "
                                            "answers queued too long behind the long ones.",
                                            what=what, unlimited=unlimited))
    if max_num_seqs > 1 and steps_for_workload(max_num_seqs - 1)[0] == unlimited:
        return verdict("2.3", False, "", tr("{what}, as fast as with no limit, but a smaller max_num_seqs is just "
                                            "as fast: seats that never shorten the run are memory held for "
                                            "nothing.", what=what))
    return verdict(
        "2.3", True,
        tr("{what}, the same as with no limit, and one seat fewer takes longer. The two long answers hold two "
           "seats for all {unlimited} steps; the other seats serve the short answers in rounds, and a freed seat "
           "is filled in the very next step (continuous batching).", what=what, unlimited=unlimited), "")
