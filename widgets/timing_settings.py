"""Under which settings a timing was measured, in one line (chapters 4, 6 and 7).

A decode step or a TTFT of the same model on the same machine can differ by 2x between
chapters: a batch of 64 against one request, a 1,000-token context against 16, float32
against bfloat16, one thread against two, eager against compiled. So every printed step
time or TTFT says which, from the engine's own configuration (``EngineConfig``) and torch's
thread count at the moment of printing, never from prose:

    >>> run_settings(engine, batch=1, context=1049)
    'batch 1, 1,049-token context, float32, 2 threads, eager'
"""

from __future__ import annotations

import torch


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def run_settings(engine=None, *, batch: int | str, context: int | str, dtype: torch.dtype | str | None = None,
                 compiled: bool | None = None, threads: int | None = None) -> str:
    """``batch B, C-token context, dtype, T threads, eager|compiled`` for one measurement.

    ``engine`` (an ``LLMEngine``) supplies the dtype and how it runs the model
    (``LLMEngine.forward_mode``); ``dtype`` and ``compiled`` give them for a bare kernel
    timed without an engine.
    ``context`` is the tokens each sequence attends over (a number, or words such as
    ``"14-30"``); ``threads`` defaults to torch's thread count now.
    """
    if engine is not None:
        dtype = engine.config.torch_dtype if dtype is None else dtype
    if dtype is None:
        raise ValueError("run_settings needs an engine or a dtype")
    threads = torch.get_num_threads() if threads is None else threads
    ctx = f"{context:,}" if isinstance(context, int) else str(context)
    if compiled is None and engine is not None:
        mode = engine.forward_mode  # the backend's words: "eager (one native call per decoder layer)", "eager", ...
    else:
        mode = "compiled (torch.compile on the fused ops)" if compiled else "eager"
    return f"batch {batch}, {ctx}-token context, {_dtype_name(dtype)}, {threads} thread{'s' * (threads != 1)}, {mode}"


__all__ = ["run_settings"]
