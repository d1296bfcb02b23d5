"""The soak benchmark's pieces (``nanobench/soak.py``; the hour itself is not a CI test).

Its requests must be what they claim: a good one passes the server's own parsing and
checks, a bad one is refused by them; and its summary must say "levelled off" exactly
when the growth over the second half is within the bound.
"""

from __future__ import annotations

import json
import random

import pytest

from nanobench import soak
from nanoengine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                                    parse_request)


def _check(request: soak.SoakRequest) -> None:
    """Parse and check a drawn request as the server does (``OpenAIServing``'s first steps)."""
    model = CompletionRequest if request.path == "/v1/completions" else ChatCompletionRequest
    body = request.body if isinstance(request.body, str) else json.dumps(request.body)
    parsed = parse_request(model, body.encode())
    parsed.check_supported()
    parsed.to_sampling_params()  # SamplingParams' checks (ValueError)
    if isinstance(parsed, CompletionRequest):
        for prompt in parsed.prompts():
            if not isinstance(prompt, str) and len(prompt) > soak.MAX_MODEL_LEN:
                raise ValueError("prompt longer than max_model_len")


def test_drawn_requests_are_good_or_bad_as_they_say():
    rng = random.Random(0)
    kinds = {"good": 0, "bad": 0, "stream": 0, "abort": 0, "chat": 0}
    for _ in range(2000):
        request = soak.draw_request(rng)
        if request.bad:
            kinds["bad"] += 1
            with pytest.raises((ProtocolError, ValueError)):
                _check(request)
        else:
            kinds["good"] += 1
            _check(request)
            kinds["stream"] += request.stream
            kinds["abort"] += request.abort_after_chunks is not None
            kinds["chat"] += request.path == "/v1/chat/completions"
    assert all(count > 0 for count in kinds.values()), kinds  # the mix holds every kind


@pytest.mark.parametrize("growth, levelled", [(0.0, True), (64.0, True), (64.5, False), (-30.0, True)])
def test_the_summary_levels_off_within_the_bound(growth, levelled):
    samples = [{"minute": m, "rss_mib": 1000.0 + (growth if m > 2 else 0.0), "peak_rss_mib": 1100.0, "failed": 0}
               for m in range(0, 5)]
    summary = soak.summarize(samples, bound_mib=64.0)
    assert summary["second_half_from_minute"] == 2 and summary["rss_mib"]["second_half_growth"] == growth
    assert summary["levelled_off"] is levelled
