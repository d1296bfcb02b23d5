"""Device backends: what a step needs from its hardware, chosen once per engine (chapter 10).

``select_backend`` is called once, when the model runner is built: ``CpuBackend`` on a CPU
(``backends/cpu.py``), ``CudaBackend`` on a CUDA GPU (``backends/cuda.py``), the reference
``Backend`` (``backends/base.py``) anywhere else. The runner and the layers then read like
nano-vLLM's: they call the backend and never ask which device they are on.
"""

from __future__ import annotations

import torch

from nanoengine.backends.base import Backend


def select_backend(device: torch.device | str, *, dtype: torch.dtype | None = None, compile: bool = False,
                   enforce_eager: bool = False, cuda_graph_max_batch: int = 0,
                   max_model_len: int | None = None) -> Backend:
    """The backend for ``device`` and a model in ``dtype`` (None: ``default_dtype(device)``).

    compile: torch.compile the small fused ops (``backends.compilation``); CUDA only (``check_compile``).
    enforce_eager: on a CPU, the layers' Python forward rather than one native call per decoder layer.
    cuda_graph_max_batch: on CUDA, capture decode graphs up to this batch (0: never, enforce_eager).
    max_model_len: the longest sequence a graph's block tables must hold (CUDA).
    """
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if compile:
        check_compile(device)
    if device.type == "cpu":
        from nanoengine.backends.cpu import CpuBackend

        return CpuBackend(device, dtype, fuse_layers=not enforce_eager)
    if device.type == "cuda":
        from nanoengine.backends.cuda import CudaBackend

        return CudaBackend(device, dtype, compile=compile, cuda_graph_max_batch=cuda_graph_max_batch,
                           max_model_len=max_model_len)
    return Backend(device, dtype)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype an engine on ``device`` runs in unless told: bfloat16 on CUDA (its tensor cores'
    format), float32 elsewhere (not every CPU multiplies 16-bit numbers natively)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def check_compile(device: torch.device | str) -> None:
    """``compile=True`` is CUDA's (``backends.compilation`` says why): a clear error on any other
    device, before anything loads."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"compile=True applies to CUDA only, and this engine runs on {device.type!r}. On a CPU "
                         f"the default fast path already runs each decoder layer as one native call, and "
                         f"enforce_eager=True runs the layers' Python forward: leave compile=False")


def check_environment(device: torch.device | str) -> None:
    """Raise a clear error for a bad setting of the backend's own environment variables, before
    any weight loads (on a CPU, the time it may take to move the weights to huge pages)."""
    if torch.device(device).type == "cpu":
        from nanoengine.backends.cpu_platform import move_budget

        move_budget()


__all__ = ["Backend", "check_compile", "check_environment", "default_dtype", "select_backend"]
