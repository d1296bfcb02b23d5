"""widgets.timing_settings: a timing's settings come from the engine's configuration."""

from __future__ import annotations

import types

import pytest
import torch

from widgets.timing_settings import run_settings


def _engine(dtype, compile_):
    return types.SimpleNamespace(config=types.SimpleNamespace(torch_dtype=dtype, compile=compile_))


def test_settings_name_batch_context_dtype_threads_and_mode() -> None:
    line = run_settings(_engine(torch.float32, False), batch=1, context=1049, threads=2)
    assert line == "batch 1, 1,049-token context, float32, 2 threads, eager"
    compiled = run_settings(_engine(torch.bfloat16, True), batch="B", context="14-30", threads=1)
    assert compiled == "batch B, 14-30-token context, bfloat16, 1 thread, compiled (torch.compile on the fused ops)"
    assert f"{torch.get_num_threads()} thread" in run_settings(batch=8, context=1024, dtype=torch.float32)


def test_settings_need_an_engine_or_a_dtype() -> None:
    with pytest.raises(ValueError, match="engine or a dtype"):
        run_settings(batch=1, context=16)
