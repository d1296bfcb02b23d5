"""Chapter 1's exercise checks, and the chapter's live quiz questions.

Each check takes what the learner's run *produced* (the engine's step events, its memory
report, the outputs of a request) and judges the effect, never the code that produced it:

=========  =========================  ============================================
exercise   the learner changes        the check reads
=========  =========================  ============================================
1.1        ``max_num_seqs``           ``StepFinished`` events: did 8 sequences decode together?
1.2        ``dtype``                  ``memory_report()``: 2 bytes per parameter, half of float32?
1.3        ``temperature``            the ``RequestOutput``: do seeded completions differ?
1.4        ``num_kv_blocks``          ``memory_report()``: a KV pool of exactly the tokens needed?
=========  =========================  ============================================

The quiz questions at the end (``layer_parameters_question``, ``token_count_question``)
are computed from the live model and tokenizer when the quiz cell runs, and passed to
``Quiz(1, live=[...])`` (``widgets/live_questions.py`` holds the builders of later chapters).
"""

from __future__ import annotations

from typing import Sequence

from nanoengine.engine.snapshots import MemoryReport
from nanoengine.events import StepFinished
from nanoengine.outputs import RequestOutput
from widgets.exercises import CheckResult, verdict
from widgets.quiz import Question, make_question

NUM_REQUESTS = 8  # exercise 1.1 runs eight requests


# ------------------------------------------------------------------ exercise 1.1
def check_batched_decode(steps: Sequence[StepFinished], num_requests: int = NUM_REQUESTS) -> CheckResult:
    """Right when one decode step ran all ``num_requests`` sequences together.

    ``steps`` are the ``StepFinished`` events of an engine that ran ``num_requests``
    requests to completion. A decode step computes one new token per running sequence,
    so its ``num_decode_tokens`` is the number of sequences that shared its weight reads.
    """
    if not steps:
        return verdict("1.1", False, "", "no engine steps were recorded yet: set max_num_seqs in the scaffold "
                                         "and run it.")
    decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    widest = max((s.num_decode_tokens for s in decode), default=0)
    return verdict(
        "1.1", widest >= num_requests,
        f"every decode step ran all {num_requests} sequences: {len(steps)} engine steps in all, each decode "
        f"step reading the weights once for {num_requests} new tokens.",
        f"the widest decode step ran {widest} of the {num_requests} sequences; the others waited for a free "
        f"seat. max_num_seqs is the number of sequences that may run in the same step.")


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
        f"memory_report().packed_weight_bytes; whether oneDNN packs this dtype depends on the CPU.)",
        f"these weights take {report.weight_bytes:,} bytes, {report.weight_bytes / num_parameters:g} per "
        f"parameter; float32's take {float32_bytes:,}. Pick a number format of 2 bytes per value.")


# ------------------------------------------------------------------ exercise 1.3
def check_sampling(output: RequestOutput | None) -> CheckResult:
    """Right when the seeded completions of one request are not all the same tokens."""
    if output is None:
        return verdict("1.3", False, "", "nothing generated yet: set temperature in the scaffold and run it.")
    texts = [tuple(c.token_ids) for c in output.outputs]  # token ids: text can hide a difference
    if len(texts) < 2:
        return verdict("1.3", False, "", "ask for several completions of the prompt (SamplingParams(n=5)).")
    distinct = len(set(texts))
    return verdict(
        "1.3", distinct > 1,
        f"the {len(texts)} seeded completions are not all the same: above zero, the sampler draws from the "
        f"distribution instead of taking its top token, and each seed draws differently.",
        f"all {len(texts)} completions are the same tokens. At temperature 0 the sampler always takes the most "
        f"likely token, whatever the seed.")


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
