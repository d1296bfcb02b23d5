"""Exercise checks for chapter 3, the KV cache (template v2, see ``widgets/exercises/__init__.py``).

Each check takes the engine the learner built and *runs* something on it through the
public API (``add_request``, ``step``, the ``BatchPrepared`` event, ``snapshot()``,
``memory_report()``), then judges what happened: where a token's key and value were
written, what one token costs in the cache, whether two requests fit without preemption.
The text of the learner's code is never read.

3.1  block size: position 20 of a request lands at offset 4 of its third block
3.2  KV heads: a tiny model whose cache costs a quarter of its multi-head twin's
3.3  pool size: the smallest KV pool in which two 40-token requests run side by side
"""

from __future__ import annotations

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import BatchPrepared
from translations import tr
from widgets.exercises import CheckResult, todo, verdict

EX3_PROMPT_TOKENS = 24  # exercise 3.3: each request's prompt ...
EX3_MAX_TOKENS = 16  # ... and how many tokens it generates
EX3_BLOCK_SIZE = 4
MAX_STEPS = 500  # far more than two 40-token requests need, even with preemptions


def _not_an_engine(exercise: str, engine) -> CheckResult | None:
    if todo(engine):
        return verdict(exercise, False, "", tr("replace the ... marked TODO in the scaffold cell and run it again."))
    if not isinstance(engine, LLMEngine):
        return verdict(exercise, False, "", tr("pass the engine the scaffold built (an LLMEngine), not {kind}.",
                                               kind=type(engine).__name__))
    return None


def _prompt(n: int, start: int = 100) -> list[int]:
    return [start + i for i in range(n)]


def slots_of_first_step(engine: LLMEngine, prompt: list[int]) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Run one prefill of ``prompt`` on ``engine`` and return {position: (slot, block table)}
    as the model runner laid them out (the ``BatchPrepared`` event); the request is aborted after."""
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def record(event) -> None:
        if isinstance(event, BatchPrepared):
            for row in event.rows:
                if row.request_id == rid:
                    for position, slot in zip(row.positions, row.slot_mapping):
                        seen[position] = (slot, row.block_table)

    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    unsubscribe = engine.events.subscribe(record)
    try:
        engine.step()
    finally:
        unsubscribe()
        if engine.has_request(rid):
            engine.abort(rid)
    return seen


def check_block_size(engine) -> CheckResult:
    """3.1: position 20 of a fresh request must be written at offset 4 of its third block."""
    problem = _not_an_engine("3.1", engine)
    if problem:
        return problem
    seen = slots_of_first_step(engine, _prompt(EX3_PROMPT_TOKENS))
    slot, table = seen[20]
    bs = engine.config.block_size
    entry = next((i for i, block in enumerate(table) if block == slot // bs), None)
    right = entry == 2 and slot % bs == 4
    success = (tr("with blocks of {bs} tokens, position 20 is in block-table entry 20 // {bs} = 2 (physical "
                  "block {block}) at offset 20 % {bs} = 4: the runner wrote it to slot {slot}.",
                  bs=bs, block=table[2], slot=slot) if right else "")
    return verdict("3.1", right, success,
                   tr("the runner wrote position 20 to slot {slot}: block-table entry {entry}, offset {offset} "
                      "(blocks of {bs} tokens). You need entry 2 and offset 4, so 20 = 2 x block_size + 4.",
                      slot=slot, entry=entry, offset=slot % bs, bs=bs))


def check_kv_heads(engine) -> CheckResult:
    """3.2: the tiny model's cache must cost a quarter of what its multi-head twin's would."""
    problem = _not_an_engine("3.2", engine)
    if problem:
        return problem
    c = engine.model_config
    report = engine.memory_report()
    dtype_bytes = report.kv_bytes_per_token // (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim)
    mha = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * dtype_bytes
    rid = engine.add_request(_prompt(6), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_request(rid) and engine.has_unfinished_requests():
        engine.step()
    ratio = mha / report.kv_bytes_per_token
    right = c.num_attention_heads == 4 and ratio == 4
    fields = dict(kv=c.num_key_value_heads, q=c.num_attention_heads, per_token=report.kv_bytes_per_token, mha=mha)
    return verdict("3.2", right,
                   tr("{kv} KV head for {q} query heads (multi-query attention): {per_token:,} bytes per token "
                      "against {mha:,} for multi-head attention, 4x less, and the model still generates.", **fields),
                   tr("this model caches {kv} KV heads for {q} query heads: {per_token:,} bytes per token, "
                      "{ratio:g}x less than multi-head attention ({mha:,}). Keep the 4 query heads and choose how "
                      "many KV heads they share.", ratio=ratio, **fields))


def run_two_requests(engine: LLMEngine) -> int:
    """Run two different 24-token prompts, 16 new tokens each, side by side to the end;
    return how many times the scheduler preempted a request for lack of KV blocks."""
    before = engine.snapshot().num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=EX3_MAX_TOKENS, ignore_eos=True)
    for start in (100, 150):
        engine.add_request(_prompt(EX3_PROMPT_TOKENS, start), params)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        raise ValueError(tr("the two requests did not finish in {n} steps: the pool is far too small", n=MAX_STEPS))
    return engine.snapshot().num_preemptions - before


def check_pool_size(engine) -> CheckResult:
    """3.3: both requests finish without preemption, and one block fewer would not do."""
    problem = _not_an_engine("3.3", engine)
    if problem:
        return problem
    from widgets import tiny_engine

    blocks, bs = engine.memory_report().num_kv_blocks, engine.config.block_size
    if bs != EX3_BLOCK_SIZE:
        return verdict("3.3", False, "", tr("keep block_size={bs} as in the scaffold; change only num_kv_blocks.",
                                            bs=EX3_BLOCK_SIZE))
    try:
        preempted = run_two_requests(engine)
    except ValueError as exc:
        return verdict("3.3", False, "", tr("{error}. Count the blocks each request holds at its longest.", error=exc))
    if preempted:
        return verdict("3.3", False, "", tr("with {blocks} blocks the scheduler preempted a request {n} time(s): "
                                            "the pool is too small for both at once. Count the blocks each request "
                                            "holds at its longest.", blocks=blocks, n=preempted))
    try:
        smaller = tiny_engine(num_kv_blocks=blocks - 1, block_size=bs, max_model_len=engine.max_model_len)
        tighter = run_two_requests(smaller)
    except ValueError:
        tighter = 1  # one block fewer cannot hold the requests at all
    fields = dict(blocks=blocks, fewer=blocks - 1, bs=bs)
    return verdict("3.3", tighter > 0,
                   tr("{blocks} blocks of {bs} tokens: both requests (24 + 16 tokens each) run to the end side by "
                      "side, and with {fewer} the scheduler must preempt one.", **fields),
                   tr("{blocks} blocks are enough, but so are {fewer}: find the smallest pool. Each request ends "
                      "with 24 + 16 tokens; how many {bs}-token blocks is that, for two?", **fields))
