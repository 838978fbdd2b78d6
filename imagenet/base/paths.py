"""Where the trainer keeps files between runs (the built-in dataset's export, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$IMAGENET_TRAINER_CACHE``, else ``$XDG_CACHE_HOME/imagenet-trainer``, else ``~/.cache/imagenet-trainer``."""
    if os.environ.get("IMAGENET_TRAINER_CACHE"):
        return Path(os.environ["IMAGENET_TRAINER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "imagenet-trainer"
