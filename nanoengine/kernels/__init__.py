"""The paged-KV kernels: a PyTorch reference, the CPU's native C++ kernels and Triton for CUDA.

``reference.py`` is the specification, ``triton_kernels.py`` the CUDA path, ``cpu_native.py`` the
CPU's. The engine's device backend (``nanoengine.backends``) chooses among them once, when the engine
is built; the functions below are for tools and notebooks that want "the path the engine would take"
for their tensors. Triton is imported only when first needed: importing the engine needs no GPU toolchain.
"""

from __future__ import annotations

import functools

import torch

from nanoengine.kernels import cpu_native, reference


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the triton package can be imported (it is loaded lazily)."""
    try:
        import triton  # noqa: F401
    except Exception:  # an absent or broken triton simply means "use the reference"
        return False
    return True


def _triton_for(tensor: torch.Tensor):
    """The Triton module when ``tensor`` lives on CUDA and Triton is usable, else None."""
    if tensor.is_cuda and triton_available():
        from nanoengine.kernels import triton_kernels

        return triton_kernels
    return None


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write K/V into their cache slots (see ``reference.store_kv``)."""
    impl = _triton_for(key) or reference
    impl.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Decode attention over the paged cache (see ``reference.paged_decode_attention``)."""
    impl = _triton_for(query) or (cpu_native if runs_native(query) else reference)
    return impl.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    """Chunked/prefix-aware prefill attention (see ``reference.paged_prefill_attention``)."""
    impl = _triton_for(query) or (cpu_native if runs_native(query) else reference)
    return impl.paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def runs_native(tensor: torch.Tensor) -> bool:
    """Whether the CPU engine would run its native kernels on ``tensor`` (built here, its dtype one they take)."""
    return tensor.device.type == "cpu" and tensor.dtype in cpu_native.DTYPES and cpu_native.load()


__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "runs_native", "triton_available"]
