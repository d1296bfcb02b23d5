#!/usr/bin/env bash
# The whole test suite: unit and integration tests, the labs, the browser test, and the
# notebooks executed with nbval. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
notebooks=$(ls notebooks/[0-9][0-9]_*.ipynb 2>/dev/null || true)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # idle torch threads sleep instead of spinning: much faster on a shared CPU
exec python -m pytest tests $notebooks \
  --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=300 \
  -p no:cacheprovider -q "$@"
