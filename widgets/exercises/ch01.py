"""Chapter 1's exercise checks, and the chapter's live quiz questions.

Each check takes what the learner's run *produced* (the engine's step events, its memory
report, the outputs of a request) and judges the effect, never the code that produced it:

=========  =========================  ============================================
exercise   the learner changes        the check reads
=========  =========================  ============================================
1.1        ``max_num_seqs``           ``StepFinished`` events: the fewest seats that serve 8
                                      requests within 12 steps (weight reads)?
1.2        ``dtype``                  ``memory_report()``: 2 bytes per parameter, half of float32?
1.3        ``temperature``            the first pass's logits: a sampler that still draws, yet
                                      picks the top token at least 98 times in 100?
1.4        ``num_kv_blocks``          ``memory_report()``: a KV pool of exactly the tokens needed?
=========  =========================  ============================================

The chapter's readings of its measurements are here too, computed from the numbers a cell
measured so that the words follow them on any machine: ``bound_reading`` (section 6: the
decode step against its floors), ``batching_reading`` (section 7: what batching bought), and
``step_settings``, which names the settings a decode-step time was measured under.

The quiz questions at the end (``layer_parameters_question``, ``token_count_question``)
are computed from the live model and tokenizer when the quiz cell runs, and passed to
``Quiz(1, live=[...])`` (``widgets/live_questions.py`` holds the builders of later chapters).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from nanoengine.engine.snapshots import MemoryReport
from nanoengine.events import StepFinished
from widgets.exercises import CheckResult, todo, verdict
from widgets.quiz import Question, make_question

NUM_REQUESTS = 8  # exercise 1.1 runs eight requests
OUTPUT_TOKENS = 6  # ... of six new tokens each
STEP_LIMIT = 12  # ... within this many engine steps (weight reads)
TOP_SHARE = 0.98  # exercise 1.3: the top token's probability the sampler must keep


# ------------------------------------------------------------------ settings of a decode-step time
def step_settings(engine, batch: int | str, context: tuple[int, int] | str) -> str:
    """Under which settings a decode-step time was measured, in one phrase.

    Decode-step times of the same model differ by 2x between chapters when these differ
    (issue 36 item 9): the batch, the context each sequence attends over, the weights'
    dtype, torch's threads, and how the step ran the model (``LLMEngine.forward_mode``: compiled
    whole, eager, compiled fused ops; on a GPU also CUDA graphs).
    """
    mode = engine.forward_mode  # e.g. "eager (one native call per decoder layer)", "eager, CUDA graphs for decode"
    if isinstance(context, tuple):
        low, high = context
        context = f"{low} tokens" if low == high else f"{low}-{high} tokens"
    threads = torch.get_num_threads()
    return (f"batch {batch}, context {context}, {engine.memory_report().dtype}, {threads} "
            f"thread{'s' * (threads != 1)}, {mode}")


def running_context(engine) -> tuple[int, int]:
    """(shortest, longest) context of the engine's running requests, in tokens."""
    lengths = [r.num_tokens for r in engine.snapshot().running] or [0]
    return min(lengths), max(lengths)


# ------------------------------------------------------------------ section 6's reading
MEMORY_BOUND = 2.0  # bandwidth floor / arithmetic floor from which a step is read as memory-bound


def bound_reading(arithmetic_floor: float, bandwidth_floor: float, step: float) -> list[str]:
    """Section 6: what the floors (seconds) say about a measured decode step (seconds)."""
    ratio = bandwidth_floor / arithmetic_floor
    if ratio >= MEMORY_BOUND:
        first = (f"the arithmetic alone needs 1/{ratio:.0f} of the time the weights take to stream in: the "
                 f"arithmetic units could do each step's math {ratio:.0f} times over while they wait, so the "
                 f"step is memory-bound")
    elif ratio >= 1:
        first = (f"the arithmetic floor is {1 / ratio:.2f}x the bandwidth floor: the two are close, neither "
                 f"clearly sets the pace")
    else:
        first = (f"the arithmetic floor is {1 / ratio:.1f}x the bandwidth floor: on this machine the step is "
                 f"compute-bound")
    over = step / bandwidth_floor
    if over >= 1:
        second = (f"the measured step takes {over:.1f}x the bandwidth floor; the difference is work that is not "
                  f"weight reading")
    else:
        second = (f"the measured step came out below the bandwidth floor ({over:.2f}x), which no step can "
                  f"beat: the floor's own measurement was disturbed (look at its IQR)")
    return [first, second]


