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
from translations import tr
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
        context = tr("{low} tokens", low=low) if low == high else tr("{low}-{high} tokens", low=low, high=high)
    threads = torch.get_num_threads()
    thread_words = tr("{n} thread", n=threads) if threads == 1 else tr("{n} threads", n=threads)
    return tr("batch {batch}, context {context}, {dtype}, {thread_words}, {mode}", batch=batch, context=context,
              dtype=engine.memory_report().dtype, thread_words=thread_words, mode=mode)


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
        first = tr("the arithmetic alone needs 1/{ratio:.0f} of the time the weights take to stream in: the "
                   "arithmetic units could do each step's math {ratio:.0f} times over while they wait, so the "
                   "step is memory-bound", ratio=ratio)
    elif ratio >= 1:
        first = tr("the arithmetic floor is {inverse:.2f}x the bandwidth floor: the two are close, neither "
                   "clearly sets the pace", inverse=1 / ratio)
    else:
        first = tr("the arithmetic floor is {inverse:.1f}x the bandwidth floor: on this machine the step is "
                   "compute-bound", inverse=1 / ratio)
    over = step / bandwidth_floor
    if over >= 1:
        second = tr("the measured step takes {over:.1f}x the bandwidth floor; the difference is work that is not "
                    "weight reading", over=over)
    else:
        second = tr("the measured step came out below the bandwidth floor ({over:.2f}x), which no step can "
                    "beat: the floor's own measurement was disturbed (look at its IQR)", over=over)
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
        fields = dict(crossover=crossover, b=b, cost=cost, gain=gain)
        if gain >= IN_PROPORTION * b:
            lines.append(tr("below the crossover (batch {crossover:.0f}): a step of {b} costs {cost:.2f}x a step of "
                            "1, so tokens/s grow {gain:.1f}x for {b}x the batch: almost in proportion to the batch",
                            **fields))
        else:
            lines.append(tr("below the crossover (batch {crossover:.0f}): a step of {b} costs {cost:.2f}x a step of "
                            "1, so tokens/s grow {gain:.1f}x for {b}x the batch: well short of the batch's growth",
                            **fields))
    else:
        lines.append(tr("the crossover (batch {crossover:.0f}) comes before the smallest batch above 1: every step "
                        "measured here already pays for its batch's arithmetic", crossover=crossover))
    low, high = batches[-2], batches[-1]
    growth = (high / step_seconds[high]) / (low / step_seconds[low])
    fields = dict(low=low, high=high, growth=growth, times=high / low)
    if growth < LEVEL_OFF:
        lines.append(tr("from batch {low} to {high} tokens/s grow only {growth:.2f}x for {times:.0f}x the batch: "
                        "they level off, each extra sequence pays for its own arithmetic", **fields))
    else:
        lines.append(tr("from batch {low} to {high} tokens/s still grow {growth:.2f}x for {times:.0f}x the "
                        "batch: they have not levelled off yet", **fields))
    ratio = step_seconds[high] / one
    if ratio <= ABOUT_THE_SAME:
        lines.append(tr("a step of {high} sequences costs {ratio:.1f}x a step of one: about the same: true here",
                        high=high, ratio=ratio))
    else:
        lines.append(tr("a step of {high} sequences costs {ratio:.1f}x a step of one: 'about the same' is not "
                        "true here", high=high, ratio=ratio))
    return lines


