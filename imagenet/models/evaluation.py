"""The validation forward pass: flip averaging (``--val-flip``), and the shape a compiled one sees.

Training compiles the model for its training sizes; validation runs at its own size, in
evaluation mode (BatchNorm's running statistics) and without gradients, which is another graph.
:class:`Evaluator` is a module of its own around the same network, so ``torch.compile`` gives it
graphs of its own beside the training model's (Dynamo keeps a function's graphs per code object)
and, under ``reduce-overhead``, a CUDA graph of its own in the same pool. :class:`FixedBatch`
feeds it one batch size: the last, shorter batch of an evaluation is padded, so it compiles and
records nothing more.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class Evaluator(nn.Module):
    """``net``'s logits for a batch; with ``flip``, the mean of its logits for the images and for
    their left-right mirrors (FFCV's evaluation; the loss and the accuracy are then those of the
    mean), summed in float32. ``net`` is the training model's own module: the same weights."""

    def __init__(self, net: nn.Module, flip: bool = False):
        super().__init__()
        self.net = net
        self.flip = flip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if not self.flip:
            return out
        return (out.float() + self.net(x.flip(3)).float()) / 2


class FixedBatch:
    """``fn`` run on batches of exactly ``batch`` images: a shorter one (an evaluation's last) is
    padded with zero images and the outputs cut back to its own. In evaluation mode every image's
    logits are its own, so the padding changes none of them; a compiled ``fn`` then sees one
    shape (with the memory layout of the batches before it) and compiles once."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], batch: int):
        self.fn, self.batch = fn, batch

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        if n >= self.batch:
            return self.fn(images)
        layout = (torch.channels_last if images.dim() == 4 and not images.is_contiguous()
                  and images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format)
        full = images.new_zeros((self.batch, *images.shape[1:])).contiguous(memory_format=layout)
        full[:n].copy_(images)
        return self.fn(full)[:n]


def nonfinite_statistics(model: nn.Module) -> list:
    """The names of ``model``'s BatchNorm layers whose running statistics hold NaN or inf, which
    evaluation uses: torch's BatchNorm folds a batch's statistics in even when the forward pass
    overflowed (pytorch/pytorch#88474; our kernels leave such a channel's statistics as they were),
    and once NaN they stay NaN. One host sync: call it where the host waits anyway."""
    named = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]
    if not named:
        return []
    bad = torch.stack([~(torch.isfinite(m.running_mean).all() & torch.isfinite(m.running_var).all())
                       for _, m in named]).tolist()
    return [name for (name, _), b in zip(named, bad) if b]
