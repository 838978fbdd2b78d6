"""The loss scaler of the fp16 master-weight trainer, and the log of overflow skips every mode shares."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..base.torch_private import amp_update_scale_

logger = logging.getLogger(__name__)

_LOGGED_SKIPS = 3  # individual overflow messages before they are only counted


class _SkipLog:
    """Logs gradient-overflow skips: the first few, then they are only counted."""

    def __init__(self):
        self.logged = 0

    def __call__(self, what: str) -> None:
        if self.logged < _LOGGED_SKIPS:
            self.logged += 1
            logger.info("gradient overflow: %s%s", what, " (further skips are counted in the epoch summary)"
                        if self.logged == _LOGGED_SKIPS else "")

    def read_later(self, new: int, scale: float) -> None:
        """Skips decided on the device and read at print time: ``new`` since the last read."""
        if new:
            self(f"{new} step(s) skipped since the last report, loss scale now {scale:g}")


class LossScaler:
    """Static or dynamic loss scale for the fp16 master-weight trainer.

    Dynamic: start at ``init_scale``; on a step with inf/NaN gradients halve the scale (not
    below ``min_scale``) and skip the step; after ``window`` clean steps in a row, double it.
    Static: the scale never changes, but a non-finite step is still skipped rather than
    written into the weights.

    The state lives on the host until :meth:`attach` moves it onto the device, for steps whose
    skip is decided there (:meth:`update_on_device`, no host sync); reading ``scale`` or the
    counters then waits for the device, which the trainer does at print time only.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, dynamic: bool = True, window: int = 1000,
                 factor: float = 2.0, min_scale: float = 1.0, max_scale: float = 2.0 ** 24):
        self._scale = float(init_scale)
        self.dynamic = dynamic
        self.window = window
        self.factor = factor
        self.min_scale = min_scale
        self.max_scale = max_scale
        self._clean = 0
        self._skipped = 0
        self._log = _SkipLog()
        self._dev: Optional[dict] = None  # scale, clean-step tracker, skip counter as device tensors

    # -- host view ---------------------------------------------------------------------------

    def _pull(self) -> None:
        if self._dev is None:
            return
        scale, clean, skipped = torch.stack([self._dev["scale"], self._dev["clean"].float(),
                                             self._dev["skipped"]]).tolist()
        before = self._skipped
        self._scale, self._clean, self._skipped = scale, int(clean), int(skipped)
        self._log.read_later(self._skipped - before, self._scale)

    def _push(self) -> None:
        if self._dev is not None:
            self._dev["scale"].fill_(self._scale)
            self._dev["clean"].fill_(self._clean)
            self._dev["skipped"].fill_(self._skipped)

    @property
    def scale(self) -> float:
        self._pull()
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._pull()
        self._scale = float(value)
        self._push()

    @property
    def clean_steps(self) -> int:
        self._pull()
        return self._clean

    @property
    def skipped_steps(self) -> int:
        self._pull()
        return self._skipped

    # -- the step ----------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in float32, without reading a device-held scale back to the host."""
        return loss.float() * (self._dev["scale"] if self._dev is not None else self._scale)

    def device_scale(self) -> torch.Tensor:
        """The scale as a 0-dim float32 device tensor; only after :meth:`attach`."""
        return self._dev["scale"]

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (known on the host) and adapt the scale."""
        self._pull()
        if overflow:
            self._skipped += 1
            self._clean = 0
            old = self._scale
            if self.dynamic:
                self._scale = max(self._scale / self.factor, self.min_scale)
            self._log(f"step skipped, loss scale {old:g} -> {self._scale:g}")
        else:
            self._clean += 1
            if self.dynamic and self._clean >= self.window:
                self._scale = min(self._scale * self.factor, self.max_scale)
                self._clean = 0
        self._push()

    def attach(self, device: torch.device) -> None:
        """Keep the state on ``device`` from now on (for :meth:`update_on_device`)."""
        if self._dev is None:
            self._dev = {"scale": torch.full((), self._scale, dtype=torch.float32, device=device),
                         "clean": torch.full((), self._clean, dtype=torch.int32, device=device),
                         "skipped": torch.full((), float(self._skipped), dtype=torch.float32, device=device)}

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """:meth:`update` with the outcome as a device flag (1.0 = overflow); nothing waits."""
        dev = self._dev
        dev["skipped"].add_(found_inf.reshape(()))
        if self.dynamic:
            amp_update_scale_(dev["scale"], dev["clean"], found_inf, self.factor, 1.0 / self.factor, self.window)
            dev["scale"].clamp_(self.min_scale, self.max_scale)
        else:
            dev["clean"].add_(1).mul_((found_inf.reshape(()) == 0).to(torch.int32))

    def state_dict(self) -> dict:
        self._pull()
        return {"scale": self._scale, "dynamic": self.dynamic, "window": self.window,
                "clean_steps": self._clean, "skipped_steps": self._skipped}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._clean = int(state.get("clean_steps", 0))
        self._skipped = int(state.get("skipped_steps", 0))
        self._push()
