"""The model runner for a CPU: what only a CPU needs, kept out of the generic runner (chapter 10).

A GPU engine gets three things for free that a CPU engine must arrange itself, and this
subclass of ``ModelRunner`` does them:

* **Prepacked GEMM weights.** oneDNN multiplies fastest with weights reordered into its
  blocked layout; ``kernels.cpu_gemm`` reorders every linear layer's weight once, at load
  (a copy: ``memory_report().packed_weight_bytes``). For a single row (one sequence
  decoding) plain ``F.linear`` can be the faster way, depending on the CPU, so
  ``cpu_gemm.tune_single_row`` times both once per weight shape and ``cpu_gemm.linear``
  keeps the winner.
* **Reused host memory.** PyTorch's CUDA caching allocator keeps freed blocks for the next
  step; on a CPU glibc hands large blocks back to the kernel and faults them in again.
  ``engine.host_memory.keep_freed_memory`` changes two malloc settings so they stay.
* **Logits in chunks.** A step's logits are (rows, vocab) float32: 256 rows of a
  49,152-token vocabulary are 50 MB, more than glibc's largest heap block (32 MiB), so they
  would be mapped fresh every step, faulted in by the LM head and unmapped when freed
  (the overhead benchmark's 256-row decode step was measured more than twice as slow in
  one chunk: ``results/README.md``). So the LM head runs on chunks of rows of at most
  ``LOGITS_CHUNK_BYTES`` and each chunk is sampled before the next is computed.

``model_runner_class(device)`` picks this class for a CPU and ``ModelRunner`` otherwise;
the engine and the tensor-parallel workers call it once, when they build their runner.
"""

from __future__ import annotations

import torch

from nanoengine.engine.host_memory import keep_freed_memory
from nanoengine.engine.model_runner import BatchPlan, ModelRunner, ModelRunnerOutput, _nbytes
from nanoengine.engine.profiler import NO_PROFILER, StepProfiler
from nanoengine.engine.request import Request
from nanoengine.kernels import cpu_gemm
from nanoengine.layers.sampler import SampleResult

# A chunk's logits stay under glibc's 32 MiB mmap threshold (``engine.host_memory``), so
# they come from the reused heap.
LOGITS_CHUNK_BYTES = 30 * 1024 * 1024


class CpuModelRunner(ModelRunner):
    """``ModelRunner`` with prepacked weights, kept host memory and chunked logits."""

    def prepare_model(self) -> int:
        """Keep freed memory, prepack every GEMM weight, pick the faster one-row product."""
        keep_freed_memory()
        packable = [module for module in self.model.modules() if hasattr(module, "pack_weight")]
        self.packed_weights = sum(module.pack_weight() for module in packable)
        cpu_gemm.tune_single_row(packable)
        return sum(_nbytes(m.weight) for m in packable if m.packed_weight is not None)

    def logits_rows_per_chunk(self, num_rows: int) -> int:
        """How many rows of logits one LM-head call computes.

        At most ``LOGITS_CHUNK_BYTES`` of float32 logits, and at most the hidden size: then
        a chunk's logits are no more values than the head's weight, so each call writes no
        more than it reads. Small heads get small chunks that stay in cache for the sampler;
        a big head is not streamed from memory again for every few rows.
        """
        by_bytes = LOGITS_CHUNK_BYTES // (4 * self.model_config.vocab_size)
        return max(1, min(num_rows, self.model_config.hidden_size, by_bytes))

    @torch.inference_mode()
    def execute_model(self, plan: BatchPlan, sampled: list[Request],
                      profiler: StepProfiler = NO_PROFILER) -> ModelRunnerOutput:
        """Inputs, forward pass, then logits and sampling chunk by chunk (see the module docstring)."""
        with profiler.phase("prepare"):
            model_input = self.prepare_inputs(plan)
        with profiler.phase("model"):
            hidden = self.sampled_hidden(model_input)
        token_ids, logprobs = [], []
        step = self.logits_rows_per_chunk(hidden.shape[0])
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            with profiler.phase("model"):
                logits = self.logits(hidden[rows])
            with profiler.phase("sample"):
                result = self.sample(logits, sampled[rows])
            del logits  # freed before the next chunk is computed, so its memory is reused
            token_ids += result.token_ids
            logprobs += result.logprobs
        return ModelRunnerOutput.of(sampled, SampleResult(token_ids, logprobs))


def model_runner_class(device: torch.device | str) -> type[ModelRunner]:
    """The runner for ``device``: ``CpuModelRunner`` on a CPU, the generic ``ModelRunner`` elsewhere."""
    return CpuModelRunner if torch.device(device).type == "cpu" else ModelRunner
