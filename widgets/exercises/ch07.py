"""Exercise checks of chapter 7 (prefix caching): pool size, block size, prompt layout.

Each check takes the value the learner chose, runs the experiment through the engine's
public API and judges what the prefix cache did (prompt tokens served from it, read from
``RequestOutput.num_cached_tokens``, and evictions, from the snapshot), never the learner's
code and never a timing:

* ``check_pool_size`` (7.1): the smallest KV pool in which two tenants, taking turns, are
  each served their whole system prompt from the cache on every request after their first
  (a tiny random engine: mechanics only, ``widgets.tiny_engine``);
* ``check_prefix_padding`` (7.2): with vLLM's usual 16-token blocks, the fewest shared tokens
  to add to a 100-token shared prefix so that later requests are served every shared token
  (aligning the prefix to whole blocks; tiny engine);
* ``check_prompt_layout`` (7.3): a prompt layout, as a format string, that lets requests
  with different dates and questions share the fixed rules (the real model and tokenizer,
  passed in by the chapter).

``tenant_turns``, ``shared_prefix_hits``, ``padded_prefix_hits`` and ``layout_hits`` are the experiments behind the
checks, kept here so the checks and the worked solutions
(``notebooks/solutions/07_prefix_caching.ipynb``) run the same thing.

The chapter's readings of its timings are computed here from the numbers its cells
measured, so that they say the opposite when the numbers do: ``read_hash_cost`` (section
3), ``read_ttft_agreement`` and ``read_cache_speedup`` (sections 4 and 7).
"""

from __future__ import annotations

import string
from dataclasses import dataclass


from nanoengine import LLM, LLMEngine, SamplingParams
from translations import tr
from widgets._common import TokenSource, single_thread, tiny_engine
from widgets.exercises import CheckResult, todo, verdict, whole

VLLM_SHA256_NS_PER_TOKEN = (100, 200)  # vLLM's design document, docs/design/prefix_caching.md (cited)
# exercise 7.1: two tenants, each with its own system prompt, take turns
TENANT_PROMPT_LEN = 96  # tokens of each tenant's system prompt (6 blocks of 16)
TENANT_QUESTION_LEN = 20  # tokens of each request's own question
TENANT_MAX_TOKENS = 8
TENANT_ROUNDS = 3  # A, B, A, B, A, B
TENANT_MAX_MODEL_LEN = 128  # so a pool needs at least 8 blocks of 16 tokens
# exercise 7.2: a prefix that is not a multiple of 16 tokens
SHARED_PREFIX_LEN = 100
SHARED_SUFFIX_LEN = 20
PADDING_BLOCK_SIZE = 16  # 7.2 keeps the block size vLLM's kernels use; the learner aligns the prefix instead
MAX_PADDING = 64
# exercise 7.3: the rules every prompt carries, and what changes from request to request
LAYOUT_FIELDS = ("rules", "date", "question")
LAYOUT_RULES = (
    "You are the help desk of the Northfield public library. Answer in at most two short sentences. "
    "Opening hours: Monday to Friday 9:00 to 20:00, Saturday 10:00 to 17:00, closed on Sunday and on public "
    "holidays. Members may borrow up to twelve items at once: books for three weeks, films and games for one "
    "week. Renewals are possible online twice, unless someone has reserved the item. Late returns cost twenty "
    "cents per day per item, never more than the item's price. Library cards are free for anyone who lives, "
    "works or studies in Northfield; bring a document with your address. Printing costs ten cents a page. "
    "Never invent a rule that is not listed here: if you do not know, say so and suggest asking at the desk.")
LAYOUT_REQUESTS = (("Monday 3 March", "Can I borrow a film for two weeks?"),
                   ("Tuesday 4 March", "How much is printing?"),
                   ("Wednesday 5 March", "Is the library open on Sunday?"))
LAYOUT_SHARE = 0.8  # later requests must be served at least this share of the rules' tokens


def _run_alone(engine: LLMEngine, prompt, max_tokens: int) -> int:
    """Run one request to the end, alone; return its prompt tokens served from the prefix cache."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    final = None
    while engine.has_request(rid):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final.num_cached_tokens


# ------------------------------------------------------------------ exercise 7.1
@dataclass(frozen=True)
class TurnsResult:
    """What the prefix cache did while two tenants took turns."""

    num_kv_blocks: int
    cached_tokens: tuple[int, ...]  # per request, in order A, B, A, B, ...
    num_evictions: int

    @property
    def later_requests(self) -> tuple[int, ...]:
        """Cached tokens of every request after each tenant's first."""
        return self.cached_tokens[2:]


