"""The precision object a config asks for (:func:`build_precision`) and its banner line (:func:`describe`)."""

from __future__ import annotations

import torch

from ..base.errors import UserError
from .autocast import AutocastPrecision
from .base import Precision
from .master import MasterWeightPrecision
from .scaler import LossScaler


def build_precision(cfg, device: torch.device) -> Precision:
    """The precision object for ``cfg`` on ``device``; raises UserError if it can't run there."""
    from ..base.config import static_loss_scale  # config is below us in the data flow
    clip_norm = cfg.clip_grad_norm
    if cfg.fp16:
        static = static_loss_scale(cfg)
        scaler = LossScaler(init_scale=static if static else cfg.initial_loss_scale,
                            dynamic=static is None, window=cfg.scale_window)
        return MasterWeightPrecision(scaler, clip_norm=clip_norm, one_pass=cfg.optimizer_impl == "triton")
    if cfg.amp:
        dtype = torch.bfloat16 if cfg.amp_dtype == "bfloat16" else torch.float16
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"--amp-dtype bfloat16 needs a GPU with bfloat16 support; "
                            f"{torch.cuda.get_device_name(device)} has none: use --amp-dtype float16")
        return AutocastPrecision(dtype, device.type, init_scale=cfg.initial_loss_scale,
                                 window=cfg.scale_window, clip_norm=clip_norm)
    return Precision(clip_norm=clip_norm)


def describe(precision: Precision, tf32: bool, device: torch.device) -> str:
    """One line for the banner."""
    parts = [precision.name]
    if precision.loss_scale is not None:
        dyn = getattr(getattr(precision, "scaler", None), "dynamic", True)
        parts.append(f"loss scale {precision.loss_scale:g} ({'dynamic' if dyn else 'static'})")
    if device.type == "cuda":
        parts.append("TF32 on" if tf32 else "TF32 off")
    return ", ".join(parts)
