"""The normalisation layers, which every mode keeps in float32."""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm)


def iter_norm_modules(model: nn.Module) -> Iterable[nn.Module]:
    """Normalisation layers, which every mode keeps in float32."""
    return (m for m in model.modules() if isinstance(m, NORM_TYPES))
