"""``amp-fp16`` / ``amp-bf16``: ``torch.autocast``, float16 with ``torch.amp.GradScaler``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..base.torch_private import grad_scaler_scale
from .base import Precision, _optimizer_params, _param_device
from .optim import supports_found_inf
from .scaler import _SkipLog


class AutocastPrecision(Precision):
    """torch.autocast in float16 (with a GradScaler) or bfloat16 (no scaling needed)."""

    def __init__(self, dtype: torch.dtype, device_type: str, init_scale: float = 2.0 ** 16,
                 window: int = 1000, *, clip_norm: Optional[float] = None):
        super().__init__(clip_norm=clip_norm)
        self.dtype = dtype
        self.device_type = device_type
        self.name = "amp-bf16" if dtype == torch.bfloat16 else "amp-fp16"
        self.window = window
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=window,
                                           enabled=dtype == torch.float16)
        self._skipped = 0
        self._skipped_dev: Optional[torch.Tensor] = None  # skips decided on the device, not yet read
        self._log = _SkipLog()

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        # DataParallel runs replicas in worker threads, where autocast is re-enabled with the
        # thread's default dtype (float16): bf16 runs would silently train in unscaled fp16.
        # A pre-hook travels with every replica and sets the dtype inside the worker thread.
        model.register_forward_pre_hook(_AutocastDtypeHook(self.device_type, self.dtype))
        return model

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """GradScaler's step. With a fused optimizer the skip is decided on the device and the
        flag computed there (no host sync); otherwise GradScaler reads the overflow on the host
        and the flag is one of this object's constant tensors."""
        if not self.scaler.is_enabled():
            return super().step(optimizer)
        scale = grad_scaler_scale(self.scaler)
        on_device = supports_found_inf(optimizer) and scale is not None
        before = scale.clone() if on_device else self.scaler.get_scale()
        if self.clip_norm is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients; step() knows they're unscaled
            self._clip(_optimizer_params(optimizer))
        self.scaler.step(optimizer)
        self.scaler.update()
        self._clear_grads(optimizer)
        if on_device:
            stepped = grad_scaler_scale(self.scaler) >= before  # the scaler shrinks exactly when it skipped
            if self._skipped_dev is None:
                self._skipped_dev = torch.zeros((), device=before.device)
            self._skipped_dev.add_((~stepped).float())
            return stepped
        stepped = self.scaler.get_scale() >= before
        if not stepped:
            self._skipped += 1
            self._log(f"step skipped, loss scale {before:g} -> {self.scaler.get_scale():g}")
        return self._flag(stepped, _param_device(optimizer))

    def _pull(self) -> None:
        # Skips decided on the device since the last read (print time / epoch end only).
        if self._skipped_dev is not None:
            new = int(self._skipped_dev.item())
            self._skipped_dev.zero_()
            self._skipped += new
            if new:
                self._log.read_later(new, self.scaler.get_scale())

    @property
    def loss_scale(self) -> Optional[float]:
        return self.scaler.get_scale() if self.scaler.is_enabled() else None

    @property
    def skipped_steps(self) -> int:
        self._pull()
        return self._skipped

    def state_dict(self) -> dict:
        return {"mode": self.name, "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.name:
            return  # saved in another mode: this mode's scaler starts fresh
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
            # GradScaler's state holds its growth interval; this run's --scale-window wins, as
            # with --fp16's LossScaler: the scale resumes, the settings are the command line's.
            self.scaler.set_growth_interval(self.window)
        self._skipped = int(state.get("skipped_steps", 0))
        if self._skipped_dev is not None:
            self._skipped_dev.zero_()


class _AutocastDtypeHook:
    """Forward pre-hook: inside an autocast region, make this thread use ``dtype``."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, module, args):
        if torch.is_autocast_enabled(self.device_type):
            torch.set_autocast_dtype(self.device_type, self.dtype)
