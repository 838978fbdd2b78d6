"""``fp16``: the classic master-weight trainer, :class:`MasterWeightPrecision`.

The model runs in float16 except the normalisation layers, which stay float32; the optimizer
updates a float32 master copy of every parameter; the loss is multiplied by a loss scale
(:class:`~imagenet.precision.scaler.LossScaler`) before backward, and gradients are copied to
the masters, unscaled and checked for inf/NaN there. A step with non-finite gradients is
skipped (and a dynamic scale halved) so one overflow never reaches the weights. With
``one_pass`` (``--optimizer-impl triton``) the step is :class:`~imagenet.kernels.masterstep.MasterStep`'s
two kernels instead of torch's four passes, where the step's tensors fit them.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn

from ..base.torch_private import amp_unscale_and_check_, foreach_copy_, step_skipping_on_device
from ..base.wrappers import unwrap
from ..kernels.masterstep import MasterStep
from .base import Precision
from .copies import copy_by_dtype, dtype_groups
from .norms import NORM_TYPES
from .optim import supports_found_inf
from .scaler import LossScaler

logger = logging.getLogger(__name__)


class MasterWeightPrecision(Precision):
    """fp16 model (BatchNorm in fp32) trained through fp32 master weights with loss scaling."""

    name = "fp16"

    def __init__(self, scaler: LossScaler, model_dtype: torch.dtype = torch.float16, foreach: bool = True, *,
                 clip_norm: Optional[float] = None, one_pass: bool = False):
        # model_dtype=float32 turns this into an exact check of the master-weight mechanics;
        # foreach=False does the per-step copies one tensor at a time (kept to measure the gain);
        # one_pass: MasterStep's kernels step an optimizer that skips on the device (not with clipping).
        super().__init__(clip_norm=clip_norm)
        self.scaler = scaler
        self.model_dtype = model_dtype
        self.foreach = foreach
        self.one_pass = one_pass and clip_norm is None
        self._stepper: Optional[MasterStep] = None
        self._said: set = set()  # why a step could not take the kernels, each said once
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
            if isinstance(module, NORM_TYPES):
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
    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Copy, unscale and check the gradients on the masters, step, copy the masters back.

        With an optimizer that takes the overflow flag on the device (fused SGD on a GPU) the
        skip is decided there and the returned flag computed there, so no step waits for the
        host; otherwise the overflow is read once (a host sync) and the flag is one of this
        object's constant tensors.
        """
        on_device = supports_found_inf(optimizer)
        if on_device:
            self.scaler.attach(self._found_inf.device)
            if self.one_pass and self._step_in_one_pass(optimizer):
                return self._finish_on_device(self._found_inf)
        with_grad = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        model_grads = [p.grad for p, _ in with_grad]
        master_grads = [m.grad for _, m in with_grad]
        found_inf = self._found_inf.zero_()
        if master_grads:
            if on_device:
                inv_scale = torch.reciprocal(self.scaler.device_scale()).reshape(1)
            else:
                inv_scale = self._inv_scale.fill_(1.0 / self.scaler.scale)
            if self.foreach:
                # One multi-tensor pass: fp16 -> fp32 copy, then unscale and inf/NaN check together.
                copy_by_dtype(master_grads, model_grads)
                amp_unscale_and_check_(master_grads, found_inf, inv_scale)
            else:
                for mg, g in zip(master_grads, model_grads):
                    mg.copy_(g)
                    amp_unscale_and_check_([mg], found_inf, inv_scale)
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
        return self._flag(not overflow, found_inf.device)

    def _step_in_one_pass(self, optimizer: torch.optim.Optimizer) -> bool:
        """The step as MasterStep's kernels; False, having changed nothing, where its tensors do not fit."""
        if self._stepper is None or self._stepper.optimizer is not optimizer:
            self._stepper = MasterStep(optimizer, self.params, self.masters)
        inv_scale = torch.reciprocal(self.scaler.device_scale()).reshape(1)
        why = self._stepper(self._found_inf.zero_(), inv_scale)
        if why is not None and why not in self._said:
            self._said.add(why)
            logger.warning("=> note: the fp16 optimizer step runs torch's kernels (not --optimizer-impl triton's): %s",
                           why)
        return why is None

    def _step_on_device(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> torch.Tensor:
        # The clip's norm is inf on an overflowing step; the step is skipped then anyway.
        self._clip([m for m in self.masters if m.grad is not None])
        step_skipping_on_device(optimizer, found_inf)  # gradients already unscaled above
        self._copy_masters_to_model()  # unchanged masters on a skip: copying them back is harmless
        return self._finish_on_device(found_inf)

    def _finish_on_device(self, found_inf: torch.Tensor) -> torch.Tensor:
        self.scaler.update_on_device(found_inf)
        stepped = found_inf.reshape(()) == 0  # a new tensor: found_inf is reused next step
        self._reset_grads()
        return stepped

    def _copy_masters_to_model(self) -> None:
        if self.foreach:
            for params, masters in self._to_model:
                foreach_copy_(params, masters)
        else:
            for p, m in zip(self.params, self._master_data):
                p.copy_(m)

    def _reset_grads(self) -> None:
        if not self._zero_held():
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
