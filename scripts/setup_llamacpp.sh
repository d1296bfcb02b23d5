#!/usr/bin/env bash
# Idempotent set-up of llama.cpp as a peer for `python -m nanoengine bench --vs-llamacpp`:
#   1. a virtualenv of its own, .venv-llamacpp: llama-cpp-python is a native library built for
#      this machine, and needs nothing of the course's packages (numpy only),
#   2. the pinned llama-cpp-python built from PyPI's source distribution: its CMake build of
#      llama.cpp with the library's defaults, among them GGML_NATIVE (code for this CPU's own
#      instruction set, AVX-512 where it has it): what a CPU user who pip-installs it gets.
#      Several minutes on two cores; cmake comes from PyPI through pip's build isolation,
#   3. the default model's weights as GGUF files, as the engine computes with them: F32, BF16
#      and Q8_0 (python -m nanobench.gguf_export; cached beside the default model),
#   4. a check that `import llama_cpp` works, which prints its version.
# Nothing is downloaded but packages: the weights come from the model ./course setup cached
# (this script runs it first).
set -euo pipefail
cd "$(dirname "$0")/.."

# The pinned peer. Change it and rerun: the stamp below notices.
LLAMACPP_PIN="llama-cpp-python==0.3.36"
NUMPY_PIN="numpy"  # llama-cpp-python's own requirement; the course's runner needs nothing else

# ./course setup first: the course's .venv writes the GGUF files from the cached default model
# (idempotent, under a second once done).
bash scripts/setup.sh

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-llamacpp/bin/python ]; then
  echo "[llamacpp-setup] creating .venv-llamacpp with $($PYTHON --version)"
  "$PYTHON" -m venv .venv-llamacpp
fi

stamp=.venv-llamacpp/.pins.sha
want="$(echo "$LLAMACPP_PIN $NUMPY_PIN source-build" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[llamacpp-setup] building $LLAMACPP_PIN from its source distribution into .venv-llamacpp" \
       "(several minutes on two cores)"
  .venv-llamacpp/bin/python -m pip install -q --disable-pip-version-check --no-binary llama-cpp-python \
    "$LLAMACPP_PIN" "$NUMPY_PIN"
  echo "$want" > "$stamp"
fi

echo "[llamacpp-setup] the default model's weights as GGUF files (F32, BF16, Q8_0; once)"
.venv/bin/python -m nanobench.gguf_export float32 bfloat16 q8_0

if ! version="$(.venv-llamacpp/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null | tail -n 1)"; then
  echo "[llamacpp-setup] error: 'import llama_cpp' fails in .venv-llamacpp; see:" \
       ".venv-llamacpp/bin/python -c 'import llama_cpp'" >&2
  exit 1
fi
echo "[llamacpp-setup] llama-cpp-python $version in .venv-llamacpp ready (python -m nanoengine bench --vs-llamacpp)"
