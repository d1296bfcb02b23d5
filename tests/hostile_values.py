"""Values a hostile client sends, as hypothesis strategies (the request property tests share them).

Every request field gets values at its type's edges and beyond: integers around 0, the
vocabulary, 32 and 64 bits and far past them; floats that are NaN, infinite, negative
zero, subnormal or huge; strings that are empty, huge or odd Unicode (a lone surrogate, a
NUL, a right-to-left mark, emoji, combining marks); lists that are empty or huge; and values
of the wrong type. Mixed with ordinary values, so that most examples get past the first
check and reach the engine.

CI runs a fixed, reproducible set of examples; ``NANOENGINE_FUZZ_RANDOM=1`` explores new
ones and ``NANOENGINE_FUZZ_SCALE=10`` runs ten times as many (as the scheduler's fuzz test).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DERANDOMIZE = not os.environ.get("NANOENGINE_FUZZ_RANDOM")
SCALE = int(os.environ.get("NANOENGINE_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples * SCALE, deadline=None, database=None, derandomize=DERANDOMIZE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


VOCAB = 49152  # SmolLM2's tokenizer, on the tiny test model

EDGE_INTS = st.sampled_from([-2**64, -2**63 - 1, -2**63, -2**31, -2, -1, 0, 1, 2, 7, 20, 21, 255, 256, 257,
                             VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                             2**64, 10**30, 10**400])
EDGE_FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 5e-324, 1e-300, 1e-9, 0.1,
                               0.5, 0.95, 1.0, 1.0000001, 2.0, 100.0, 1e300, 1.7976931348623157e308, -1e-9, -1.0])
ODD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "\udfff", "a\ud800b", "\u202e\u202d", "\ufeff", "🦀" * 40,
                            "e\u0301" * 30, "\n\n\n", "</s>", "<|im_end|>", "\\u0000", "x" * 257,
                            "lorem ipsum " * 300, "\U0010ffff", "𝕳𝖊𝖑𝖑𝖔"])
TEXT = st.one_of(ODD_TEXT, st.text(max_size=40))
WRONG_TYPES = st.sampled_from([None, True, False, "5", "", [], {}, [1], {"a": 1}, 1.5])


def ints(ordinary: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(ordinary, EDGE_INTS, WRONG_TYPES)


def floats(ordinary: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(ordinary, EDGE_FLOATS, WRONG_TYPES)


def token_ids(max_size: int = 12) -> st.SearchStrategy:
    return st.lists(st.one_of(st.integers(0, VOCAB - 1), EDGE_INTS), max_size=max_size)


def string_lists() -> st.SearchStrategy:
    return st.one_of(TEXT, st.lists(TEXT, max_size=4), st.just(["x"] * 40), WRONG_TYPES)


# Each SamplingParams field (vLLM's names): ordinary values, and hostile ones.
ORDINARY_SAMPLING = {
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "top_p": st.sampled_from([0.9, 1.0]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "max_tokens": st.integers(1, 8),
    "seed": st.one_of(st.none(), st.integers(0, 2**32)),
    "stop": st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=4), max_size=2)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "n": st.integers(1, 3),
}
HOSTILE_SAMPLING = {
    "temperature": floats(st.nothing()), "top_k": ints(st.nothing()), "top_p": floats(st.nothing()),
    "min_p": floats(st.nothing()), "max_tokens": ints(st.nothing()), "seed": ints(st.nothing()),
    "stop": string_lists(), "stop_token_ids": st.one_of(token_ids(4), st.just(list(range(300))), WRONG_TYPES),
    "ignore_eos": WRONG_TYPES, "logprobs": ints(st.nothing()), "n": ints(st.nothing()),
}


@st.composite
def mostly_ordinary(draw, required: dict, ordinary: dict, hostile: dict, max_hostile: int = 2) -> dict:
    """A dict with the ``required`` fields and some ``ordinary`` ones, then up to
    ``max_hostile`` fields replaced (or added) with hostile values: most examples are
    refused by the one field that is wrong, and some get through to the engine."""
    fields = draw(st.fixed_dictionaries(required, optional=ordinary))
    for name in draw(st.lists(st.sampled_from(sorted(hostile)), max_size=max_hostile, unique=True)):
        fields[name] = draw(hostile[name])
    return fields


def sampling_fields() -> st.SearchStrategy:
    """Keyword arguments for ``SamplingParams``: mostly ordinary, up to two hostile."""
    return mostly_ordinary({}, ORDINARY_SAMPLING, HOSTILE_SAMPLING)
