"""The kernels a model's layers call, chosen by the device backend before the model is built (chapter 10).

vLLM decides how each layer computes when the layer is constructed (a linear layer's
``quant_method``, ``Attention``'s backend, a ``CustomOp``'s forward for the platform); this engine
does the same with one object, the backend's ``LayerKernels``. ``loader.build_model`` builds a model
inside ``building_with(kernels)``; each layer reads ``current_kernels()`` in its ``__init__`` and
keeps what it will call as an attribute whose class attribute is the readable eager function
(``RMSNorm.norm_fn``, ``Sampler.probs_fn`` ...), never changed afterwards. A field left None means
that eager function (``F.linear``, the reference attention): a model built outside any backend
reads and runs like nano-vLLM's.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from nanoengine.layers.attention import AttentionImpl


@dataclass(frozen=True)
class LayerKernels:
    """What a device backend gives the layers of a model built for it (each function with the signature
    of the eager one it replaces)."""

    name: str = "reference"  # a model is run only by a backend whose kernels have its name
    rms_norm: Callable | None = None  # RMSNorm's two functions (layers.layernorm)
    add_rms_norm: Callable | None = None
    rotate_half: Callable | None = None  # RotaryEmbedding's rotation (layers.rotary)
    silu_and_mul: Callable | None = None  # SiluAndMul's function
    sampling_probs: Callable | None = None  # the Sampler's filters (layers.sampler)
    linear_method: Callable | None = None  # makes each GEMM layer's linear_method, once, in its constructor
    attention: AttentionImpl | None = None  # the AttentionImpl every Attention layer calls
    # Given a just-built decoder layer, its one-call version, or None where it has none (backends.cpu_fused).
    decoder_layer: Callable | None = None


REFERENCE = LayerKernels()
# The kernels of the models this thread is building now, innermost last (per thread: ``serve``
# builds its engine on a thread of its own while the main thread goes on).
_building = threading.local()


def current_kernels() -> LayerKernels:
    """The kernels of the model being built on this thread (``REFERENCE`` outside ``building_with``)."""
    stack = getattr(_building, "stack", None)
    return stack[-1] if stack else REFERENCE


@contextlib.contextmanager
def building_with(kernels: LayerKernels) -> Iterator[LayerKernels]:
    """While inside, every layer this thread constructs takes its kernels from ``kernels``."""
    stack = _building.__dict__.setdefault("stack", [])
    stack.append(kernels)
    try:
        yield kernels
    finally:
        stack.pop()
