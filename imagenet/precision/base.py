"""float32 training, :class:`Precision`: the interface every mode offers, and the base the others extend."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from ..base.torch_private import foreach_zero_
from ..base.wrappers import unwrap


class Precision:
    """float32 training; the base of the other modes (they override what differs).

    ``clip_norm``: clip the global L2 norm of the *unscaled* gradients to this before each
    step (every mode unscales first, so the threshold means the same in fp32, fp16 and amp).
    """

    name = "fp32"

    def __init__(self, *, clip_norm: Optional[float] = None):
        self.clip_norm = clip_norm
        self._flags: dict = {}  # (device, bool) -> the constant flag step() returns
        self._held: Optional[list] = None  # hold_gradients(): the gradients zeroed in place each step

    def hold_gradients(self, model: nn.Module) -> None:
        """Keep the model's gradients in buffers of the run's own, zeroed in place after each step,
        instead of dropping them. Under CUDA graphs a backward's gradients are graph outputs, which
        the graph's next replay overwrites: the first backward of a step would lend them to
        ``.grad`` and the next micro-batch (``--accum-steps``) overwrite what it should add to
        (pytorch/pytorch#169545). With ``.grad`` already there, autograd adds into it instead."""
        self._held = [p for p in unwrap(model).parameters() if p.requires_grad]
        for p in self._held:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _zero_held(self) -> bool:
        """Zero the held gradients (:meth:`hold_gradients`) in place; False where none are held."""
        if self._held is not None:
            foreach_zero_([p.grad for p in self._held])
        return self._held is not None

    def _clear_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step: the gradients zeroed in their held buffers, or dropped."""
        if not self._zero_held():
            optimizer.zero_grad(set_to_none=True)

    def _clip(self, params) -> None:
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_norm)

    def _flag(self, stepped: bool, device: torch.device) -> torch.Tensor:
        """``stepped`` as a 0-dim bool tensor on ``device``, made once and never written to, so a
        step whose outcome is known on the host returns a device flag without a copy to the device."""
        key = (device, stepped)
        flag = self._flags.get(key)
        if flag is None:
            flag = self._flags[key] = torch.full((), stepped, dtype=torch.bool, device=device)
        return flag

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

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Apply the gradients (unless they overflowed) and clear them.

        Returns a 0-dim bool tensor on the parameters' device, True when the weights changed;
        it is never a host value, so no mode makes the caller wait for the device, and the
        caller must not write to it (a mode may return the same tensor every step).
        """
        self._clip(_optimizer_params(optimizer))
        optimizer.step()
        self._clear_grads(optimizer)
        return self._flag(True, _param_device(optimizer))

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


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's parameters that have a gradient this step."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _param_device(optimizer: torch.optim.Optimizer) -> torch.device:
    return next(p for g in optimizer.param_groups for p in g["params"]).device