def tenant_turns(num_kv_blocks: int, block_size: int = 16) -> TurnsResult:
    """Two tenants (A, B), each with its own 96-token system prompt, send requests in turn, one
    at a time; each request adds a 20-token question and generates 8 tokens (tiny engine)."""
    engine = tiny_engine(num_kv_blocks=num_kv_blocks, block_size=block_size, max_model_len=TENANT_MAX_MODEL_LEN)
    source = TokenSource(engine.model_config.vocab_size, seed=7)
    systems = [source.tokens(TENANT_PROMPT_LEN), source.tokens(TENANT_PROMPT_LEN)]
    cached = []
    with single_thread():  # the tiny model's matrices are too small for a second thread to help
        for _ in range(TENANT_ROUNDS):
            for system in systems:
                cached.append(_run_alone(engine, system + source.tokens(TENANT_QUESTION_LEN), TENANT_MAX_TOKENS))
    return TurnsResult(num_kv_blocks, tuple(cached), engine.snapshot().num_evictions)


def check_pool_size(num_kv_blocks) -> CheckResult:
    """7.1: the smallest pool where every later request is served its whole system prompt."""
    low = TENANT_MAX_MODEL_LEN // 16
    if todo(num_kv_blocks):
        return verdict("7.1", False, "", tr("replace ... with a number of 16-token blocks, from {low} (one "
                                            "{max_len}-token request must fit) to 64, then run the cell again.",
                                            low=low, max_len=TENANT_MAX_MODEL_LEN))
    n = whole(num_kv_blocks, low, 64)
    if n is None:
        return verdict("7.1", False, "", tr("num_kv_blocks must be a whole number from {low} to 64, got {value!r}.",
                                            low=low, value=num_kv_blocks))
    r = tenant_turns(n)
    seen = tr("With {n} blocks the requests were served {cached} prompt tokens from the cache ({evictions} "
              "evictions)", n=n, cached=list(r.cached_tokens), evictions=r.num_evictions)
    kept = all(c == TENANT_PROMPT_LEN for c in r.later_requests)
    if not kept:
        return verdict("7.1", False, "", tr("{seen}: the later requests should get all {prompt_len}. Count the "
                                            "blocks both system prompts occupy, plus what one request needs beyond "
                                            "its prompt's shared blocks.", seen=seen, prompt_len=TENANT_PROMPT_LEN))
    smaller = tenant_turns(n - 1) if n > low else None
    if smaller is not None and all(c == TENANT_PROMPT_LEN for c in smaller.later_requests):
        return verdict("7.1", False, "", tr("{seen}. That works, but it is not the smallest pool that does: "
                                            "count the blocks instead of trying values.", seen=seen))
    if smaller is not None:
        success = tr("{seen}; with {fewer} the later requests get only {got}. Both system prompts (6 blocks each) "
                     "stay cached and each request needs 2 blocks of its own; the evictions left are old questions' "
                     "blocks, the least recently used.", seen=seen, fewer=n - 1, got=smaller.later_requests[0])
    else:
        success = tr("{seen}. Both system prompts (6 blocks each) stay cached and each request needs 2 blocks of its "
                     "own; the evictions left are old questions' blocks, the least recently used.", seen=seen)
    return verdict("7.1", True, success, "")