# ------------------------------------------------------------------ section 7's reading
IN_PROPORTION = 0.75  # tokens/s grew by at least this fraction of the batch's growth
LEVEL_OFF = 1.25  # doubling the batch bought less than this factor of tokens/s
ABOUT_THE_SAME = 1.5  # a step this many times batch 1's or less costs "about the same"


def batching_reading(step_seconds: Mapping[int, float], crossover: float) -> list[str]:
    """Section 7: what batching bought, from the median step time of each batch size.

    Three lines: below ``crossover``, did tokens/s grow almost in proportion to the batch?
    Between the two largest batches, did they level off? And is a step of the largest batch
    "about the same" cost as a step of one?
    """
    if 1 not in step_seconds or len(step_seconds) < 3:
        raise ValueError(f"the sweep needs batch 1 and at least two more sizes, got {sorted(step_seconds)}")
    batches = sorted(step_seconds)
    one = step_seconds[1]
    lines = []
    below = [b for b in batches if 1 < b <= crossover]
    if below:
        b = below[-1]
        cost = step_seconds[b] / one
        gain = b / cost
        words = ("almost in proportion to the batch" if gain >= IN_PROPORTION * b
                 else "well short of the batch's growth")
        lines.append(f"below the crossover (batch {crossover:.0f}): a step of {b} costs {cost:.2f}x a step of 1, "
                     f"so tokens/s grow {gain:.1f}x for {b}x the batch: {words}")
    else:
        lines.append(f"the crossover (batch {crossover:.0f}) comes before the smallest batch above 1: every step "
                     f"measured here already pays for its batch's arithmetic")
    low, high = batches[-2], batches[-1]
    growth = (high / step_seconds[high]) / (low / step_seconds[low])
    if growth < LEVEL_OFF:
        lines.append(f"from batch {low} to {high} tokens/s grow only {growth:.2f}x for {high / low:.0f}x the batch: "
                     f"they level off, each extra sequence pays for its own arithmetic")
    else:
        lines.append(f"from batch {low} to {high} tokens/s still grow {growth:.2f}x for {high / low:.0f}x the "
                     f"batch: they have not levelled off yet")
    ratio = step_seconds[high] / one
    verdict_words = "about the same: true here" if ratio <= ABOUT_THE_SAME else "'about the same' is not true here"
    lines.append(f"a step of {high} sequences costs {ratio:.1f}x a step of one: {verdict_words}")
    return lines


