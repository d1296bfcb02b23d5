"""How one request turns logits into tokens, and when it stops (chapter 8).

``SamplingParams`` is validated when it is built, so a bad value never reaches the
engine: each error says which field was wrong, the value given, and what is allowed
(in vLLM's words where vLLM has them). What only the engine knows (the vocabulary, the
model length, ``max_num_seqs``) is checked when a request enters it
(``InputProcessor.check_params``). ``StructuredOutputsParams`` (chapter 14) is checked
here for its shape only: ``nanoengine.structured_output`` compiles it when the request is added.
"""

from __future__ import annotations

import enum
import json as json_lib
from collections.abc import Callable
from dataclasses import dataclass, field

# The largest lists a request may carry: every step searches a request's new text for each stop string and
# checks its new token against each stop token id, so a million of them (a body of a few megabytes) would slow
# every request sharing its steps. OpenAI's API takes at most 4 stop strings; vLLM sets no limit.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # top-N logprobs per token, as vLLM's default max_logprobs
# A constraint is compiled on a thread before its request runs (chapter 14): its text is bounded
# so that one request cannot hold that thread for long. Real schemas are a few kilobytes.
MAX_CONSTRAINT_CHARS = 65_536
MAX_CHOICES = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")  # StructuredOutputsParams' constraints


class RequestOutputKind(enum.Enum):
    """When ``LLMEngine.step`` hands out a request's output (vLLM's names).

    CUMULATIVE: every step that gave the request a token, with all its text and tokens so far and
        the ``delta`` since the last output; each output copies the whole completion, costlier as it grows.
    DELTA: every step that gave the request a token, with only what is new since its last output
        (``text``, equal to ``delta``, and the new tokens' ``token_ids`` and ``logprobs``), for a
        stream reader to append (``LLM.stream``, the server's streams); ``cumulative_logprob`` and
        ``metrics`` still cover the whole request; the final output carries its last delta and finish reason.
    FINAL_ONLY: once, when the request has finished, so no text is made before then: no
        per-step detokenization or output objects (``LLM.generate`` asks for this), except
        that a request with stop strings is detokenized as it goes (still reported once).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The constraint a request's output must satisfy (vLLM's names; exactly one is given).

    json: a JSON schema (a dict, or its JSON text): the output is a JSON value it accepts.
    regex: a regular expression the whole output matches.
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar in Lark syntax (llguidance's dialect: ``start: ...``).
    json_object: True: the output is a JSON object, any object (OpenAI's ``json_object`` mode).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS[:-1])} or json_object=True; "
                             f"got {'none' if not given else ', '.join(given)}")
        if self.json is not None:
            text = json_lib.dumps(self.json) if isinstance(self.json, dict) else self.json
            if not isinstance(text, str):
                raise ValueError(f"structured_outputs json must be a JSON schema (a dict or its text), "
                                 f"got {shown(self.json)} ({type(self.json).__name__})")
            if not isinstance(self.json, dict):
                try:
                    schema = json_lib.loads(text)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs json is not valid JSON text: {exc}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"structured_outputs json must be a JSON schema (an object), got {shown(schema)}")
            _check_constraint_size("json", text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs {name} must be a non-empty string, got {shown(value)}")
                _check_constraint_size(name, value)
        if self.choice is not None:
            choice = _as_tuple("structured_outputs choice", self.choice, "a list of strings")
            if not choice or len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs choice must hold 1 to {MAX_CHOICES} strings, got {len(choice)}")
            for c in choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs choice must hold non-empty strings, got {shown(c)}")
            _check_constraint_size("choice", "".join(choice))
            object.__setattr__(self, "choice", choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs json_object must be True, False or None, "
                             f"got {shown(self.json_object)}")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str | tuple[str, ...] | bool:
        """The constraint itself; a JSON schema as its text (so that it can be a cache key). The
        keys keep their order: a schema's properties are generated in the order it lists them."""
        value = getattr(self, self.kind)
        return json_lib.dumps(value) if isinstance(value, dict) else value


