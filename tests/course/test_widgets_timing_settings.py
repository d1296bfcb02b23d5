"""widgets.timing_settings: a timing's settings come from the engine's configuration."""

from __future__ import annotations

import types

import pytest
import torch

from widgets.timing_settings import run_settings


def _engine(dtype, mode):
    return types.SimpleNamespace(config=types.SimpleNamespace(torch_dtype=dtype), forward_mode=mode)


def test_settings_name_batch_context_dtype_threads_and_mode() -> None:
    line = run_settings(_engine(torch.float32, "compiled (whole model)"), batch=1, context=1049, threads=2)
    assert line == "batch 1, 1,049-token context, float32, 2 threads, compiled (whole model)"  # the engine's words
    eager = run_settings(_engine(torch.bfloat16, "eager"), batch="B", context="14-30", threads=1)
    assert eager == "batch B, 14-30-token context, bfloat16, 1 thread, eager"
    bare = run_settings(batch=1, context=8, dtype=torch.float32, compiled=True, threads=1)  # a kernel, no engine
    assert bare.endswith("compiled (torch.compile on the fused ops)")
    assert f"{torch.get_num_threads()} thread" in run_settings(batch=8, context=1024, dtype=torch.float32)


def test_settings_need_an_engine_or_a_dtype() -> None:
    with pytest.raises(ValueError, match="engine or a dtype"):
        run_settings(batch=1, context=16)