# ------------------------------------------------------------------ exercise 7.2
def shared_prefix_hits(block_size: int, num_requests: int = 3) -> tuple[int, ...]:
    """Prompt tokens served from the cache to each of ``num_requests`` requests that share their
    first 100 tokens and then differ (20 tokens each), run one after another (tiny engine)."""
    max_model_len = 256
    engine = tiny_engine(num_kv_blocks=max(64, -(-2 * max_model_len // block_size)), block_size=block_size,
                         max_model_len=max_model_len)
    source = TokenSource(engine.model_config.vocab_size, seed=3)
    prefix = source.tokens(SHARED_PREFIX_LEN)
    with single_thread():
        return tuple(_run_alone(engine, prefix + source.tokens(SHARED_SUFFIX_LEN), 2) for _ in range(num_requests))


def padded_prefix_hits(padding: int, num_requests: int = 3) -> tuple[tuple[int, ...], int]:
    """(prompt tokens served from the cache per request, shared tokens) when the 100-token shared
    prefix is extended by ``padding`` more shared tokens, with 16-token blocks (tiny engine).

    The requests run one after another; each then adds 20 tokens of its own.
    """
    engine = tiny_engine(num_kv_blocks=64, block_size=PADDING_BLOCK_SIZE, max_model_len=256)
    source = TokenSource(engine.model_config.vocab_size, seed=3)
    shared = source.tokens(SHARED_PREFIX_LEN) + source.tokens(padding)
    with single_thread():
        hits = tuple(_run_alone(engine, shared + source.tokens(SHARED_SUFFIX_LEN), 2) for _ in range(num_requests))
    return hits, len(shared)


def check_prefix_padding(padding) -> CheckResult:
    """7.2: the fewest shared tokens to add so that 16-token blocks cover the whole shared prefix."""
    if todo(padding):
        return verdict("7.2", False, "", tr("replace ... with a number of shared tokens to add (a whole number "
                                            "from 0 to {most}), then run the cell again.", most=MAX_PADDING))
    pad = whole(padding, 0, MAX_PADDING)
    if pad is None:
        return verdict("7.2", False, "", tr("padding must be a whole number from 0 to {most}, got {value!r}.",
                                            most=MAX_PADDING, value=padding))
    hits, shared = padded_prefix_hits(pad)
    seen = tr("With {pad} tokens added the shared prefix is {shared} tokens, and the three requests were served "
              "{hits} of them from the cache", pad=pad, shared=shared, hits=list(hits))
    if not all(h == shared for h in hits[1:]):
        return verdict("7.2", False, "", tr("{seen}: not all of it. Only full {bs}-token blocks whose tokens are "
                                            "all shared can match; the block that holds the first private token "
                                            "never does.", seen=seen, bs=PADDING_BLOCK_SIZE))
    # an aligned prefix stays aligned one block shorter: if that one works too, this was not the fewest
    shorter = pad - PADDING_BLOCK_SIZE
    smaller, smaller_shared = padded_prefix_hits(shorter) if shorter >= 0 else ((), 0)
    if shorter >= 0 and all(h == smaller_shared for h in smaller[1:]):
        return verdict("7.2", False, "", tr("{seen}: all of it, but with fewer added tokens it would be too: what "
                                            "length must a prefix have for its last block to be full?", seen=seen))
    return verdict("7.2", True, tr("{seen}: every shared token, in {blocks} full blocks. A prefix is served whole "
                                   "only if its length is a multiple of the block size; the {prefix_len}-token one "
                                   "lost its last {lost} tokens to a block it shared with private ones.",
                                   seen=seen, blocks=shared // PADDING_BLOCK_SIZE, prefix_len=SHARED_PREFIX_LEN,
                                   lost=SHARED_PREFIX_LEN % PADDING_BLOCK_SIZE), "")


# ------------------------------------------------------------------ exercise 7.3
def _layout_fields(layout: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(layout) if name is not None]


def layout_hits(layout: str, llm: LLM | LLMEngine) -> tuple[tuple[int, ...], int]:
    """(prompt tokens each request was served from the cache, tokens of the rules) for the three
    requests of exercise 7.3 built with ``layout``, run one after another on ``llm``.

    The prefix cache is emptied first, so earlier cells cannot help; each request
    generates one token (its time to first token is what prefix caching shortens).
    """
    engine = llm.engine if isinstance(llm, LLM) else llm
    engine.reset_prefix_cache()
    hits = tuple(_run_alone(engine, layout.format(rules=LAYOUT_RULES, date=date, question=question), 1)
                 for date, question in LAYOUT_REQUESTS)
    return hits, len(engine.tokenizer.encode(LAYOUT_RULES, add_special_tokens=False))


def check_prompt_layout(layout, llm: LLM | LLMEngine) -> CheckResult:
    """7.3: a layout whose later requests are served most of the rules from the prefix cache."""
    if todo(layout):
        return verdict("7.3", False, "", tr("replace ... with a format string that uses {rules}, {date} and "
                                            "{question} once each, then run the cell again."))
    if not isinstance(layout, str):
        return verdict("7.3", False, "", tr("layout must be a string, got {kind}.", kind=type(layout).__name__))
    try:
        fields = _layout_fields(layout)
    except ValueError as error:
        return verdict("7.3", False, "", tr("layout is not a valid format string ({error}).", error=error))
    if sorted(fields) != sorted(LAYOUT_FIELDS):
        return verdict("7.3", False, "", tr("layout must use {{rules}}, {{date}} and {{question}} exactly once "
                                            "each (and no other field), got {fields}.", fields=fields))
    hits, rules_tokens = layout_hits(layout, llm)
    seen = tr("The three requests were served {hits} prompt tokens from the cache (the rules are {rules_tokens} "
              "tokens)", hits=list(hits), rules_tokens=rules_tokens)
    if all(h >= LAYOUT_SHARE * rules_tokens for h in hits[1:]):
        return verdict("7.3", True, tr("{seen}. What every request shares comes first and what changes comes "
                                       "after it, so the chained digests of the rules' blocks match.", seen=seen), "")
    return verdict("7.3", False, "", tr("{seen}. A block matches only if every token before it matches too: "
                                        "whatever changes between requests must come after what they share.",
                                        seen=seen))


# ------------------------------------------------------------------ readings
def read_hash_cost(sha_s_per_block: float, python_s_per_block: float, sha_s_per_token: float) -> str:
    """Section 3's reading of the digest chain's timing: its cost per block in words, against
    Python's ``hash`` of a tuple, and its cost per token against vLLM's cited 100-200 ns."""
    if not (sha_s_per_block > 0 and python_s_per_block > 0 and sha_s_per_token > 0):
        raise ValueError("the times must be > 0 seconds")
    us = 1e6 * sha_s_per_block
    size = (tr("under a microsecond") if us < 1 else tr("about a microsecond") if us < 2 else
            tr("a few microseconds") if us < 10 else tr("tens of microseconds or more"))
    r = sha_s_per_block / python_s_per_block
    versus = (tr("{r:.1f}x Python's hash, several times slower", r=r) if r >= 2 else
              tr("{r:.1f}x Python's hash, somewhat slower", r=r) if r >= 1.25 else
              tr("{r:.2f}x Python's hash, about as fast", r=r) if r >= 0.8 else
              tr("{r:.2f}x Python's hash, faster", r=r))
    ns = 1e9 * sha_s_per_token
    lo, hi = VLLM_SHA256_NS_PER_TOKEN
    fields = dict(size=size, us=us, versus=versus, ns=ns, lo=lo, hi=hi)
    if lo / 3 <= ns <= hi * 3:
        return tr("reading: SHA-256 costs {size} per block here ({us:.1f} µs), {versus}; {ns:.0f} ns per token is "
                  "the same order as vLLM's cited {lo}-{hi} ns per token.", **fields)
    if ns < lo:
        return tr("reading: SHA-256 costs {size} per block here ({us:.1f} µs), {versus}; {ns:.0f} ns per token is "
                  "well below vLLM's cited {lo}-{hi} ns per token.", **fields)
    return tr("reading: SHA-256 costs {size} per block here ({us:.1f} µs), {versus}; {ns:.0f} ns per token is "
              "well above vLLM's cited {lo}-{hi} ns per token.", **fields)


def read_ttft_agreement(engine_s: float, wall_s: float, tolerance: float = 0.05) -> str:
    """How the engine's own TTFT (``metrics.ttft``, median) compares with the wall time of the
    calls (median): the same within ``tolerance``, or by how much and why it differs."""
    if not (engine_s > 0 and wall_s > 0):
        raise ValueError("the times must be > 0 seconds")
    gap = (wall_s - engine_s) / wall_s
    fields = dict(engine=1e3 * engine_s, wall=1e3 * wall_s)
    if abs(gap) <= tolerance:
        return tr("{engine:.0f} ms against {wall:.0f} ms: the same within {tolerance:.0%}", tolerance=tolerance,
                  **fields)
    if gap > 0:
        return tr("{engine:.0f} ms against {wall:.0f} ms: {gap:.0%} below the wall time, which also counts the "
                  "call's own work before the request arrives and after its first token (tokenizing the prompt, "
                  "building the output)", gap=gap, **fields)
    return tr("{engine:.0f} ms against {wall:.0f} ms: {gap:.0%} above the wall time around the whole call, which it "
              "should not be: a noisy run (the two medians may come from different runs)", gap=-gap, **fields)


def read_cache_speedup(speedup: float, token_ratio: float, tolerance: float = 0.10) -> str:
    """Section 7's reading: the TTFT speed-up the cache gave against the ratio of prompt tokens
    computed without and with it (the most skipping tokens could give at a fixed cost per token)."""
    if not (speedup > 0 and token_ratio > 0):
        raise ValueError("both ratios must be > 0")
    share = speedup / token_ratio
    fields = dict(speedup=speedup, ratio=token_ratio)
    if share < 1 - tolerance:
        return tr("reading: the cache gave {speedup:.1f}x against {ratio:.0f}x fewer tokens computed: less, because "
                  "a request pays a cost that does not shrink with the tokens it computes.", **fields)
    if share > 1 + tolerance:
        return tr("reading: the cache gave {speedup:.1f}x against {ratio:.0f}x fewer tokens computed: more than the "
                  "tokens alone explain (the long prefill costs more per token than the short one).", **fields)
    return tr("reading: the cache gave {speedup:.1f}x against {ratio:.0f}x fewer tokens computed: about the ratio "
              "of tokens, so almost nothing is paid per request beyond its tokens.", **fields)


__all__ = ["TurnsResult", "VLLM_SHA256_NS_PER_TOKEN", "read_cache_speedup", "read_hash_cost", "read_ttft_agreement",
           "check_pool_size", "check_prefix_padding", "check_prompt_layout", "layout_hits",
           "padded_prefix_hits", "shared_prefix_hits", "tenant_turns"]
