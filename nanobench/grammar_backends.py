"""Grammar-constrained decoding on a CPU: llguidance against xgrammar on the engine's tokenizer.

Constrained decoding (vLLM's ``structured_outputs``) lets a request ask for output that follows a JSON
schema, a regular expression, a list of choices or a grammar. Each step, before sampling, a *matcher*
fills a packed bitmask (one bit per token of the vocabulary, 32 tokens per int32 word) with the tokens
that keep the output valid; the sampler sets the other logits to -inf; the sampled token is then
*accepted*, which moves the matcher on. The engine will not write its own matcher: it will use one of
the two maintained libraries that run on a CPU, llguidance (vLLM's ``guidance`` backend; no Python
dependencies) or xgrammar (vLLM's default; it needs torch). This module measures both, on the engine's
default tokenizer (SmolLM2-135M-Instruct, 49,152 tokens):

1. tokenizer setup: what each library precomputes once per tokenizer;
2. cold compile of every constraint in ``CONSTRAINTS`` (no cache): schema or grammar text to a matcher
   ready for its first mask;
3. per step, along a valid output (``Constraint.sample``, tokenized as the tokenizer does, then EOS):
   the mask fill and the accept, timed apart. Each step asserts that the next token is allowed and that
   the mask refuses something: a timing of a wrong mask would be worthless;
4. whether both libraries allow the same number of tokens at each step (reported, not asserted: their
   whitespace and string rules may differ).

``python -m nanobench.grammar_backends [--out FILE] [--quick]`` writes
``results/grammar-backends-cpu-<date>.json``; ``results/README.md`` describes its fields and what the
engine chose from it. ``report(results_dir)`` reads the newest file back for a reader, computing every
sentence from the file's numbers. Neither library is imported until it is measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nanobench.provenance import command_today

LIBRARIES = ("llguidance", "xgrammar")
RESULTS_GLOB = "grammar-backends-*.json"
DECODE_STEP_MS = 10.0  # the low end of the default model's single-stream decode step on a CPU (10-35 ms, results/)
NEGLIGIBLE_SHARE = 0.01  # a mask under 1% of a decode step cannot decide between the libraries
LEVEL = 0.10  # ratios within 10% of 1 read as level: timings on a shared 2-core VM move by more


# ------------------------------------------------------------------ the constraints


@dataclass(frozen=True)
class Constraint:
    """One constrained request: what it asks for in each library's own syntax, and an output that obeys it.

    ``kind`` is vLLM's name for the request field: ``json`` (a JSON schema), ``json_object`` (any JSON
    object), ``regex``, ``choice`` or ``grammar``. ``spec`` is the schema (a dict), the pattern, the list
    of choices, or for a grammar ``{"lark": ..., "ebnf": ...}`` (llguidance reads Lark, xgrammar GBNF-style
    EBNF). ``sample`` is a valid output, walked token by token.
    """

    name: str
    kind: str
    spec: object
    sample: str

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_object", "regex", "choice", "grammar"):
            raise ValueError(f"kind must be json, json_object, regex, choice or grammar, got {self.kind!r}")
        if self.kind == "grammar" and not (isinstance(self.spec, dict) and {"lark", "ebnf"} <= self.spec.keys()):
            raise ValueError("a grammar constraint needs its text in both syntaxes: spec={'lark': ..., 'ebnf': ...}")

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")


def _schema(properties: dict, **extra) -> dict:
    """An object schema whose properties are all required and no others allowed: xgrammar's strict mode
    (its default) refuses unlisted properties, llguidance follows JSON Schema and allows them unless told;
    saying it in the schema gives both the same language."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}


FLAT = _schema({"name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"}})
NESTED = _schema({
    "order_id": {"type": "string"},
    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    "customer": _schema({"name": {"type": "string"}, "email": {"type": "string"}}),
    "items": {"type": "array", "items": _schema({"sku": {"type": "string"}, "quantity": {"type": "integer"},
                                                 "unit_price": {"type": "number"}})},
    "tags": {"type": "array", "items": {"type": "string"}}})
PATTERNS = _schema({
    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "city": {"type": "string", "minLength": 2, "maxLength": 24},
    "score": {"type": "number", "minimum": 0, "maximum": 100},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5}})
