#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest.
#   scripts/test.sh          everything: unit and integration tests, the labs, the browser
#                            test, and every chapter notebook executed with nbval (CI)
#   scripts/test.sh --fast   the quick tier (~1 min): no notebooks, no browser, nothing marked slow
#                            (no default-model load, no long workloads); for the edit-test loop
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
# Idle torch threads sleep instead of spinning: slower on a quiet machine (a learner's notebook
# keeps OpenMP's spinning default), much faster on a shared CI machine doing other jobs.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest tests -m "not slow and not browser" -p no:cacheprovider -p no:nbval -q "$@"
fi
# The notebooks' saved outputs came from a 2-thread run on the native instruction set of the
# machine that executed them (scripts/execute_notebooks.py). Run them here on another numeric path
# (one thread; ATen, MKL and oneDNN held to AVX2), so that a compared output which depends on the
# CPU, the thread count or the kernel path (a printed residual, a rounding) fails on the
# developer's machine before it lands, not on a teacher's laptop with another CPU.
# Set NANOENGINE_NATIVE_NUMERICS=1 to run on this machine's own defaults instead.
if [ -z "${NANOENGINE_NATIVE_NUMERICS:-}" ]; then
  export OMP_NUM_THREADS=1
  if [ "$(uname -m)" = x86_64 ]; then
    export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
  fi
  # torch.compile's on-disk cache must not hand this run kernels compiled on the native path:
  # with ATEN_CPU_CAPABILITY=avx2 and the default cache (filled by an AVX-512 run), torch 2.13
  # reused them and a compiled engine produced wrong tokens or NaN probabilities (one thread
  # alone did not; a cache of its own did not). Native runs keep the default cache.
  export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.venv/inductor-cache-pinned-numerics}"
fi
notebooks=$(ls notebooks/[0-9][0-9]_*.ipynb notebooks/solutions/[0-9][0-9]_*.ipynb 2>/dev/null || true)
exec python -m pytest tests $notebooks \
  --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=300 \
  -p no:cacheprovider -q "$@"
