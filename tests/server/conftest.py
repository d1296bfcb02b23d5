"""Fixtures the server's end-to-end tests share (test_serve_api, test_serve_clients).

Each module starts its own ``server`` (they differ in what they record or limit) from its
own ``CONFIG``, and bounds its requests by its ``TIMEOUT``; these fixtures read both from
the module that uses them, so they always match its server: ``offline`` is the same tiny
engine run without a server, and ``client`` the official ``openai`` client pointed at
the module's server.
"""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def offline(request, build_tiny_llm):
    """The module's engine (its ``CONFIG``, the same weights) run offline: the reference
    every served token is checked against."""
    return build_tiny_llm(request.module.CONFIG)


@pytest.fixture()
def client(request, server) -> openai.OpenAI:
    """The ``openai`` client for the module's ``server`` (no retries: a failure shows at once)."""
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                       timeout=request.module.TIMEOUT) as c:
        yield c