CATALOGUE = _schema(  # the largest: definitions, references and a union of two object shapes
    {"store": {"type": "string"}, "currency": {"enum": ["EUR", "USD", "GBP"]},
     "entries": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/book"}, {"$ref": "#/$defs/film"}]}}},
    **{"$defs": {
        "person": _schema({"first": {"type": "string"}, "last": {"type": "string"}}),
        "book": _schema({"kind": {"const": "book"}, "title": {"type": "string"},
                         "authors": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                         "pages": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}),
        "film": _schema({"kind": {"const": "film"}, "title": {"type": "string"},
                         "director": {"$ref": "#/$defs/person"}, "minutes": {"type": "integer", "minimum": 1},
                         "rating": {"enum": ["G", "PG", "PG-13", "R"]}, "price": {"type": "number"}})}})

ARITHMETIC_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITHMETIC_EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
CHOICES = ["positive", "negative", "neutral", "mixed"]

CONSTRAINTS = (
    Constraint("json: flat object", "json", FLAT, json.dumps({"name": "Ada Lovelace", "age": 36, "active": True})),
    Constraint("json: nested, arrays and enums", "json", NESTED, json.dumps({
        "order_id": "A-1042", "status": "shipped", "customer": {"name": "Grace Hopper", "email": "grace@navy.mil"},
        "items": [{"sku": "KB-01", "quantity": 2, "unit_price": 49.5}, {"sku": "MS-7", "quantity": 1,
                                                                         "unit_price": 19.99}],
        "tags": ["priority", "gift"]})),
    Constraint("json: patterns and ranges", "json", PATTERNS, json.dumps({
        "date": "2026-12-07", "code": "ABC-1234", "city": "Lisbon", "score": 87.5, "rating": 4})),
    Constraint("json: definitions and a union", "json", CATALOGUE, json.dumps({
        "store": "Corner Books", "currency": "EUR", "entries": [
            {"kind": "book", "title": "The Art of Computer Programming",
             "authors": [{"first": "Donald", "last": "Knuth"}], "pages": 672, "price": 79.9},
            {"kind": "film", "title": "Hidden Figures", "director": {"first": "Theodore", "last": "Melfi"},
             "minutes": 127, "rating": "PG", "price": 9.99}]})),
    Constraint("json_object", "json_object", {"type": "object"}, json.dumps({
        "summary": "Paged attention stores the KV cache in blocks.", "points": [1, 2.5, None],
        "nested": {"ok": False}})),
    Constraint("regex: ISO date-time", "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
               "2026-12-07T14:03:59Z"),
    Constraint("choice", "choice", CHOICES, "neutral"),
    Constraint("grammar: arithmetic", "grammar", {"lark": ARITHMETIC_LARK, "ebnf": ARITHMETIC_EBNF},
               "(12+345)*6-78/(9+10)"),
)


# ------------------------------------------------------------------ the two libraries


class LlguidanceBackend:
    """llguidance: a Rust matcher with a lazily built lexer; compiling is building the ``LLMatcher``.

    JSON is compiled with the library's defaults, which vLLM's ``guidance`` backend also uses when
    ``disable_any_whitespace`` is off: ``whitespace_flexible`` (any run of space, tab, CR, LF between
    tokens), separators "," and ":". A choice list is a Lark alternation. The mask is filled by
    ``llguidance.numpy.fill_next_token_bitmask`` into a NumPy int32 array (no torch needed).
    """

    name = "llguidance"
    settings = {"json": "library defaults: whitespace_flexible true (any [ \\t\\n\\r]+ between tokens), "
                        "separators ',' and ':'", "choice": "Lark alternation start: \"a\" | \"b\" | ...",
                "mask": "llguidance.numpy.fill_next_token_bitmask into a NumPy int32 array",
                "cache": "none: every LLMatcher builds its grammar afresh"}

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    @staticmethod
    def grammar(constraint: Constraint) -> str:
        from llguidance import LLMatcher

        if constraint.is_json:
            return LLMatcher.grammar_from_json_schema(constraint.spec)
        if constraint.kind == "regex":
            return LLMatcher.grammar_from_regex(constraint.spec)
        if constraint.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.spec))
        return LLMatcher.grammar_from_lark(constraint.spec["lark"])

    def matcher(self, constraint: Constraint):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.grammar(constraint))
        if matcher.is_error():
            raise ValueError(f"llguidance refused {constraint.name!r}: {matcher.get_error()}")
        return matcher

    def bitmask(self) -> np.ndarray:
        from llguidance.numpy import allocate_token_bitmask

        return allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32)) int32

    @staticmethod
    def fill(matcher, bitmask) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def finished(matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    @staticmethod
    def words(bitmask) -> np.ndarray:
        return bitmask[0]


class XgrammarBackend:
    """xgrammar: a C++ matcher that precomputes, at compile time, which tokens each grammar position
    accepts (its adaptive token mask cache); compiling is ``GrammarCompiler.compile_*`` plus a
    ``GrammarMatcher``.

    The compiler is built with ``cache_enabled=False`` so every compile is cold (vLLM keeps the cache on,
    so a repeated schema costs it nothing) and the library's default ``max_threads`` (8). JSON uses its
    defaults, which vLLM's ``xgrammar`` backend also passes: ``any_whitespace=True``, separators "," and
    ":", ``strict_mode=True`` (no unlisted properties or items). A choice list is an EBNF alternation, as
    vLLM writes it. The mask goes into ``xgrammar.allocate_token_bitmask``'s torch int32 tensor.
    """

    name = "xgrammar"
    settings = {"json": "library defaults: any_whitespace true (any whitespace between tokens, no count "
                        "limit), separators ',' and ':', strict_mode true", "choice": "EBNF alternation "
                        "root ::= \"a\" | \"b\" | ...", "mask": "GrammarMatcher.fill_next_token_bitmask "
                        "into xgrammar.allocate_token_bitmask (a torch int32 tensor)",
                "cache": "GrammarCompiler(cache_enabled=False): every compile is cold"}

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)

    def compile(self, constraint: Constraint):
        if constraint.is_json:
            return self.compiler.compile_json_schema(json.dumps(constraint.spec))
        if constraint.kind == "regex":
            return self.compiler.compile_regex(constraint.spec)
        if constraint.kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in constraint.spec))
        return self.compiler.compile_grammar(constraint.spec["ebnf"])

    def matcher(self, constraint: Constraint):
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(constraint))

    def bitmask(self):
        import xgrammar

        return xgrammar.allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32)) torch.int32

    @staticmethod
    def fill(matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def finished(matcher) -> bool:
        return matcher.is_terminated()

    @staticmethod
    def words(bitmask) -> np.ndarray:
        return bitmask[0].numpy()  # shares the tensor's memory


BACKENDS = {"llguidance": LlguidanceBackend, "xgrammar": XgrammarBackend}


# ------------------------------------------------------------------ one walk


def allowed(words: np.ndarray, token: int) -> bool:
    """Whether ``token``'s bit is set in a packed mask (bit ``token % 32`` of word ``token // 32``)."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def allowed_count(words: np.ndarray, vocab_size: int) -> int:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    return int(bits[:vocab_size].sum())


@dataclass
class Walk:
    """One cold pass of a constraint: compile seconds, then per step the fill and accept seconds and the
    number of tokens the mask allowed (``masks`` keeps each mask's words when asked, for comparing)."""

    compile_s: float
    fill_s: list[float] = field(default_factory=list)
    accept_s: list[float] = field(default_factory=list)
    allowed: list[int] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)


def walk(backend, constraint: Constraint, tokens: list[int], eos: int, keep_masks: bool = False) -> Walk:
    """Compile ``constraint`` afresh and walk ``tokens`` then ``eos`` through it, timing each fill and
    accept apart. Raises AssertionError where a mask refuses the next token, allows every token, or where
    the matcher has not finished after EOS: the timings would be of a wrong mask."""
    bitmask = backend.bitmask()
    start = time.perf_counter()
    matcher = backend.matcher(constraint)
    result = Walk(compile_s=time.perf_counter() - start)
    words = backend.words(bitmask)
    vocab = backend.vocab_size
    for step, token in enumerate([*tokens, eos]):
        start = time.perf_counter()
        backend.fill(matcher, bitmask)
        filled = time.perf_counter()
        count = allowed_count(words, vocab)
        assert allowed(words, token), (f"{backend.name}, {constraint.name}: step {step} mask refuses the valid "
                                       f"next token {token}")
        assert count < vocab, f"{backend.name}, {constraint.name}: step {step} mask allows every token"
        start_accept = time.perf_counter()
        accepted = backend.accept(matcher, token)
        result.accept_s.append(time.perf_counter() - start_accept)
        assert accepted, f"{backend.name}, {constraint.name}: step {step} refused token {token} its mask allowed"
        result.fill_s.append(filled - start)
        result.allowed.append(count)
        if keep_masks:
            result.masks.append(words.copy())
    assert backend.finished(matcher), f"{backend.name}, {constraint.name}: not finished after EOS"
    return result


# ------------------------------------------------------------------ the measurement


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def step_summary(per_repeat: list[list[float]]) -> dict:
    """Per step, the median over repeats; then over the steps their median, 90th percentile and maximum,
    in microseconds, and the first step's apart (a lazy library pays its first lexer states there)."""
    per_step = [statistics.median(column) * 1e6 for column in zip(*per_repeat)]
    return {"median_us": statistics.median(per_step), "p90_us": percentile(per_step, 90), "max_us": max(per_step),
            "first_us": per_step[0], "total_us": sum(per_step)}


def agreement(first: Walk, second: Walk, tokenizer, examples: int = 3) -> dict:
    """How often llguidance's masks (``first``) and xgrammar's (``second``) allowed the same number of
    tokens, and the same tokens, step by step; the same once the tokenizer's special tokens (``<|im_start|>``
    and the like: text no JSON string should hold) are left out; the tokens each allowed that the other
    never did; and, for the first steps where they differ, the counts and a few tokens only one allowed."""
    steps = len(first.allowed)
    special = np.zeros(first.masks[0].size * 32, dtype=bool)
    special[list(tokenizer.all_special_ids)] = True
    same_count = sum(a == b for a, b in zip(first.allowed, second.allowed))
    same_mask = same_plain = 0
    only = {"llguidance": np.zeros_like(special), "xgrammar": np.zeros_like(special)}
    differing = []
    for step, (a, b) in enumerate(zip(first.masks, second.masks)):
        bits_a = np.unpackbits(a.view(np.uint8), bitorder="little").astype(bool)
        bits_b = np.unpackbits(b.view(np.uint8), bitorder="little").astype(bool)
        same_mask += bool(np.array_equal(bits_a, bits_b))
        same_plain += bool(np.array_equal(bits_a & ~special, bits_b & ~special))
        only["llguidance"] |= bits_a & ~bits_b
        only["xgrammar"] |= bits_b & ~bits_a
        if len(differing) < examples and not np.array_equal(bits_a, bits_b):
            differing.append({"step": step, "allowed": [first.allowed[step], second.allowed[step]],
                              "only_llguidance": tokenizer.convert_ids_to_tokens(
                                  np.flatnonzero(bits_a & ~bits_b)[:5].tolist()),
                              "only_xgrammar": tokenizer.convert_ids_to_tokens(
                                  np.flatnonzero(bits_b & ~bits_a)[:5].tolist())})
    return {"steps": steps, "same_count": same_count, "same_count_fraction": same_count / steps,
            "same_mask": same_mask, "same_mask_fraction": same_mask / steps,
            "same_mask_without_special_tokens": same_plain,
            "special_tokens_only_in": {name: np.flatnonzero(bits & special).tolist() for name, bits in only.items()},
            "other_tokens_only_in": {name: int((bits & ~special).sum()) for name, bits in only.items()},
            "first_differences": differing}


def measure(backends: dict, constraints, tokenizer, eos: int, repeats: int) -> list[dict]:
    """Every constraint through every backend, ``repeats`` cold walks each (the libraries alternating
    within a repeat, so both see the same load); one row per constraint."""
    rows = []
    for constraint in constraints:
        tokens = tokenizer.encode(constraint.sample, add_special_tokens=False)
        walks = {name: [] for name in backends}
        for repeat in range(repeats):
            for name, backend in backends.items():
                walks[name].append(walk(backend, constraint, tokens, eos, keep_masks=repeat == 0))
        row = {"name": constraint.name, "kind": constraint.kind, "sample": constraint.sample,
               "sample_tokens": len(tokens), "steps": len(tokens) + 1, "spec": constraint.spec, "libraries": {}}
        for name, runs in walks.items():
            compile_ms = [w.compile_s * 1e3 for w in runs]
            row["libraries"][name] = {
                "compile_ms": {"median": statistics.median(compile_ms), "min": min(compile_ms),
                               "max": max(compile_ms), "runs": compile_ms},
                "fill": step_summary([w.fill_s for w in runs]), "accept": step_summary([w.accept_s for w in runs]),
                "allowed_per_step": runs[0].allowed}
        if set(LIBRARIES) <= walks.keys():
            row["agreement"] = agreement(walks["llguidance"][0], walks["xgrammar"][0], tokenizer)
        rows.append(row)
    return rows


def time_setup(cls, tokenizer, vocab_size: int, repeats: int) -> tuple[object, dict]:
    """Build ``cls``'s per-tokenizer state ``repeats`` times; the last one is kept for measuring."""
    seconds, backend = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        backend = cls(tokenizer, vocab_size)
        seconds.append(time.perf_counter() - start)
    ms = [s * 1e3 for s in seconds]
    return backend, {"median_ms": statistics.median(ms), "runs_ms": ms}


def library_record(name: str) -> dict:
    from importlib.metadata import requires, version

    needs = [r for r in (requires(name) or []) if "extra ==" not in r]
    return {"version": version(name), "requires": needs}


def environment() -> dict:
    import platform

    import torch
    import transformers

    from nanobench.timing import cpu_model, source_revision

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "platform": platform.platform(), "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(), "nanoengine_revision": source_revision(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run(out: str | None = None, quick: bool = False, command: str | None = None) -> dict:
    """Measure both libraries on the default model's tokenizer; print a summary and write the file."""
    from nanoengine.loader.weights import load_model_config, load_tokenizer, resolve_model_source

    load_at_start = load_average()
    source = resolve_model_source(None)
    tokenizer = load_tokenizer(source)
    vocab_size = load_model_config(source).vocab_size
    repeats, setup_repeats = (2, 1) if quick else (7, 3)
    backends, setup = {}, {}
    for name, cls in BACKENDS.items():
        backends[name], setup[name] = time_setup(cls, tokenizer, vocab_size, setup_repeats)
    rows = measure(backends, CONSTRAINTS, tokenizer, tokenizer.eos_token_id, repeats)
    results = {
        "kind": "grammar backends on a CPU",
        "model": source.name, "vocab_size": vocab_size, "tokenizer_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id, "repeats": repeats, "setup_repeats": setup_repeats,
        "libraries": {name: {**library_record(name), "setup": setup[name], "settings": BACKENDS[name].settings}
                      for name in BACKENDS},
        "method": ("per constraint and repeat, each library compiles the constraint cold and walks the sample "
                   "output's tokens then EOS: fill the mask (timed), check the next token is allowed and that "
                   "not every token is, accept it (timed apart). Per step the median over repeats; fill and "
                   "accept report the median, 90th percentile and maximum of those over the steps, the first "
                   "step and their total, in microseconds. Agreement compares the first repeat's masks."),
        "rows": rows,
        "load_average": {"start": load_at_start, "end": load_average()}, "environment": environment(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "format": "results/README.md",
    }
    path = Path(out) if out else Path("results") / f"grammar-backends-cpu-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    results["file"] = path.name
    print(describe(results))
    print("reading:" + reading(results))
    print(f"results written to {path}")
    return results


# ------------------------------------------------------------------ reading a file back


def summary(data: dict) -> dict:
    """Per library, over the file's constraints: the median of their median fills, the worst p90 fill,
    the median and worst compile, the median accept, and its setup."""
    out = {}
    for name in LIBRARIES:
        cells = [row["libraries"][name] for row in data["rows"]]
        out[name] = {"fill_median_us": statistics.median(c["fill"]["median_us"] for c in cells),
                     "fill_worst_p90_us": max(c["fill"]["p90_us"] for c in cells),
                     "accept_median_us": statistics.median(c["accept"]["median_us"] for c in cells),
                     "compile_median_ms": statistics.median(c["compile_ms"]["median"] for c in cells),
                     "compile_worst_ms": max(c["compile_ms"]["median"] for c in cells),
                     "setup_ms": data["libraries"][name]["setup"]["median_ms"]}
    return out


def describe(data: dict) -> str:
    """Every constraint's figures, with the file's provenance, as lines of text."""
    env = data["environment"]
    libs = data["libraries"]
    lines = [f"{data.get('file', 'grammar backends')}: {data['date'][:16].replace('T', ' ')} UTC, {env['cpu_model']}, "
             f"{env['cpu_count']} cores, load {data['load_average']['start']} -> {data['load_average']['end']}",
             f"    command: {command_today(data['command'] or '')}",
             f"    {data['model']} tokenizer, vocabulary {data['vocab_size']:,}; " +
             ", ".join(f"{n} {libs[n]['version']} (setup {libs[n]['setup']['median_ms']:.0f} ms)" for n in LIBRARIES),
             f"    {'constraint':<32}{'steps':>6}  " + "  ".join(f"{n + ': compile ms, fill us p50/p90':>40}"
                                                               for n in LIBRARIES) + "  same count"]
    for row in data["rows"]:
        cells = []
        for name in LIBRARIES:
            lib = row["libraries"][name]
            cells.append(f"{lib['compile_ms']['median']:>22.2f} {lib['fill']['median_us']:>8.1f} / "
                         f"{lib['fill']['p90_us']:<7.1f}")
        agree = row.get("agreement")
        lines.append(f"    {row['name']:<32}{row['steps']:>6}  " + "  ".join(cells) +
                     (f"  {agree['same_count']}/{agree['steps']}" if agree else ""))
    return "\n".join(lines)


def _ratio(a: float, b: float, a_name: str, b_name: str, what: str) -> str:
    """Which of two times is shorter, or level within ``LEVEL``: ``a`` over ``b``."""
    ratio = a / b
    if abs(ratio - 1) <= LEVEL:
        return f"{what} level ({ratio:.2f}x)"
    return f"{what} {a_name if ratio < 1 else b_name} faster ({max(ratio, 1 / ratio):.1f}x)"


def reading(data: dict) -> str:
    """What the file says for choosing the engine's default, one line each (starting with a newline):
    the mask's share of a decode step, compile, setup, and how often the JSON masks agree."""
    s = summary(data)
    llg, xgr = s["llguidance"], s["xgrammar"]
    worst = max(llg["fill_worst_p90_us"], xgr["fill_worst_p90_us"])
    share = worst / (DECODE_STEP_MS * 1e3)
    if share < NEGLIGIBLE_SHARE:
        verdict = (f"under {NEGLIGIBLE_SHARE:.0%} of a {DECODE_STEP_MS:.0f} ms decode step for both, so mask speed "
                   "cannot decide between them")
    else:
        verdict = (f"{share:.1%} of a {DECODE_STEP_MS:.0f} ms decode step at worst, enough to count: prefer the "
                   "faster mask")
    json_rows = [row["agreement"] for row in data["rows"] if "agreement" in row and row["kind"] in ("json",
                                                                                                   "json_object")]
    steps = sum(a["steps"] for a in json_rows)
    same = sum(a["same_count"] for a in json_rows)
    other = [row["agreement"] for row in data["rows"] if "agreement" in row and row["kind"] not in ("json",
                                                                                                   "json_object")]
    parts = [f"mask fill per step: llguidance median {llg['fill_median_us']:.1f} us, xgrammar "
             f"{xgr['fill_median_us']:.1f} us ({_ratio(llg['fill_median_us'], xgr['fill_median_us'], 'llguidance', 'xgrammar', 'fill')}); "
             f"the worst 90th percentile, {worst:.0f} us, is {verdict}",
             f"cold compile: llguidance median {llg['compile_median_ms']:.2f} ms (worst {llg['compile_worst_ms']:.2f}),"
             f" xgrammar {xgr['compile_median_ms']:.2f} ms (worst {xgr['compile_worst_ms']:.2f}): "
             f"{_ratio(llg['compile_median_ms'], xgr['compile_median_ms'], 'llguidance', 'xgrammar', 'compile')}",
             f"tokenizer setup, once per engine: llguidance {llg['setup_ms']:.0f} ms, xgrammar {xgr['setup_ms']:.0f} ms",
             f"JSON steps where both allow the same number of tokens: {same}/{steps} ({same / steps:.0%})"
             + (f"; regex, choice and grammar steps: {sum(a['same_count'] for a in other)}/"
                f"{sum(a['steps'] for a in other)}" if other else "")]
    return "".join(f"\n  - {part}" for part in parts)


def newest_file(results_dir: Path) -> dict | None:
    """The newest grammar-backends file in ``results_dir`` as its JSON with a ``file`` key, or None."""
    newest = None
    for path in sorted(Path(results_dir).glob(RESULTS_GLOB)):
        data = json.loads(path.read_text())
        data["file"] = path.name
        if newest is None or (data["date"], data["file"]) > (newest["date"], newest["file"]):
            newest = data
    return newest


def report(results_dir: Path) -> str:
    """The newest file, described and read; or how to measure one when there is none."""
    data = newest_file(results_dir)
    if data is None:
        return f"no grammar-backends results in {results_dir}: python -m nanobench.grammar_backends"
    return f"{describe(data)}\nreading ({data['environment']['cpu_model']}):{reading(data)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanobench.grammar_backends", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results file (default results/grammar-backends-cpu-<date>.json)")
    parser.add_argument("--quick", action="store_true", help="2 repeats and 1 tokenizer setup instead of 7 and 3")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    run(out=args.out, quick=args.quick, command=shlex.join(["python", "-m", "nanobench.grammar_backends", *argv]))


if __name__ == "__main__":
    main()
