"""TF32 for float32 matmuls and convolutions (``--no-tf32`` turns it off)."""

from __future__ import annotations

import torch


def configure_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 for float32 matmuls and convolutions on GPUs that have it.

    Through the legacy flags only. torch >= 2.9 also has per-backend ``fp32_precision``
    settings, but once those are set the generic readers (``torch.get_float32_matmul_precision()``,
    ``torch.backends.cuda.matmul.allow_tf32``) raise "mix of the legacy and new APIs", and
    Inductor reads them: ``--compile max-autotune`` died of it. After the legacy setters every
    reader, old and new, answers consistently.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