# ------------------------------------------------------------------ exercise 1.1
def check_batched_decode(steps: Sequence[StepFinished], num_requests: int = NUM_REQUESTS) -> CheckResult:
    """Right when the fewest seats served ``num_requests`` requests of 6 tokens within 12 steps.

    ``steps`` are the ``StepFinished`` events of an engine that ran the requests to completion.
    Each step reads the weights once; a request needs 6 steps (its prefill yields the first
    token), so a batch of s seats serves the requests in ceil(n / s) rounds of 6 steps.
    """
    if not steps:
        return verdict("1.1", False, "", tr("no engine steps were recorded yet: set max_num_seqs in the "
                                            "scaffold and run it."))
    widest = max(s.num_scheduled_requests for s in steps)
    fewest = math.ceil(num_requests / (STEP_LIMIT // OUTPUT_TOKENS))
    n = len(steps)
    fields = dict(requests=num_requests, n=n, limit=STEP_LIMIT, widest=widest)
    if n > STEP_LIMIT:
        return verdict("1.1", False, "", tr("the {requests} requests took {n} engine steps, more than {limit}, "
                                            "with at most {widest} sequences in a step: those that waited for a "
                                            "seat added rounds of steps.", **fields))
    if widest > fewest:
        return verdict("1.1", False, "", tr("the {requests} requests took {n} steps with up to {widest} sequences "
                                            "in a step: within {limit}, but a smaller max_num_seqs also finishes "
                                            "within {limit} steps.", **fields))
    return verdict(
        "1.1", True,
        tr("{n} engine steps, at most {widest} sequences in each: {rounds} rounds of {output} steps, and each step "
           "read the weights once for {widest} new tokens. One seat fewer needs {fewer_steps} steps.",
           rounds=math.ceil(num_requests / widest), output=OUTPUT_TOKENS,
           fewer_steps=math.ceil(num_requests / (widest - 1)) * OUTPUT_TOKENS if widest > 1 else '-', **fields),
        "")


# ------------------------------------------------------------------ exercise 1.2
def check_half_bytes(report: MemoryReport | None, num_parameters: int) -> CheckResult:
    """Right when ``report``'s weights take 2 bytes per parameter: half of float32's 4."""
    if report is None:
        return verdict("1.2", False, "", tr("no second engine yet: set dtype in the scaffold and run it."))
    float32_bytes = 4 * num_parameters
    right = 2 * report.weight_bytes == float32_bytes
    fields = dict(weight_bytes=report.weight_bytes, float32_bytes=float32_bytes)
    return verdict(
        "1.2", right,
        tr("{dtype} weights take {weight_bytes:,} bytes, half of float32's {float32_bytes:,}: the same "
           "{parameters:,} parameters at 2 bytes each. (A CPU engine may also keep a packed copy: "
           "memory_report().weight_copy_bytes; whether oneDNN packs this dtype depends on the CPU.)",
           dtype=report.dtype, parameters=num_parameters, **fields),
        tr("these weights take {weight_bytes:,} bytes, {per_parameter:g} per parameter; float32's take "
           "{float32_bytes:,}. Pick a number format of 2 bytes per value.",
           per_parameter=report.weight_bytes / num_parameters, **fields))


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
        return verdict("1.3", False, "", tr("set temperature in the scaffold and run it."))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        return verdict("1.3", False, "", tr("a temperature is a number >= 0, got {value!r}.", value=temperature))
    if temperature == 0:
        return verdict("1.3", False, "", tr("at temperature 0 the sampler does not draw at all: it takes the top "
                                            "token by rule (greedy), whatever the seed. Keep it a draw."))
    p = top_probability(logits, temperature)
    if p < target:
        return verdict("1.3", False, "", tr("at temperature {temperature:g} the top token keeps {share:.0f}% of "
                                            "the probability, short of {target:.0f}%: in which direction does "
                                            "dividing the logits by the temperature sharpen them?",
                                            temperature=temperature, share=100 * p, target=100 * target))
    return verdict(
        "1.3", True,
        tr("at temperature {temperature:g} the top token keeps at least {target:.0f}% of the probability: dividing "
           "the logits by a number below 1 stretches their gaps, and the softmax turns a wider gap into a larger "
           "share. It still draws: a seed can pick another token, rarely.",
           temperature=temperature, target=100 * target), "")


# ------------------------------------------------------------------ exercise 1.4
def check_kv_pool(report: MemoryReport | None, conversations: int, tokens_each: int) -> CheckResult:
    """Right when the KV pool holds exactly ``conversations`` x ``tokens_each`` tokens, no block spare."""
    if report is None:
        return verdict("1.4", False, "", tr("no engine yet: set num_kv_blocks in the scaffold and run it."))
    needed = conversations * tokens_each
    have = report.kv_capacity_tokens
    if have < needed:
        hint = tr("the pool holds {have:,} tokens ({blocks} blocks of {bs}); {conversations} conversations of "
                  "{tokens_each:,} tokens need {needed:,}.", have=have, blocks=report.num_kv_blocks,
                  bs=report.block_size, conversations=conversations, tokens_each=tokens_each, needed=needed)
    else:
        hint = tr("the pool holds {have:,} tokens, {extra:,} more than needed: {wasted:,} bytes allocated for "
                  "nothing.", have=have, extra=have - needed, wasted=(have - needed) * report.kv_bytes_per_token)
    return verdict(
        "1.4", have == needed,
        tr("{blocks} blocks x {bs} tokens = {needed:,} tokens, at {per_token:,} bytes each: {cache:,} bytes, exactly "
           "the memory estimator's KV cache for this context and batch.", blocks=report.num_kv_blocks,
           bs=report.block_size, needed=needed, per_token=report.kv_bytes_per_token, cache=report.kv_cache_bytes),
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
        (f"{answer - qkv + full_kv:,}", tr("That gives every one of the {heads} query heads its own key and value "
                                           "head. Grouped-query attention has only {kv_heads} K/V heads, so the k "
                                           "and v projections are smaller.",
                                           heads=attn.num_heads, kv_heads=attn.num_kv_heads)),
        (f"{answer - inter * hidden:,}", tr("That forgets one of the MLP's three matrices: gate and up (fused in "
                                            "gate_up_proj) and down.")),
        (f"{answer - norms:,}", tr("That leaves out the two RMSNorm weight vectors ({hidden} values each).",
                                   hidden=hidden)),
        (f"{answer * net.config.num_hidden_layers:,}", tr("That is all the layers together, not one.")),
    ]
    return make_question(
        tr("Layer {layer} of the loaded model (hidden size {hidden}, {heads} query heads, {kv_heads} key/value "
           "heads of size {head_dim}, MLP width {inter}) has an attention block, an MLP and two norms. How many "
           "parameters does it hold?", layer=layer, hidden=hidden, heads=attn.num_heads,
           kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, inter=inter),
        (f"{answer:,}", tr("Summing the layer's tensors: qkv_proj {qkv:,}, o_proj {o_proj:,}, gate_up_proj "
                           "{gate_up:,}, down_proj {down:,} and the norms {norms:,}.", qkv=qkv,
                           o_proj=attn.o_proj.weight.numel(), gate_up=mlp.gate_up_proj.weight.numel(),
                           down=mlp.down_proj.weight.numel(), norms=norms)),
        wrong, chapter)


def token_count_question(tokenizer, text: str, chapter: int = 1) -> Question:
    """How many tokens does the real tokenizer make of ``text``?"""
    ids = tokenizer.encode(text, add_special_tokens=False)
    words, chars = len(text.split()), len(text)
    wrong = [
        (str(words), tr("That counts words. Tokens are pieces of a learned vocabulary: a rare word or a number "
                        "can take several.")),
        (str(chars), tr("That counts characters. Most tokens hold several characters.")),
        (str(len(text.encode('utf-8'))), tr("That counts UTF-8 bytes, as if every token were one byte.")),
        (str(len(ids) + 1), tr("One too many: no start-of-text token is added here "
                               "(add_special_tokens=False), only the text's own pieces count.")),
    ]
    return make_question(
        tr("SmolLM2's tokenizer reads {text!r} ({words} words, {chars} characters). How many tokens is it?",
           text=text, words=words, chars=chars),
        (str(len(ids)), tr("tokenizer.encode gives {n} ids.", n=len(ids))), wrong, chapter)
