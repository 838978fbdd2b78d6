"""Exponential moving average of the weights (``--model-ema DECAY``), kept in float32.

After every optimizer step that changed the weights, ``ema = d * ema + (1 - d) * w`` for every
parameter and floating-point buffer (BatchNorm statistics), with multi-tensor lerps masked on the
device by the step's flag (a skipped step leaves the average as it is; nothing waits). In fp16
mode ``w`` is the fp32 master, not the rounded fp16 copy. The decay warms up as
``min(d, (1 + n) / (10 + n))`` over the first updates, so a short run's average is not
dominated by the random initialisation. The average is a plain fp32 model of the same
architecture: validated every epoch and saved as ``state_dict_ema`` (loadable into torchvision).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..base.wrappers import unwrap
from ..parallel.distributed import DistContext, average_buffers
from ..precision import Precision


class ModelEma:
    """The averaged model and the tensors it follows."""

    def __init__(self, model: nn.Module, precision: Precision, decay: float):
        net = unwrap(model)
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(net).float().eval()
        self.model.load_state_dict(precision.model_state_dict(net))  # exact fp32 (masters in fp16 mode)
        for p in self.model.parameters():
            p.requires_grad_(False)
        masters = getattr(precision, "masters", None)
        sources = list(masters) if masters else list(net.parameters())
        self._dst = [p.detach() for p in self.model.parameters()]
        self._src = [p.detach() for p in sources]
        buffers = list(zip(self.model.buffers(), net.buffers()))
        self._dst_buf = [d for d, s in buffers if d.is_floating_point()]
        self._src_buf = [s for d, s in buffers if d.is_floating_point()]
        self._counters = [(d, s) for d, s in buffers if not d.is_floating_point()]
        self._averaged = False  # the statistics are the ranks' mean and no update came since

    @torch.no_grad()
    def update(self, stepped: torch.Tensor) -> None:
        """Follow one optimizer step; ``stepped`` is its device flag (``precision.step``'s 0-dim
        bool tensor): False means the step was skipped and the average stays as it is.

        The update is masked on the device, so nothing waits for the host; ``updates`` (the decay
        warm-up's clock) counts every step, skipped or not.
        """
        self.updates += 1
        self._averaged = False
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        # avg = keep * lerp(avg, w, 1 - d) + (1 - keep) * avg, in four multi-tensor passes: with
        # keep 1 this is exactly the lerp (avg * 0 adds a zero), with keep 0 exactly the average
        # (the weights of a skipped step are the unchanged, finite masters, so lerp * 0 is 0).
        keep = stepped.to(torch.float32)
        moved = torch._foreach_lerp(self._dst, self._src, 1.0 - d)
        torch._foreach_mul_(moved, keep)
        torch._foreach_mul_(self._dst, 1.0 - keep)
        torch._foreach_add_(self._dst, moved)
        if self._dst_buf:
            # BatchNorm statistics of an overflowing forward may be NaN, which a zero weight
            # would not cancel (NaN * 0): select the average's own values instead.
            target = [torch.where(stepped, src.float(), avg) for avg, src in zip(self._dst_buf, self._src_buf)]
            torch._foreach_lerp_(self._dst_buf, target, 1.0 - d)
        for dst, src in self._counters:
            dst.copy_(src)

    def average_statistics(self, ctx: DistContext) -> None:
        """Under DDP, set the average's BatchNorm statistics to their mean over the ranks, the same
        on every rank (each rank's follow its own batches' statistics). Once per update: a second
        call before the next update changes nothing (every rank calls it at the same points: it is
        a collective). The mean of the ranks' averages is the average of the ranks' mean, so taking
        it at a mid-epoch checkpoint too changes no result, and a run resumed there (every rank
        loads rank 0's) continues from the values every rank of this run holds."""
        if not self._averaged:
            average_buffers(self.model, ctx)
            self._averaged = True

    def state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict, updates: int) -> None:
        self.model.load_state_dict(state)
        self.updates = updates
        self._averaged = True  # every rank loads the same
