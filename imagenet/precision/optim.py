"""The optimizer: SGD with momentum over parameter groups, fused into one kernel per step on GPUs;
with ``--optimizer lars``, :class:`~imagenet.precision.lars.Lars` over the same kernels.

``--optimizer-impl``:

* ``auto`` (default) -- ``triton`` for ``--fp16`` on CUDA (the trainer's defaults decide it, for
  the banner), else ``fused`` on CUDA, ``foreach`` elsewhere.
* ``triton`` -- ``--fp16``'s step as two Triton kernels
  (:class:`~imagenet.kernels.masterstep.MasterStep`: the inf/NaN check, then one pass from the
  fp16 gradients to the fp32 masters, momentum and fp16 weights), over a ``fused`` optimizer whose
  state they keep; other precisions, and ``--clip-grad-norm``, step with ``fused``.
* ``fused`` -- ``torch.optim.SGD(fused=True)``: one kernel for every parameter. It also takes
  the loss scaler's inf/NaN flag as a device tensor and leaves weights and momentum untouched
  when it is set, so a step with overflowing gradients is skipped without the host waiting for
  the verdict: no host synchronisation per step in ``--fp16`` or ``--amp`` float16.
* ``foreach`` -- multi-tensor SGD; a skip decision waits for the host once per step. On the CPU
  this is the bit-exact reference the resume and parity tests compare against.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..base.errors import UserError
from ..base.torch_private import takes_found_inf
from ..kernels.compiles import available as kernels_available
from .lars import Lars, LarsSettings

__all__ = ["IMPLS", "Lars", "LarsSettings", "build_optimizer", "load_optimizer_state", "param_groups",
           "resolve_impl", "supports_found_inf"]

IMPLS = ("auto", "triton", "fused", "foreach")


def param_groups(model: nn.Module, weight_decay: float, exempt_norm_and_bias: bool, lars: bool = False) -> list:
    """Optimizer groups of the model's parameters; optionally no decay on BatchNorm and biases.
    ``lars``: always so, and the weights' group marked for LARS's trust ratio (``"lars"``)."""
    if not (exempt_norm_and_bias or lars):
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        # 1-D parameters are exactly the BatchNorm weights/biases and the biases in ResNets.
        (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if lars:
        groups[0]["lars"], groups[1]["lars"] = True, False
    return groups


def resolve_impl(impl: str, device: torch.device) -> str:
    """The torch optimizer for ``--optimizer-impl`` on ``device``: ``fused`` or ``foreach``
    (``triton``'s kernels step a ``fused`` one)."""
    if impl == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return "fused" if impl == "triton" else impl


def build_optimizer(groups: list, lr: float, momentum: float, weight_decay: float, impl: str,
                    device: torch.device, *, lars: Optional[LarsSettings] = None) -> torch.optim.SGD:
    """SGD over ``groups`` (tensors on ``device``) with the implementation ``impl`` resolves to;
    with ``lars``, :class:`Lars` (an SGD) over groups from :func:`param_groups` with ``lars=True``."""
    if impl == "triton" and not kernels_available():
        raise UserError(f"--optimizer-impl triton needs Triton and a CUDA GPU it compiles for (here: {device}, "
                        f"torch {torch.__version__}); use --optimizer-impl auto")
    asked, impl = impl, resolve_impl(impl, device)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True}

    def make(**kind) -> torch.optim.SGD:
        if lars is not None:
            return Lars(groups, lr=lr, momentum=momentum, settings=lars, **kind)
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **kind)
    try:
        optimizer = make(**kwargs)
    except (RuntimeError, ValueError, TypeError) as e:
        if asked != "auto":
            raise UserError(f"--optimizer-impl {asked} cannot run on {device} with torch {torch.__version__} ({e}); "
                            "use --optimizer-impl foreach") from None
        # An older torch without fused SGD here: the multi-tensor one, skip decided on the host.
        impl = "foreach"
        optimizer = make(foreach=True)
    if impl == "fused":
        _fused_momentum_buffers(optimizer)
    return optimizer


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` reads ``optimizer.found_inf`` and skips on device by itself."""
    return takes_found_inf(optimizer)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved optimizer's state (its momentum buffers), keeping this run's settings.

    torch restores each group's settings from the file too. They belong to the command line:
    a run resumed with another ``--lr``, ``--momentum`` or ``--weight-decay`` trains with those
    (the schedule scales this run's lr), and the implementation stays this run's, fused or
    foreach (a checkpoint from a GPU run would otherwise ask for the fused kernel on a CPU, and
    one from a CPU run would silently give up the GPU's skip-without-sync).
    """
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keep in zip(optimizer.param_groups, settings):
        group.update(keep)
    if settings and settings[0].get("fused"):
        _fused_momentum_buffers(optimizer)


def _fused_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter a momentum buffer the fused kernel can use from the first step.

    The fused kernel skips a step flagged as overflowing before it writes anything. If the very
    first step is skipped, torch would keep the uninitialised buffers it allocated for it; zero
    buffers give the same first update as torch's own start (buffer = gradient, no dampening).
    A buffer loaded from a run with the other memory layout (--channels-last changed) gets the
    parameter's strides, which the fused CUDA kernel requires.
    """
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif buf.stride() != p.stride():
                state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(buf)
