"""The CUDA backend: Triton kernels and CUDA graphs (chapters 3, 4 and 10).

On a GPU the PyTorch reference kernels would run as hundreds of small launches per layer; this backend runs
the Triton kernels of ``kernels.triton_kernels`` instead (store-KV, paged decode and prefill attention), and
replays decode-only steps from CUDA graphs (``backends.cuda_graphs``) unless ``enforce_eager`` is set. With
``compile=True`` the layers' small fused ops are compiled (``backends.compilation``). Weights stay as loaded
(cuBLAS packs its tiles on the fly, so ``F.linear`` is the GEMM). Without Triton the reference kernels run
(correct, slow), with no graphs.
"""

from __future__ import annotations

import torch

from nanoengine.backends.base import Backend
from nanoengine.backends.compilation import compile_runner, compiled_kernels
from nanoengine.kernels import triton_available
from nanoengine.layers.attention import AttentionMetadata, ReferenceAttention
from nanoengine.layers.kernels import LayerKernels


class TritonAttention(ReferenceAttention):
    """The Triton kernels, called as the reference's (the same signatures); each checks its arguments first."""

    name = "triton"

    def __init__(self) -> None:
        from nanoengine.kernels import triton_kernels  # imports triton: only when this backend is built

        self.kernels = triton_kernels


class CudaBackend(Backend):
    """Triton attention and CUDA graphs for decode (bucketed batch sizes)."""

    name = "cuda"

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.bfloat16, compile: bool = False,
                 cuda_graph_max_batch: int = 0, max_model_len: int | None = None) -> None:
        super().__init__(device, dtype)
        self.compile = compile  # torch.compile the small fused ops (backends.compilation)
        self.has_triton = triton_available()
        if self.has_triton:
            self.attention = TritonAttention()
        self.cuda_graph_max_batch = cuda_graph_max_batch if self.has_triton else 0
        self.max_model_len = max_model_len
        self.cuda_graphs = None

    def layer_kernels(self) -> LayerKernels:
        """The reference layer functions and the Triton attention; with ``compile=True`` the small ops compiled."""
        kernels = super().layer_kernels()
        return compiled_kernels(kernels) if self.compile else kernels

    def prepare_forward(self, runner) -> None:
        """Compile first (when asked, timed: ``runner.compilation``), then capture: graphs record compiled kernels."""
        if self.compile:
            runner.compilation = compile_runner(runner)
        if self.cuda_graph_max_batch:
            from nanoengine.backends.cuda_graphs import CudaGraphDecoder

            max_len = self.max_model_len or runner.model_config.max_position_embeddings
            self.cuda_graphs = CudaGraphDecoder(runner.model, self.cuda_graph_max_batch, -(-max_len // self.block_size),
                                                self.device)
            self.cuda_graphs.capture()

    def forward_mode(self) -> str:
        mode = "eager with compiled fused ops" if self.compile else "eager"
        return f"{mode}, CUDA graphs for decode" if self.cuda_graph_max_batch else mode

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)  # kernels are launched asynchronously

    def forward(self, model, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            return self.cuda_graphs.run(input_ids, positions, meta)
        return super().forward(model, input_ids, positions, meta)
