"""``--optimizer lars``: Layer-wise Adaptive Rate Scaling (You, Gitman and Ginsburg, 2017), MLPerf's rule.

For each weight tensor ``w`` of a group marked ``lars`` (every weight but BatchNorm parameters
and biases), with its gradient ``g``, weight decay ``wd``, trust coefficient ``eta`` and ``eps``::

    trust = eta * |w| / (|g| + wd * |w| + eps)    (1 where |w| or |g| is 0)
    d     = trust * (g + wd * w)
    v     = momentum * v + d
    w     = w - lr * v

Groups not marked ``lars`` (BatchNorm parameters and biases) take plain momentum SGD with no
weight decay: MLPerf excludes them from both the scaling and the decay.

The momentum form is NVIDIA's MLPerf submissions' (MXNet ``SGDwFASTLARS``, the 8x H200 run
included): their buffer ``s = m * (lr_t / lr_t-1) * s + lr_t * d; w -= s`` is the one above with
``s = lr_t * v``. The TensorFlow reference (mlcommons/training ``lars_optimizer.py``) takes
``s = m * s + lr_t * d``, without the ratio: the two differ only while the learning rate changes
between steps (warm-up, decay), where the reference's buffer still carries steps taken at the
earlier rates. The form above keeps the buffer in SGD's units, so this optimizer is torch's SGD
(its fused or multi-tensor kernels, checkpoints, schedules and skip-on-overflow) over gradients
replaced by ``d``; ``--fp16``'s Triton step (:mod:`imagenet.kernels.masterstep`) computes the same.

``eps`` defaults to 0 as in NVIDIA's submissions (their logs' ``lars_epsilon``); the reference
replaces an eps of 0 by Keras' 1e-7, timm uses 1e-8. With eps 0 the denominator is never 0 where
the ratio is used: |g| > 0 there.

The norms stay on the device (``torch._foreach_norm``): no step waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.torch_private import optimizer_grad_scale, set_optimizer_grad_scale


@dataclass(frozen=True)
class LarsSettings:
    """``--lars-eta`` (trust coefficient) and ``--lars-eps`` (in the units of a gradient's norm)."""

    eta: float = 0.001
    eps: float = 0.0


def trust_ratios(weights: list, grads: list, weight_decay: float, settings: LarsSettings) -> torch.Tensor:
    """Each tensor's trust ratio, one float32 device tensor (nothing read back to the host)."""
    w = torch.stack(torch._foreach_norm(weights)).float()
    g = torch.stack(torch._foreach_norm(grads)).float()
    ratio = settings.eta * w / (g + weight_decay * w + settings.eps)
    return torch.where((w > 0) & (g > 0), ratio, torch.ones_like(ratio))


class Lars(torch.optim.SGD):
    """LARS as above over torch's SGD: a group's ``lars`` key (True for the scaled weights) and its
    ``weight_decay`` say what its gradients become before SGD's momentum step, taken with no weight
    decay of its own. ``sgd_kwargs`` choose torch's kernel (``fused=True`` or ``foreach=True``)."""

    def __init__(self, groups: list, *, lr: float, momentum: float, settings: LarsSettings, **sgd_kwargs):
        super().__init__(groups, lr=lr, momentum=momentum, **sgd_kwargs)
        self.defaults.update(lars=False, eta=settings.eta, eps=settings.eps)
        for group in self.param_groups:
            for key in ("lars", "eta", "eps"):
                group.setdefault(key, self.defaults[key])

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS step (no ``closure``: the gradients are scaled before SGD would call it). A
        gradient scale handed by torch's GradScaler (fused kernels) is divided out first, since the
        trust ratio needs the true gradient; an overflow flag it handed (``found_inf``) still makes
        SGD's fused kernel skip the step on the device."""
        if closure is not None:
            raise ValueError("Lars.step takes no closure: the gradients must exist before it scales them")
        scale = optimizer_grad_scale(self)
        if scale is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, scale)
            set_optimizer_grad_scale(self, None)
        decays = [group["weight_decay"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                if group["lars"]:
                    self._scale_gradients(group)
                    group["weight_decay"] = 0.0  # already inside the scaled gradient
            return super().step()
        finally:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = decay
            if scale is not None:
                set_optimizer_grad_scale(self, scale)

    def _scale_gradients(self, group: dict) -> None:
        """``g <- trust * (g + wd * w)`` in place for the group's weights that have a gradient."""
        weights = [p for p in group["params"] if p.grad is not None]
        if not weights:
            return
        grads = [p.grad for p in weights]
        decay = group["weight_decay"]
        ratios = trust_ratios(weights, grads, decay, LarsSettings(group["eta"], group["eps"]))
        if decay:
            torch._foreach_add_(grads, weights, alpha=decay)
        # one multiply per tensor: torch's multi-tensor kernels take one scalar per list, or host numbers
        torch._foreach_mul_(grads, list(ratios.unbind(0)))
