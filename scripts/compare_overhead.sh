#!/usr/bin/env bash
# Host overhead before and after a change, side by side in one run (engine speed v3):
#   scripts/compare_overhead.sh BEFORE_REV OUT_PREFIX [extra bench --overhead flags]
# Checks BEFORE_REV out into a temporary worktree and runs `python -m nanoengine bench
# --overhead` there and here, alternating before/after/before/after..., so a slow spell of a
# noisy machine hits both. Writes OUT_PREFIX-before-N.json and OUT_PREFIX-after-N.json for
# N = 1..ROUNDS (default 3; the medians over rounds are what to compare).
set -euo pipefail
cd "$(dirname "$0")/.."
before_rev="$1"; prefix="$(realpath -m "$2")"; shift 2
tree="$(mktemp -d)/before"
git worktree add --detach "$tree" "$before_rev" >/dev/null
trap 'git worktree remove --force "$tree"' EXIT
py="$PWD/.venv/bin/python"
for round in $(seq "${ROUNDS:-3}"); do
  (cd "$tree" && PYTHONPATH="$tree" "$py" -m nanoengine bench --overhead "$@" --out "$prefix-before-$round.json")
  PYTHONPATH="$PWD" "$py" -m nanoengine bench --overhead "$@" --out "$prefix-after-$round.json"
done
