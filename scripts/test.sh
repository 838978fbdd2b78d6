#!/usr/bin/env bash
# Set up .venv (once), then run the CPU test suite. GPU tests skip without CUDA.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup_env.sh"
cd "$REPO"
# Tests export the built-in dataset into a throwaway cache, never into the user's, removed at the end.
if [ -z "${IMAGENET_TRAINER_CACHE:-}" ]; then
  IMAGENET_TRAINER_CACHE="$(mktemp -d)"
  trap 'rm -rf "$IMAGENET_TRAINER_CACHE"' EXIT
fi
export IMAGENET_TRAINER_CACHE
python -m pytest -q -p no:cacheprovider tests "$@"
