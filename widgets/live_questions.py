"""Quiz questions whose answers are computed from the live engine (chapters 3-8).

A question written in a file can be memorised; a question about *this* engine's state
cannot. Each builder here reads the engine through its public observers
(``LLMEngine.snapshot()``, ``memory_report()``, ``model_config``, ``config``) or the
sampler's public filters, computes the answer the way the engine does, and lists the
answers a reader gets from the usual mistakes (off by one, the wrong block size, K
without V, top-p's boundary token forgotten...). Each wrong option says which mistake
produces it. Options are deduplicated (two mistakes can give the same number) and
shuffled by ``widgets.quiz.shuffle_options``, then a notebook hands them to the quiz::

    engine.add_request(prompt, SamplingParams(max_tokens=8), request_id="r0")
    engine.step()
    Quiz(4, live=[kv_slot_question(engine.snapshot(), "r0", position=20),
                  blocks_needed_question(engine.snapshot(), num_tokens=50)])

Builder                     chapter   asks
``kv_slot_question``        3, 4      the KV slot of one position, from a block table
``blocks_needed_question``  4         blocks a request of N tokens holds
``kv_bytes_question``       3         KV bytes per token of the loaded model
``step_question``           5, 6      prefill or decode, and how many tokens, next step
``step_tokens_question``    5, 6      tokens the next step schedules under the budget
``prefix_hit_question``     7         blocks of a prompt the prefix cache would serve
``sampling_question``       8         tokens that survive temperature/top-k/top-p/min-p
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import hash_block
from nanoengine.engine.snapshots import EngineSnapshot, MemoryReport, RequestSnapshot
from nanoengine.layers.sampler import kept_mask
from nanoengine.models.config import ModelConfig
from translations import tr
from widgets.quiz import Question, make_question

DEFAULT_BLOCK_SIZE = EngineConfig.block_size  # vLLM's default, the "wrong block size" mistake


def _find_request(snapshot: EngineSnapshot, request_id: str) -> RequestSnapshot:
    for r in snapshot.running + snapshot.waiting:
        if r.request_id == request_id:
            return r
    known = [r.request_id for r in snapshot.running + snapshot.waiting]
    raise ValueError(f"no request {request_id!r} in the snapshot (requests: {known})")


# ------------------------------------------------------------------ chapters 3 and 4
def kv_slot(block_table: Sequence[int], block_size: int, position: int) -> int:
    """The KV-cache slot of token ``position``: block ``table[position // block_size]``,
    offset ``position % block_size`` inside it (the slot mapping of chapters 3 and 4)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0 <= position < len(block_table) * block_size:
        raise ValueError(f"position {position} is outside the {len(block_table)} blocks of this table "
                         f"({len(block_table) * block_size} slots); pick 0..{len(block_table) * block_size - 1}")
    return block_table[position // block_size] * block_size + position % block_size


def kv_slot_question(snapshot: EngineSnapshot, request_id: str, position: int, chapter: int = 4) -> Question:
    """Which KV slot holds token ``position`` of a live request (chapters 3 and 4)?"""
    r = _find_request(snapshot, request_id)
    table, bs = r.block_ids, snapshot.block_size
    answer = kv_slot(table, bs, position)
    index, offset = divmod(position, bs)
    wrong = [
        (str(position), tr("That is the slot if the cache were one contiguous array per request. With paging the "
                           "request's tokens live in whichever blocks its block table lists.")),
        (str(table[index]), tr("That is the block id (block_table[{index}]), not a slot: multiply it by the block "
                               "size ({bs}) and add the offset inside the block ({offset}).",
                               index=index, bs=bs, offset=offset)),
        (str(answer + 1), tr("Off by one: position {position} sits at offset {position} % {bs} = {offset} in its "
                             "block, counted from 0.", position=position, bs=bs, offset=offset)),
        (str(table[index] * bs + offset + bs) if index + 1 >= len(table) else str(table[index + 1] * bs + offset),
         tr("That is one block too far: position {position} is in block-table entry {position} // {bs} = "
            "{index} (entries are counted from 0).", position=position, bs=bs, index=index)),
    ]
    if bs != DEFAULT_BLOCK_SIZE and position // DEFAULT_BLOCK_SIZE < len(table):
        i16, o16 = divmod(position, DEFAULT_BLOCK_SIZE)
        wrong.append((str(table[i16] * DEFAULT_BLOCK_SIZE + o16),
                      tr("That assumes vLLM's default block size {default}; this engine's blocks hold {bs} tokens.",
                         default=DEFAULT_BLOCK_SIZE, bs=bs)))
    return make_question(
        tr("Request {request_id} has block table {table} and the engine's blocks hold {bs} tokens. Which KV-cache "
           "slot holds the key and value of its token at position {position} (counted from 0)?",
           request_id=request_id, table=list(table), bs=bs, position=position),
        (str(answer), tr("Position {position} is in block-table entry {position} // {bs} = {index}, physical block "
                         "{block}, at offset {offset}: slot {block} x {bs} + {offset} = {answer}.",
                         position=position, bs=bs, index=index, block=table[index], offset=offset, answer=answer)),
        wrong, chapter)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the ceiling of num_tokens / block_size."""
    return -(-num_tokens // block_size)


def blocks_needed_question(snapshot: EngineSnapshot, num_tokens: int, chapter: int = 4) -> Question:
    """How many KV blocks does a request of ``num_tokens`` tokens hold (chapter 4)?"""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    bs = snapshot.block_size
    answer = blocks_needed(num_tokens, bs)
    wrong = []
    if num_tokens % bs:  # rounded down differs from the answer only when the last block is partly filled
        wrong.append((str(num_tokens // bs), tr("Rounded down: the last {left} tokens need a block too, even a "
                                                "partly filled one.", left=num_tokens % bs)))
    wrong += [
        (str(answer + 1), tr("One too many: a block is only taken when the tokens fill the last one; no spare is "
                             "reserved ahead.")),
        (str(blocks_needed(num_tokens, DEFAULT_BLOCK_SIZE)),
         tr("That uses vLLM's default block size {default}; this engine's blocks hold {bs} tokens.",
            default=DEFAULT_BLOCK_SIZE, bs=bs)),
        (str(blocks_needed(snapshot.max_model_len, bs)),
         tr("That reserves max_model_len ({max_model_len}) tokens up front, the contiguous allocator's habit that "
            "paging removes.", max_model_len=snapshot.max_model_len)),
    ]
    return make_question(
        tr("This engine's KV blocks hold {bs} tokens. How many blocks does a request hold once {num_tokens} of its "
           "tokens are in the cache?", bs=bs, num_tokens=num_tokens),
        (str(answer), tr("ceil({num_tokens} / {bs}) = {answer}: full blocks plus one partly filled block for the "
                         "remainder.", num_tokens=num_tokens, bs=bs, answer=answer) if num_tokens % bs else
         tr("{num_tokens} / {bs} = {answer} blocks, all full.", num_tokens=num_tokens, bs=bs, answer=answer)),
        wrong, chapter)


def kv_bytes_question(model_config: ModelConfig, report: MemoryReport, chapter: int = 3) -> Question:
    """How many bytes of KV cache does one token cost on the loaded model (chapter 3)?"""
    c = model_config
    per_elem = report.kv_bytes_per_token // (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim)
    answer = report.kv_bytes_per_token
    layers, kv, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    shape = tr("{layers} layers, {heads} query heads, {kv} KV heads, head_dim {d}, {dtype} ({per_elem} bytes per "
               "number)", layers=layers, heads=c.num_attention_heads, kv=kv, d=d, dtype=report.dtype,
               per_elem=per_elem)
    if per_elem != 2:
        other_dtype = tr("That assumes 2-byte bf16 numbers; this engine stores {dtype}, {per_elem} bytes each.",
                         dtype=report.dtype, per_elem=per_elem)
    else:
        other_dtype = tr("That assumes 4-byte fp32 numbers; this engine stores {dtype}, {per_elem} bytes each.",
                         dtype=report.dtype, per_elem=per_elem)
    wrong = [
        (f"{answer // 2:,}", tr("That counts the keys only: the values are cached too, hence the factor 2.")),
        (f"{2 * layers * c.num_attention_heads * d * per_elem:,}",
         tr("That uses the {heads} query heads. Only the {kv} KV heads are cached (grouped-query attention shares "
            "each among {share} query heads).", heads=c.num_attention_heads, kv=kv,
            share=c.num_attention_heads // max(kv, 1))),
        (f"{2 * kv * d * per_elem:,}", tr("That is one layer; every one of the {layers} layers keeps its own K and "
                                          "V.", layers=layers)),
        (f"{2 * layers * kv * d * (2 if per_elem != 2 else 4):,}", other_dtype),
        (f"{2 * layers * c.hidden_size * per_elem:,}",
         tr("That uses the hidden size {hidden} (all query heads' width), as if K and V were as wide as the "
            "residual stream; they are {kv} x {d} = {width} wide.", hidden=c.hidden_size, kv=kv, d=d, width=kv * d)),
        (f"{answer * 8:,}", tr("That is bits, not bytes.")),
        (f"{answer * report.block_size:,}", tr("That is one block's worth ({block_size} tokens), not one token's.",
                                               block_size=report.block_size)),
    ]
    return make_question(
        tr("The loaded model has {shape}. How many bytes of KV cache does one token take?", shape=shape),
        (f"{answer:,}", tr("2 (K and V) x {layers} layers x {kv} KV heads x {d} x {per_elem} bytes = {answer:,}.",
                           layers=layers, kv=kv, d=d, per_elem=per_elem, answer=answer)),
        wrong, chapter)


# ------------------------------------------------------------------ chapters 5 and 6
@dataclass(frozen=True)
class PlannedRequest:
    """One request's share of the next step, as ``plan_next_step`` predicts it."""

    request_id: str
    num_tokens: int
    is_prefill: bool  # False: one new token over a cached context (a decode)


def plan_next_step(snapshot: EngineSnapshot, enable_chunked_prefill: bool = True) -> list[PlannedRequest]:
    """What the FCFS scheduler (``engine/scheduler.py``) will schedule next, from a snapshot.

    Running requests first, each ``num_tokens - num_computed_tokens`` capped by what is left
    of the budget; then waiting requests in order while budget and sequence slots last, a
    prompt longer than the budget cut into a chunk (or, without chunked prefill, waiting).
    The snapshot does not carry waiting prompts' tokens, so this assumes they hit nothing in
    the prefix cache, and it refuses (ValueError) a step that would run out of KV blocks
    (the scheduler would then preempt, chapter 5's other lesson).
    """
    if snapshot.scheduling_policy != "fcfs":
        raise ValueError(f"plan_next_step follows the fcfs policy; this engine runs "
                         f"{snapshot.scheduling_policy!r}")
    budget, bs = snapshot.max_num_batched_tokens, snapshot.block_size
    plan: list[PlannedRequest] = []
    new_blocks = 0
    seats = len(snapshot.running)
    for r in snapshot.running:
        if budget <= 0:
            break
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        plan.append(PlannedRequest(r.request_id, n, not (n == 1 and r.num_computed_tokens > 0)))
        new_blocks += max(0, blocks_needed(r.num_computed_tokens + n, bs) - len(r.block_ids))
        budget -= n
    for r in snapshot.waiting:
        if budget <= 0 or seats >= snapshot.max_num_seqs:
            break
        n = r.num_tokens
        if n > budget:
            if not enable_chunked_prefill:
                break
            n = budget
        plan.append(PlannedRequest(r.request_id, n, True))
        new_blocks += blocks_needed(n, bs)
        seats += 1
        budget -= n
    if new_blocks > snapshot.num_free_blocks:
        raise ValueError(f"the next step needs {new_blocks} new KV blocks and {snapshot.num_free_blocks} are free: "
                         f"the scheduler would preempt, which this question does not model; ask it on an engine "
                         f"with more num_kv_blocks")
    return plan


def _describe(p: PlannedRequest | None) -> str:
    if p is None:
        return tr("not scheduled this step")
    if not p.is_prefill:
        return tr("decode, 1 token")
    return tr("prefill, {n} token", n=p.num_tokens) if p.num_tokens == 1 else tr("prefill, {n} tokens", n=p.num_tokens)


def step_question(snapshot: EngineSnapshot, config: EngineConfig, request_id: str, chapter: int = 5) -> Question:
    """Will the next step run ``request_id`` as a prefill or a decode, and how many tokens (chapters 5, 6)?"""
    r = _find_request(snapshot, request_id)
    plan = plan_next_step(snapshot, config.enable_chunked_prefill)
    mine = next((p for p in plan if p.request_id == request_id), None)
    remaining = r.num_tokens - r.num_computed_tokens
    budget = snapshot.max_num_batched_tokens
    state = tr("status {status}, {prompt} prompt tokens, {output} generated, {computed} of its {total} tokens in the "
               "KV cache", status=r.status, prompt=r.num_prompt_tokens, output=r.num_output_tokens,
               computed=r.num_computed_tokens, total=r.num_tokens)
    others = [p for p in plan if p.request_id != request_id]
    if mine is not None and not mine.is_prefill:
        right = tr("One new token over a context that is all in the cache: a decode.")
    elif mine is not None and mine.num_tokens < remaining:
        right = tr("{remaining} token(s) are not in the cache yet; the step gives it {n} of them (a chunk: the "
                   "budget left is smaller), which is prefill work.", remaining=remaining, n=mine.num_tokens)
    elif mine is not None:
        right = tr("{remaining} token(s) are not in the cache yet; the step gives it {n} of them, which is prefill "
                   "work.", remaining=remaining, n=mine.num_tokens)
    else:
        right = tr("The {budget}-token budget (or the sequence slots) are used up by requests ahead of it "
                   "({ahead} tokens), so it waits a step.", budget=budget, ahead=sum(p.num_tokens for p in others))
    candidates = [
        (tr("decode, 1 token"), tr("A decode needs every earlier token in the cache and exactly one new one; "
                                   "{remaining} are still to compute.", remaining=remaining) if remaining != 1 else
         tr("It would decode if it were scheduled, but the budget ran out before it.")),
        (tr("prefill, {n} token", n=remaining) if remaining == 1 else tr("prefill, {n} tokens", n=remaining),
         tr("That ignores the budget: the scheduler gives it only what is left after the requests ahead of it "
            "(chunked prefill).") if mine is None or mine.num_tokens < remaining else
         tr("One remaining token over a cached context is the decode case, not a prefill.")),
        (tr("prefill, {n} tokens", n=budget), tr("The budget is shared: requests ahead of it take their tokens "
                                                 "first, and nobody gets more tokens than it still needs.")),
        (tr("not scheduled this step"), tr("There is budget and a sequence slot left for it this step.")),
    ]
    if r.num_computed_tokens:
        candidates.append((tr("prefill, {n} tokens", n=r.num_tokens),
                           tr("That recomputes the whole sequence; the {computed} tokens already in the cache are "
                              "not computed again.", computed=r.num_computed_tokens)))
    answer = _describe(mine)
    wrong = [(text, why) for text, why in candidates if text != answer]
    ahead = plan[:plan.index(mine)] if mine is not None else others
    return make_question(
        tr("Request {request_id}: {state}. The token budget is {budget} per step, and the requests scheduled before "
           "it in the next step take {ahead} tokens. What does the next step do with {request_id}?",
           request_id=request_id, state=state, budget=budget, ahead=sum(p.num_tokens for p in ahead)),
        (answer, right), wrong, chapter)


def step_tokens_question(snapshot: EngineSnapshot, config: EngineConfig, chapter: int = 5) -> Question:
    """How many tokens does the next step schedule in total (chapters 5 and 6)?"""
    plan = plan_next_step(snapshot, config.enable_chunked_prefill)
    answer = sum(p.num_tokens for p in plan)
    budget = snapshot.max_num_batched_tokens
    wanted = sum(r.num_tokens - r.num_computed_tokens for r in snapshot.running) + \
        sum(r.num_tokens for r in snapshot.waiting)
    running = sum(r.num_tokens - r.num_computed_tokens for r in snapshot.running)
    rows = "; ".join(tr("{request_id} {status} {computed}/{total} tokens cached", request_id=r.request_id,
                        status=r.status, computed=r.num_computed_tokens, total=r.num_tokens)
                     for r in snapshot.running + snapshot.waiting)
    wrong = [
        (str(wanted), tr("That gives every request all it still needs; the step's token budget caps the total.")),
        (str(budget), tr("The budget is a ceiling, not a quota: a step schedules less when the requests need less.")),
        (str(len(plan)), tr("That counts requests, one token each, as if every request were decoding.")),
        (str(running), tr("That schedules the running requests only; continuous batching also admits waiting ones "
                          "into the same step while budget is left.")),
        (str(answer + 1), tr("One too many: count each request's remaining tokens exactly; a decoding request "
                             "computes exactly one.")),
        (str(sum(r.num_tokens for r in snapshot.running + snapshot.waiting)),
         tr("That recomputes every request's whole sequence; tokens already in the KV cache are not computed "
            "again.")),
    ]
    chunked = tr("chunked prefill on") if config.enable_chunked_prefill else tr("chunked prefill off")
    return make_question(
        tr("Token budget {budget} per step, at most {max_num_seqs} sequences, {chunked}. Requests (running first, "
           "then waiting): {rows}. How many tokens does the next step compute?",
           budget=budget, max_num_seqs=snapshot.max_num_seqs, chunked=chunked, rows=rows),
        (str(answer), tr("Running requests first, each its remaining tokens within the budget, then waiting ones "
                         "while budget and slots last: {plan} = {answer}.",
                         plan=", ".join(f"{p.request_id} {p.num_tokens}" for p in plan), answer=answer)),
        wrong, chapter)


# ------------------------------------------------------------------ chapter 7
def prefix_hits(snapshot: EngineSnapshot, prompt: Sequence[int]) -> list[int]:
    """The cached blocks a new request with ``prompt`` would reuse, from the snapshot's digests.

    Chains the prompt's full blocks exactly as the block manager names them
    (``hash_block``), stops at the first block whose digest is not cached, and never
    counts the block that holds the prompt's last token (its logits must be computed).
    """
    bs = snapshot.block_size
    by_hash = {b.block_hash: b for b in snapshot.blocks if b.is_cached and b.block_hash is not None}
    hits, parent = [], None
    for i in range((len(prompt) - 1) // bs):
        digest = hash_block(parent, prompt[i * bs:(i + 1) * bs])
        block = by_hash.get(digest)
        if block is None or block.parent_hash != parent:
            break
        hits.append(block.block_id)
        parent = digest
    return hits


def prefix_hit_question(snapshot: EngineSnapshot, prompt: Sequence[int], chapter: int = 7) -> Question:
    """How many of a prompt's blocks would the prefix cache serve (chapter 7)?"""
    bs = snapshot.block_size
    prompt = list(prompt)
    if len(prompt) < 1:
        raise ValueError("the prompt is empty")
    hits = len(prefix_hits(snapshot, prompt))
    cached = [b for b in snapshot.blocks if b.is_cached and b.block_hash is not None]
    by_hash = {b.block_hash for b in cached}
    parents = {b.parent_hash for b in cached}
    # The "block by block" mistake: count every block whose tokens are cached anywhere, after
    # any prefix, as if digests were not chained (a block's tokens under some cached parent).
    unchained = sum(1 for i in range((len(prompt) - 1) // bs)
                    if any(hash_block(p, prompt[i * bs:(i + 1) * bs]) in by_hash for p in parents))
    full = len(prompt) // bs

    def text(n: int) -> str:
        if n == 1:
            return tr("{n} block ({skipped} tokens skipped)", n=n, skipped=n * bs)
        return tr("{n} blocks ({skipped} tokens skipped)", n=n, skipped=n * bs)

    wrong = [
        (text(full), tr("All {full} full blocks: but a hit is a chain from the first block that stops at the first "
                        "miss, and the block holding the last prompt token is always computed (its logits are "
                        "needed to sample).", full=full)),
        (text(hits + 1), tr("One too many: the chain stops at the first block whose digest is not in the cache.")),
        (text(unchained), tr("That looks each block up on its own tokens. Digests are chained (parent digest + "
                             "tokens), so equal tokens after a different prefix do not match.")),
        (text(0), tr("There are cached blocks whose chained digests match the start of this prompt.")),
    ]
    if hits == 0:
        wrong[-1] = (text(1), tr("No cached block has the digest of this prompt's first block."))
    return make_question(
        tr("The prefix cache holds {cached} block digests (blocks of {bs} tokens). A new request arrives with a "
           "{length}-token prompt. How many of its blocks does the prefix cache serve?",
           cached=len(cached), bs=bs, length=len(prompt)),
        (text(hits), tr("Chaining SHA-256 digests over the prompt's blocks, the first {hits} are in the cache and "
                        "the next one is not (or holds the last token, which must be computed).", hits=hits)),
        wrong, chapter)


# ------------------------------------------------------------------ chapter 8
def _token_set(ids: Sequence[int], labels: Sequence[str] | None) -> str:
    shown = [repr(labels[i]) if labels is not None else str(i) for i in sorted(ids)]
    return "{" + ", ".join(shown) + "}"


def sampling_question(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0, labels: Sequence[str] | None = None, max_kept: int = 8,
                      chapter: int = 8) -> Question:
    """Which tokens survive the sampler's filters on these logits (chapter 8)?

    ``logits`` is one row (V,), e.g. ``engine.next_token_logits(prompt)``; ``labels`` names
    the tokens (``[engine.decode([i]) for i in range(V)]``) or, if None, ids are shown. The
    answer is ``nanoengine.layers.sampler.kept_mask``, the engine's own code.
    """
    row = torch.as_tensor(logits, dtype=torch.float32).reshape(-1)
    if temperature <= 0:
        raise ValueError("temperature 0 is greedy: exactly one token survives, nothing to ask")

    def kept(t=temperature, k=top_k, p=top_p, m=min_p) -> list[int]:
        return torch.nonzero(kept_mask(row[None], t, k, p, m)[0]).flatten().tolist()

    answer = kept()
    if len(answer) > max_kept:
        raise ValueError(f"{len(answer)} tokens survive; choose a smaller top_k, top_p or larger min_p so at most "
                         f"{max_kept} do (the options list them)")
    order = torch.argsort(row, descending=True).tolist()
    wrong = []
    if top_p < 1.0 and min_p == 0.0:
        # the boundary mistake: stop *before* the token whose probability crosses p
        left = set(kept(p=1.0))  # what top-k left (computed once: ``order`` spans the whole vocabulary)
        survivors = [i for i in order if i in left]  # best first
        probs = torch.softmax(row[survivors] / temperature, dim=-1)
        within = max(1, int((probs.cumsum(0) <= top_p).sum().item()))
        wrong.append((_token_set(survivors[:within], labels),
                      tr("That stops before the token that crosses p. Top-p keeps the smallest set whose mass "
                         "reaches p, so the token that crosses it stays.")))
    if top_p < 1.0 and temperature != 1.0:
        wrong.append((_token_set(kept(t=1.0), labels),
                      tr("That applies the filters to the unscaled logits. Temperature comes first and changes "
                         "the probabilities that top-p adds up.")))
    if top_k > 0:
        wrong.append((_token_set(kept(k=0), labels),
                      tr("That ignores top-k: only the k highest logits may survive.")))
        wrong.append((_token_set(order[:top_k], labels) if top_p < 1.0 or min_p > 0 else None,
                      tr("That applies top-k alone; top-p and min-p then cut the tail of what top-k kept.")))
    wrong.append((_token_set(order[:len(answer) + 1], labels),
                  tr("One token too many: the next token in rank order is cut by the filters.")))
    if len(answer) > 1:
        wrong.append((_token_set(order[:len(answer) - 1], labels),
                      tr("One token too few: the last survivor passes every filter.")))
    wrong = [(t, w) for t, w in wrong if t is not None and t.count(",") < max_kept + 2]
    top = ", ".join(f"{(repr(labels[i]) if labels is not None else i)}: {row[i]:.2f}" for i in order[:max_kept + 2])
    return make_question(
        tr("Next-token logits, highest first: {top}, ... With temperature {temperature}, top_k {top_k}, top_p "
           "{top_p}, min_p {min_p}, which tokens can be sampled?",
           top=top, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        (_token_set(answer, labels), tr("The engine's filters in order (temperature, top-k, top-p, min-p) keep "
                                        "exactly these {n}.", n=len(answer))),
        wrong, chapter)


# ------------------------------------------------------------------ chapter 9
def allreduce_bytes_question(model: torch.nn.Module, dtype_bytes: int, num_tokens: int, tp_size: int,
                             chapter: int = 9) -> Question:
    """How many bytes do the row-parallel all-reduces carry in one step (chapter 9)?

    Counted from ``model``'s own module tree: every ``RowParallelLinear`` (attention's
    o_proj, the MLP's down_proj) ends in one all-reduce of a (tokens, output features)
    tensor, and every rank contributes the whole tensor whatever ``tp_size`` is.
    """
    from nanoengine.layers.linear import RowParallelLinear

    if num_tokens < 1 or tp_size < 2:
        raise ValueError(f"need num_tokens >= 1 and tp_size >= 2, got {num_tokens} and {tp_size}")
    c = model.config
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    answer = sum(num_tokens * m.weight.shape[0] * dtype_bytes for m in rows)
    per_layer = len(rows) // c.num_hidden_layers
    wrong = [
        (f"{answer // per_layer:,}" if per_layer > 1 else None,
         tr("That is one all-reduce per layer; attention's o_proj and the MLP's down_proj end in one each "
            "({per_layer} per layer).", per_layer=per_layer)),
        (f"{answer // tp_size:,}", tr("That divides by the {tp_size} ranks. A row-parallel rank's output is full "
                                      "width (a partial sum of every feature), so each rank contributes all of it.",
                                      tp_size=tp_size)),
        (f"{answer * c.intermediate_size // c.hidden_size:,}",
         tr("That uses the MLP's intermediate width {intermediate}; what is summed is down_proj's output, {hidden} "
            "wide.", intermediate=c.intermediate_size, hidden=c.hidden_size)),
        (f"{answer // num_tokens:,}" if num_tokens > 1 else None,
         tr("That is one token; the step runs {num_tokens}, each with its own row of partial sums.",
            num_tokens=num_tokens)),
        (f"{answer * 8:,}", tr("That is bits, not bytes.")),
    ]
    wrong = [(t, w) for t, w in wrong if t is not None]
    return make_question(
        tr("The loaded model ({layers} layers, hidden size {hidden}, {dtype_bytes}-byte numbers) runs at "
           "tensor_parallel_size={tp_size}. One decode step serves {num_tokens} sequences. How many bytes do the "
           "row-parallel all-reduces carry in that step (one rank's contribution, all all-reduces together)?",
           layers=c.num_hidden_layers, hidden=c.hidden_size, dtype_bytes=dtype_bytes, tp_size=tp_size,
           num_tokens=num_tokens),
        (f"{answer:,}", tr("{rows} row-parallel layers ({per_layer} per layer x {layers}) x {num_tokens} tokens x "
                           "{hidden} x {dtype_bytes} bytes = {answer:,}.", rows=len(rows), per_layer=per_layer,
                           layers=c.num_hidden_layers, num_tokens=num_tokens, hidden=c.hidden_size,
                           dtype_bytes=dtype_bytes, answer=answer)),
        wrong, chapter)
