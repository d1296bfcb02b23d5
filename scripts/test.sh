#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest.
#   scripts/test.sh          everything: unit and integration tests, the labs, the browser
#                            test, and every chapter notebook executed with nbval (CI)
#   scripts/test.sh --fast   the quick tier: no notebooks, no browser, nothing marked slow
#                            (no default-model load, no long workloads); for the edit-test loop
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # idle torch threads sleep instead of spinning: much faster on a shared CPU
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest tests -m "not slow and not browser" -p no:cacheprovider -q "$@"
fi
notebooks=$(ls notebooks/[0-9][0-9]_*.ipynb notebooks/solutions/[0-9][0-9]_*.ipynb 2>/dev/null || true)
exec python -m pytest tests $notebooks \
  --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=300 \
  -p no:cacheprovider -q "$@"