def _check_constraint_size(name: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs {name} has {len(text)} characters; at most {MAX_CONSTRAINT_CHARS} "
                         f"are allowed")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM's names).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set of tokens whose probability sums to at least top_p.
    min_p: drop tokens whose probability is below min_p times the top token's.
    max_tokens: how many tokens to generate at most.
    seed: a per-request generator: the same seed gives the same text whatever else shares the batch.
    stop: strings that end generation (not included in the text).
    stop_token_ids: token ids that end generation (in addition to EOS).
    ignore_eos: keep going past the end-of-sequence token (benchmarks use this).
    logprobs: return the log-probabilities of the top-N tokens at each step.
    n: how many completions of the prompt to return (parallel sampling). The prompt is computed
        once and its KV blocks are shared by the n sequences. With a seed, completion i draws from
        its own generator seeded ``seed + i``, reproducible whatever else is in the batch.
    output_kind: when ``LLMEngine.step`` reports the request and what it holds (``RequestOutputKind``).
    structured_outputs: None, or the constraint the output must satisfy (``StructuredOutputsParams``):
        every token is drawn from those it allows next (logprobs are those of that masked
        distribution), and the request finishes ("stop") when the constraint is complete.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple("stop", stop, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids,
                                                             "a list of token ids"))
        _check_number("temperature", self.temperature, float, "non-negative and finite (0 means greedy)",
                      lambda t: 0.0 <= t < float("inf"))  # inf would divide every logit to 0: uniform noise
        # top_k's upper bound, the vocabulary, is the engine's to check
        _check_number("top_k", self.top_k, int, "-1 or 0 (disable), or at least 1", lambda k: k >= -1)
        _check_number("top_p", self.top_p, float, "in (0, 1]", lambda p: 0.0 < p <= 1.0)
        _check_number("min_p", self.min_p, float, "in [0, 1]", lambda p: 0.0 <= p <= 1.0)
        _check_number("max_tokens", self.max_tokens, int, "at least 1", lambda m: m >= 1)
        if self.seed is not None:
            _check_number("seed", self.seed, int, "None or an integer in [0, 2**63)", lambda s: 0 <= s < 2**63)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {shown(s)}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop holds a string of {len(s)} characters ({s[:20]!r}...); each may have at "
                                 f"most {MAX_STOP_STRING_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                             f"are allowed")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {shown(t)}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, int, f"None or an integer in [0, {MAX_LOGPROBS}]",
                          lambda k: 0 <= k <= MAX_LOGPROBS)
        _check_number("n", self.n, int, "an integer >= 1 (the number of completions)", lambda n: n >= 1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind "
                             f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be None or a StructuredOutputsParams (json=, regex=, choice=, "
                             f"grammar= or json_object=True), got {shown(self.structured_outputs)} "
                             f"({type(self.structured_outputs).__name__})")

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the argmax."""
        return self.temperature == 0.0

    @property
    def has_filters(self) -> bool:
        """True when top-k, top-p or min-p may cut tokens (their defaults cut none); a sampled row without
        one draws from the softmax of its scaled logits, with nothing to sort or cut (chapter 8)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _as_tuple(name: str, value: object, expected: str) -> tuple:
    """A list-like field as a tuple (None means empty, as in vLLM); anything else is refused."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be {expected}, got {shown(value)} ({type(value).__name__})")
    return tuple(value)


def _check_number(name: str, value: object, kind: type, allowed: str, ok: Callable[[int | float], bool]) -> None:
    """Refuse non-numbers (and bools), NaN, numbers the engine's tensors cannot hold (an integer beyond
    64 bits, or one too large for a float where a float belongs), and values ``ok`` refuses, with a
    message naming the field, the value and what is ``allowed``."""
    allowed_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed_types):
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {expected}, got {shown(value)} ({type(value).__name__})")
    if kind is float and value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if kind is int and not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must be an integer in [-2**63, 2**63) (64 bits), got {shown(value)}")
    if kind is float and isinstance(value, int) and abs(value) > 2**1023:  # float(value) would overflow
        raise ValueError(f"{name} must be a finite number, got {shown(value)}")
    if not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {shown(value)}")


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters; a huge integer by its size (Python
    refuses to turn one of more than 4,300 digits into text, and a message should not repeat a megabyte)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**24:
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
