"""Numeric precision behind one interface, so the training loop never branches on the mode.

Modes:

* ``fp32`` -- plain float32 (TF32 on GPUs that have it unless ``--no-tf32``).
* ``fp16`` -- the classic master-weight trainer: the model runs in float16 except BatchNorm,
  which stays float32; the optimizer updates an float32 master copy of every parameter; the
  loss is multiplied by a loss scale before backward, and gradients are copied to the masters,
  unscaled and checked for inf/NaN there. A step with non-finite gradients is skipped (and a
  dynamic scale halved) so one overflow never reaches the weights.
* ``amp-fp16`` / ``amp-bf16`` -- ``torch.autocast``; float16 uses ``torch.amp.GradScaler``.

Every mode offers the same calls::

    logits = precision.forward(model, images)   # float32 logits
    precision.backward(loss)
    stepped = precision.step(optimizer)          # False when the step was skipped
    precision.model_state_dict(model)            # float32 weights, masters in fp16 mode
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Optional

import torch
import torch.nn as nn

from .errors import UserError
from .optim import supports_found_inf
from .wrappers import unwrap

logger = logging.getLogger(__name__)

_BN_TYPES = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm)
_LOGGED_SKIPS = 3  # individual overflow messages before they are only counted


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
            torch._amp_update_scale_(dev["scale"], dev["clean"], found_inf, self.factor, 1.0 / self.factor,
                                     self.window)
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


class Precision:
    """float32 training; the base of the other modes (they override what differs).

    ``clip_norm``: clip the global L2 norm of the *unscaled* gradients to this before each
    step (every mode unscales first, so the threshold means the same in fp32, fp16 and amp).
    """

    name = "fp32"
    clip_norm: Optional[float] = None

    def _clip(self, params) -> None:
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_norm)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Convert a fresh (unwrapped) float32 model for this mode; call before DP/DDP wrapping."""
        return model

    def param_groups(self, groups: list) -> list:
        """Map optimizer parameter groups of the model to the tensors the optimizer must update."""
        return groups

    def autocast(self):
        return contextlib.nullcontext()

    def forward(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Run the model; logits come back in float32 so the loss is computed in full precision."""
        with self.autocast():
            return model(self.cast_input(images)).float()

    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        return images

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the gradients (unless they overflowed) and clear them; True if weights changed."""
        self._clip(_optimizer_params(optimizer))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return True

    @property
    def loss_scale(self) -> Optional[float]:
        return None

    @property
    def skipped_steps(self) -> int:
        return 0

    def model_state_dict(self, model: nn.Module) -> dict:
        """Float32 weights of the unwrapped model, under torchvision's own key names."""
        return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        unwrap(model).load_state_dict(state)

    def state_dict(self) -> dict:
        return {"mode": self.name}

    def load_state_dict(self, state: dict) -> None:
        pass


class AutocastPrecision(Precision):
    """torch.autocast in float16 (with a GradScaler) or bfloat16 (no scaling needed)."""

    def __init__(self, dtype: torch.dtype, device_type: str, init_scale: float = 2.0 ** 16,
                 window: int = 1000):
        self.dtype = dtype
        self.device_type = device_type
        self.name = "amp-bf16" if dtype == torch.bfloat16 else "amp-fp16"
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

    def step(self, optimizer: torch.optim.Optimizer):
        """GradScaler's step; with a fused optimizer the skip is decided on the device, and
        ``stepped`` is then a device bool tensor (no host sync), else a bool."""
        if not self.scaler.is_enabled():
            return super().step(optimizer)
        on_device = supports_found_inf(optimizer) and getattr(self.scaler, "_scale", None) is not None
        before = self.scaler._scale.clone() if on_device else self.scaler.get_scale()
        if self.clip_norm is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients; step() knows they're unscaled
            self._clip(_optimizer_params(optimizer))
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if on_device:
            stepped = self.scaler._scale >= before  # the scaler shrinks exactly when it skipped
            if self._skipped_dev is None:
                self._skipped_dev = torch.zeros((), device=before.device)
            self._skipped_dev.add_((~stepped).float())
            return stepped
        stepped = self.scaler.get_scale() >= before
        if not stepped:
            self._skipped += 1
            self._log(f"step skipped, loss scale {before:g} -> {self.scaler.get_scale():g}")
        return stepped

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


class MasterWeightPrecision(Precision):
    """fp16 model (BatchNorm in fp32) trained through fp32 master weights with loss scaling."""

    name = "fp16"

    def __init__(self, scaler: LossScaler, model_dtype: torch.dtype = torch.float16, foreach: bool = True):
        # model_dtype=float32 turns this into an exact check of the master-weight mechanics;
        # foreach=False does the per-step copies one tensor at a time (kept to measure the gain).
        self.scaler = scaler
        self.model_dtype = model_dtype
        self.foreach = foreach
        self.params: list = []
        self.masters: list = []
        self.names: list = []
        self._master_of: dict = {}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.names, self.params = [], []
        for name, p in model.named_parameters():
            self.names.append(name)
            self.params.append(p)
        # Masters first: they must be the exact fp32 weights, not fp16-rounded copies.
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        for module in model.modules():
            if isinstance(module, _BN_TYPES):
                # Normalisation statistics overflow and lose precision in fp16; cuDNN and the
                # native kernels accept fp16 input with fp32 BatchNorm parameters.
                continue
            for p in module.parameters(recurse=False):
                p.data = p.data.to(self.model_dtype)  # keeps the Parameter (DDP, optimizer)
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point():
                    module._buffers[name] = b.to(self.model_dtype)
        for m in self.masters:
            m.grad = torch.zeros_like(m)  # allocated once; refilled from the model every step
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        self._master_data = [m.detach() for m in self.masters]
        self._to_model = dtype_groups(self.params, self._master_data)  # fixed: grouped once, not per step
        device = self.masters[0].device
        self._found_inf = torch.zeros(1, device=device)
        self._inv_scale = torch.ones(1, device=device)
        return model

    def param_groups(self, groups: list) -> list:
        out = []
        for g in groups:
            g = dict(g)
            g["params"] = [self._master_of[id(p)] for p in g["params"]]
            out.append(g)
        return out

    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.model_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer):
        """Copy, unscale and check the gradients on the masters, step, copy the masters back.

        With an optimizer that takes the overflow flag on the device (fused SGD on a GPU) the
        skip is decided there and ``stepped`` is a device bool tensor, so no step waits for the
        host; otherwise the flag is read once (a host sync) and ``stepped`` is a bool.
        """
        on_device = supports_found_inf(optimizer)
        if on_device:
            self.scaler.attach(self._found_inf.device)
        with_grad = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        model_grads = [p.grad for p, _ in with_grad]
        master_grads = [m.grad for _, m in with_grad]
        found_inf = self._found_inf.zero_()
        if master_grads:
            if on_device:
                inv_scale = torch.reciprocal(self.scaler._dev["scale"]).reshape(1)
            else:
                inv_scale = self._inv_scale.fill_(1.0 / self.scaler.scale)
            if self.foreach:
                # One multi-tensor pass: fp16 -> fp32 copy, then unscale and inf/NaN check together.
                copy_by_dtype(master_grads, model_grads)
                torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
            else:
                for mg, g in zip(master_grads, model_grads):
                    mg.copy_(g)
                    torch._amp_foreach_non_finite_check_and_unscale_([mg], found_inf, inv_scale)
        # Parameters without a gradient this step must not be moved by stale master grads.
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
        if on_device:
            return self._step_on_device(optimizer, found_inf)
        overflow = bool(found_inf.item())  # the one host sync per step, to decide the skip
        if not overflow:
            self._clip([m for m in self.masters if m.grad is not None])
            optimizer.step()
            self._copy_masters_to_model()
        self.scaler.update(overflow)
        self._reset_grads()
        return not overflow

    def _step_on_device(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> torch.Tensor:
        # The clip's norm is inf on an overflowing step; the step is skipped then anyway.
        self._clip([m for m in self.masters if m.grad is not None])
        optimizer.found_inf, optimizer.grad_scale = found_inf, None  # already unscaled above
        try:
            optimizer.step()  # the fused kernel leaves weights and momentum alone if found_inf
        finally:
            optimizer.found_inf = optimizer.grad_scale = None
        self._copy_masters_to_model()  # unchanged masters on a skip: copying them back is harmless
        self.scaler.update_on_device(found_inf)
        stepped = found_inf.reshape(()) == 0  # a new tensor: found_inf is reused next step
        self._reset_grads()
        return stepped

    def _copy_masters_to_model(self) -> None:
        if self.foreach:
            for params, masters in self._to_model:
                torch._foreach_copy_(params, masters)
        else:
            for p, m in zip(self.params, self._master_data):
                p.copy_(m)

    def _reset_grads(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)

    @property
    def loss_scale(self) -> Optional[float]:
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps

    def model_state_dict(self, model: nn.Module) -> dict:
        state = {}
        for k, v in unwrap(model).state_dict().items():
            state[k] = v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
        for name, m in zip(self.names, self.masters):
            state[name] = m.detach().clone()  # the exact fp32 values, not the fp16 copy
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        unwrap(model).load_state_dict(state)  # copy_ rounds into the fp16 model
        with torch.no_grad():
            for name, m in zip(self.names, self.masters):
                m.copy_(state[name])

    def state_dict(self) -> dict:
        return {"mode": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") == self.name and "scaler" in state:
            static = None if self.scaler.dynamic else self.scaler.scale
            self.scaler.load_state_dict(state["scaler"])
            if static is not None:  # a static --loss-scale on this command line wins
                self.scaler.scale = static


def dtype_groups(dst: list, src: list) -> list:
    """(dst, src) pairs split into lists of one (dst dtype, src dtype) each. The CUDA multi-tensor
    copy only takes lists of one dtype: a list mixing fp16 weights with fp32 BatchNorm parameters
    silently falls back to one copy (or memcpy) per tensor."""
    groups: dict = {}
    for d, s in zip(dst, src):
        pair = groups.setdefault((d.dtype, s.dtype), ([], []))
        pair[0].append(d)
        pair[1].append(s)
    return list(groups.values())


def copy_by_dtype(dst: list, src: list) -> None:
    """``torch._foreach_copy_(dst, src)``, one multi-tensor call per :func:`dtype_groups` group."""
    for d, s in dtype_groups(dst, src):
        torch._foreach_copy_(d, s)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def build_precision(cfg, device: torch.device) -> Precision:
    """The precision object for ``cfg`` on ``device``; raises UserError if it can't run there."""
    precision = _build_precision(cfg, device)
    precision.clip_norm = cfg.clip_grad_norm
    return precision


def _build_precision(cfg, device: torch.device) -> Precision:
    from .config import static_loss_scale  # config is below us in the data flow
    if cfg.fp16:
        static = static_loss_scale(cfg)
        scaler = LossScaler(init_scale=static if static else cfg.initial_loss_scale,
                            dynamic=static is None, window=cfg.scale_window)
        return MasterWeightPrecision(scaler)
    if cfg.amp:
        dtype = torch.bfloat16 if cfg.amp_dtype == "bfloat16" else torch.float16
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"--amp-dtype bfloat16 needs a GPU with bfloat16 support; "
                            f"{torch.cuda.get_device_name(device)} has none: use --amp-dtype float16")
        return AutocastPrecision(dtype, device.type, init_scale=cfg.initial_loss_scale,
                                 window=cfg.scale_window)
    return Precision()


def describe(precision: Precision, tf32: bool, device: torch.device) -> str:
    """One line for the banner."""
    parts = [precision.name]
    if precision.loss_scale is not None:
        dyn = getattr(getattr(precision, "scaler", None), "dynamic", True)
        parts.append(f"loss scale {precision.loss_scale:g} ({'dynamic' if dyn else 'static'})")
    if device.type == "cuda":
        parts.append("TF32 on" if tf32 else "TF32 off")
    return ", ".join(parts)


def iter_norm_modules(model: nn.Module) -> Iterable[nn.Module]:
    """Normalisation layers, which every mode keeps in float32."""
    return (m for m in model.modules() if isinstance(m, _BN_TYPES))
