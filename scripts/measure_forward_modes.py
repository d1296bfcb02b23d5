"""The CPU forward modes before engine v4's item 1, one per process (results/README.md).

    for mode in compiled-registered eager-fused eager-python compiled-python; do
        OMP_NUM_THREADS=2 PYTHONPATH=$PWD .venv/bin/python scripts/measure_forward_modes.py $mode; done

The default model in float32 (DTYPE=bfloat16 for the other); ``LLM()``'s build time; then
``ab_engine.py``'s workload (24 requests x 64 greedy tokens batched, one 32-token prompt alone for
128), best of 2 rounds after a warm-up, and the hash of the greedy tokens (equal in every mode). The
modes: the model compiled whole over the registered one-call layers (the default), the one-call
layers eager (``enforce_eager=True``), the Python layers over the native kernels eager (the
backend's ``fuse_layers`` off), and the Python layers compiled whole (``compile_model=True`` with
the one-call layers ruled out): the measurement engine v4 asks for before choosing one fast path.
"""

import json
import os
import sys
import time

from ab_engine import measure  # the same workload (scripts/ is this script's import path)

from nanoengine import LLM
from nanoengine.backends import cpu_fused

MODES = ("compiled-registered", "eager-fused", "eager-python", "compiled-python")
mode = sys.argv[1] if len(sys.argv) == 2 and sys.argv[1] in MODES else sys.exit(f"usage: one of {MODES}")
options = {"eager-fused": {"enforce_eager": True}, "eager-python": {"enforce_eager": True},
           "compiled-python": {"compile_model": True}}.get(mode, {})
if mode == "compiled-python":  # the general graph: attention and linear layers as operators
    cpu_fused.unfit_reason = lambda model, backend: "ruled out to measure the general graph"
start = time.perf_counter()
llm = LLM(dtype=os.environ.get("DTYPE", "float32"), **options)
build_s = time.perf_counter() - start
if mode == "eager-python":
    llm.engine.runner.backend.fuse_layers = False
rates, digest = measure(llm, repeats=2)
print(json.dumps({"mode": mode, "build_s": round(build_s, 2), "forward": llm.engine.forward_mode,
                  **{name: round(max(values), 1) for name, values in rates.items()}, "tokens": digest}), flush=True)
