"""Shared pytest setup: the tests import the ``imagenet`` package straight from the checkout."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