# ------------------------------------------------------------------ exercise 1.1
def check_batched_decode(steps: Sequence[StepFinished], num_requests: int = NUM_REQUESTS) -> CheckResult:
    """Right when the fewest seats served ``num_requests`` requests of 6 tokens within 12 steps.

    ``steps`` are the ``StepFinished`` events of an engine that ran the requests to completion.
    Each step reads the weights once; a request needs 6 steps (its prefill yields the first
    token), so a batch of s seats serves the requests in ceil(n / s) rounds of 6 steps.
    """
    if not steps:
        return verdict("1.1", False, "", "no engine steps were recorded yet: set max_num_seqs in the scaffold "
                                         "and run it.")
    widest = max(s.num_scheduled_requests for s in steps)
    fewest = math.ceil(num_requests / (STEP_LIMIT // OUTPUT_TOKENS))
    n = len(steps)
    if n > STEP_LIMIT:
        return verdict("1.1", False, "", f"the {num_requests} requests took {n} engine steps, more than "
                                         f"{STEP_LIMIT}, with at most {widest} sequences in a step: those that "
                                         f"waited for a seat added rounds of steps.")
    if widest > fewest:
        return verdict("1.1", False, "", f"the {num_requests} requests took {n} steps with up to {widest} "
                                         f"sequences in a step: within {STEP_LIMIT}, but a smaller max_num_seqs "
                                         f"also finishes within {STEP_LIMIT} steps.")
    return verdict(
        "1.1", True,
        f"{n} engine steps, at most {widest} sequences in each: {math.ceil(num_requests / widest)} rounds of "
        f"{OUTPUT_TOKENS} steps, and each "
        f"step read the weights once for {widest} new tokens. One seat fewer needs "
        f"{math.ceil(num_requests / (widest - 1)) * OUTPUT_TOKENS if widest > 1 else '-'} steps.", "")


# ------------------------------------------------------------------ exercise 1.2
def check_half_bytes(report: MemoryReport | None, num_parameters: int) -> CheckResult:
    """Right when ``report``'s weights take 2 bytes per parameter: half of float32's 4."""
    if report is None:
        return verdict("1.2", False, "", "no second engine yet: set dtype in the scaffold and run it.")
    float32_bytes = 4 * num_parameters
    right = 2 * report.weight_bytes == float32_bytes
    return verdict(
        "1.2", right,
        f"{report.dtype} weights take {report.weight_bytes:,} bytes, half of float32's {float32_bytes:,}: the "
        f"same {num_parameters:,} parameters at 2 bytes each. (A CPU engine may also keep a packed copy: "
        f"memory_report().weight_copy_bytes; whether oneDNN packs this dtype depends on the CPU.)",
        f"these weights take {report.weight_bytes:,} bytes, {report.weight_bytes / num_parameters:g} per "
        f"parameter; float32's take {float32_bytes:,}. Pick a number format of 2 bytes per value.")


# ------------------------------------------------------------------ exercise 1.3
def top_probability(logits: torch.Tensor, temperature: float) -> float:
    """The most likely token's probability after dividing the logits by ``temperature``."""
    return float(torch.softmax(logits.float() / temperature, dim=-1).max())


def check_temperature(temperature, logits: torch.Tensor, target: float = TOP_SHARE) -> CheckResult:
    """Right when ``temperature`` still samples (> 0) yet keeps ``target`` of the probability on the top token.

    ``logits`` are one pass's next-token logits (the chapter's first pass). Judged on the exact
    distribution the sampler draws from, so no lucky seed can pass it.
    """
    if todo(temperature):
        return verdict("1.3", False, "", "set temperature in the scaffold and run it.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        return verdict("1.3", False, "", f"a temperature is a number >= 0, got {temperature!r}.")
    if temperature == 0:
        return verdict("1.3", False, "", "at temperature 0 the sampler does not draw at all: it takes the top "
                                         "token by rule (greedy), whatever the seed. Keep it a draw.")
    p = top_probability(logits, temperature)
    if p < target:
        return verdict("1.3", False, "", f"at temperature {temperature:g} the top token keeps {100 * p:.0f}% of "
                                         f"the probability, short of {100 * target:.0f}%: in which direction "
                                         f"does dividing the logits by the temperature sharpen them?")
    return verdict(
        "1.3", True,
        f"at temperature {temperature:g} the top token keeps at least {100 * target:.0f}% of the probability: "
        f"dividing the logits by a number below 1 stretches their gaps, and the softmax turns a wider gap into "
        f"a larger share. It still draws: a seed can pick another token, rarely.", "")


# ------------------------------------------------------------------ exercise 1.4
def check_kv_pool(report: MemoryReport | None, conversations: int, tokens_each: int) -> CheckResult:
    """Right when the KV pool holds exactly ``conversations`` x ``tokens_each`` tokens, no block spare."""
    if report is None:
        return verdict("1.4", False, "", "no engine yet: set num_kv_blocks in the scaffold and run it.")
    needed = conversations * tokens_each
    have = report.kv_capacity_tokens
    if have < needed:
        hint = (f"the pool holds {have:,} tokens ({report.num_kv_blocks} blocks of {report.block_size}); "
                f"{conversations} conversations of {tokens_each:,} tokens need {needed:,}.")
    else:
        hint = (f"the pool holds {have:,} tokens, {have - needed:,} more than needed: "
                f"{(have - needed) * report.kv_bytes_per_token:,} bytes allocated for nothing.")
    return verdict(
        "1.4", have == needed,
        f"{report.num_kv_blocks} blocks x {report.block_size} tokens = {needed:,} tokens, at "
        f"{report.kv_bytes_per_token:,} bytes each: {report.kv_cache_bytes:,} bytes, exactly the memory "
        f"estimator's KV cache for this context and batch.",
        hint)


# ------------------------------------------------------------------ live quiz questions
def layer_parameters_question(net, layer: int = 0, chapter: int = 1) -> Question:
    """How many parameters does one decoder layer of the loaded model hold?

    The answer sums the layer's parameter tensors; the wrong options are the usual slips
    (forgetting grouped-query attention, the MLP's third matrix, or the norms).
    """
    block = net.model.layers[layer]
    answer = sum(p.numel() for p in block.parameters())
    attn, mlp = block.self_attn, block.mlp
    hidden = net.config.hidden_size
    qkv = attn.qkv_proj.weight.numel()
    norms = sum(p.numel() for name, p in block.named_parameters() if "norm" in name)
    full_kv = (hidden + 2 * attn.num_heads * attn.head_dim) * hidden  # as if every query head had its own K/V
    inter = mlp.down_proj.weight.shape[1]
    wrong = [
        (f"{answer - qkv + full_kv:,}", f"That gives every one of the {attn.num_heads} query heads its own key "
                                        f"and value head. Grouped-query attention has only {attn.num_kv_heads} "
                                        f"K/V heads, so the k and v projections are smaller."),
        (f"{answer - inter * hidden:,}", "That forgets one of the MLP's three matrices: gate and up (fused in "
                                         "gate_up_proj) and down."),
        (f"{answer - norms:,}", f"That leaves out the two RMSNorm weight vectors ({hidden} values each)."),
        (f"{answer * net.config.num_hidden_layers:,}", "That is all the layers together, not one."),
    ]
    return make_question(
        f"Layer {layer} of the loaded model (hidden size {hidden}, {attn.num_heads} query heads, "
        f"{attn.num_kv_heads} key/value heads of size {attn.head_dim}, MLP width {inter}) has an attention "
        f"block, an MLP and two norms. How many parameters does it hold?",
        (f"{answer:,}", f"Summing the layer's tensors: qkv_proj {qkv:,}, o_proj {attn.o_proj.weight.numel():,}, "
                        f"gate_up_proj {mlp.gate_up_proj.weight.numel():,}, down_proj "
                        f"{mlp.down_proj.weight.numel():,} and the norms {norms:,}."),
        wrong, chapter)


def token_count_question(tokenizer, text: str, chapter: int = 1) -> Question:
    """How many tokens does the real tokenizer make of ``text``?"""
    ids = tokenizer.encode(text, add_special_tokens=False)
    words, chars = len(text.split()), len(text)
    wrong = [
        (str(words), "That counts words. Tokens are pieces of a learned vocabulary: a rare word or a number "
                     "can take several."),
        (str(chars), "That counts characters. Most tokens hold several characters."),
        (str(len(text.encode('utf-8'))), "That counts UTF-8 bytes, as if every token were one byte."),
        (str(len(ids) + 1), "One too many: no start-of-text token is added here "
                            "(add_special_tokens=False), only the text's own pieces count."),
    ]
    return make_question(
        f"SmolLM2's tokenizer reads {text!r} ({words} words, {chars} characters). How many tokens is it?",
        (str(len(ids)), f"tokenizer.encode gives {len(ids)} ids."), wrong, chapter)
