"""The wrappers a model may sit in (DataParallel, DistributedDataParallel, torch.compile), and
how to see through them: the one place that knows their attributes and key prefixes."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP's submodule name, torch.compile's


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def uncompiled(model: nn.Module) -> nn.Module:
    """The model without its torch.compile wrapper (DataParallel or DDP wrappers stay)."""
    return getattr(model, "_orig_mod", model)


def ddp_of(model: nn.Module) -> Optional[nn.parallel.DistributedDataParallel]:
    """The DDP wrapper of the training model, also when that wrapper was compiled; else None."""
    net = getattr(model, "_orig_mod", model)
    return net if isinstance(net, nn.parallel.DistributedDataParallel) else None


def strip_prefix(state_dict: dict) -> dict:
    """Remove the ``module.`` (DataParallel/DDP) and ``_orig_mod.`` (torch.compile) prefixes."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    changed = True
        out[key] = value
    return out
