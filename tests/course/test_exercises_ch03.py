"""Chapter 3's exercise checks judge what an engine did: right on the solutions, not yet otherwise."""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine
from nanoengine.loader.weights import random_model
from widgets import tiny_engine
from widgets.exercises import ch03


def _mqa_engine(kv_heads: int) -> LLMEngine:
    return LLMEngine.from_model(random_model("tiny-llama", num_key_value_heads=kv_heads), None, device="cpu",
                                num_kv_blocks=64, block_size=4, max_model_len=64)


@pytest.mark.parametrize("check", [ch03.check_block_size, ch03.check_kv_heads, ch03.check_pool_size])
def test_an_untouched_scaffold_is_not_yet(check) -> None:
    result = check(...)
    assert not result.right and "TODO" in str(result)
    assert not check("an engine").right


@pytest.mark.parametrize("block_size, right", [(8, True), (4, False), (16, False), (6, False)])
def test_block_size(block_size: int, right: bool) -> None:
    result = ch03.check_block_size(tiny_engine(block_size=block_size, num_kv_blocks=64))
    assert result.right is right, str(result)
    assert str(result).startswith(f"Exercise 3.1: {'right.' if right else 'not yet. Hint:'}")


@pytest.mark.parametrize("kv_heads, right", [(1, True), (2, False), (4, False)])
def test_kv_heads(kv_heads: int, right: bool) -> None:
    assert ch03.check_kv_heads(_mqa_engine(kv_heads)).right is right


@pytest.mark.parametrize("blocks, right", [(20, True), (19, False), (21, False), (64, False)])
def test_pool_size(blocks: int, right: bool) -> None:
    result = ch03.check_pool_size(tiny_engine(num_kv_blocks=blocks, block_size=4))
    assert result.right is right, str(result)


def test_pool_size_keeps_the_block_size() -> None:
    assert not ch03.check_pool_size(tiny_engine(num_kv_blocks=10, block_size=8)).right
