"""Mixup and CutMix on the device: a batch is mixed with its own reversal, labels become soft.

``--mixup A`` draws lam ~ Beta(A, A) and blends whole images; ``--cutmix A`` pastes a box of
area (1 - lam) from the partner image and sets lam to the exact pasted fraction. With both,
each batch picks one of the two with probability 1/2 (as timm and torchvision's references do).

The draws for a batch come from a generator seeded with (seed, rank, epoch, batch index), never
from the process's global RNGs: those also serve the data loader (making a DataLoader iterator
takes a draw, and loading in the training process reseeds torch's per image), so draws taken
from them depended on the worker count and shifted in a resumed run. Seeded per batch, a run
draws the same with or without workers, and a resumed run what an uninterrupted one would.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


class BatchMixer:
    """Callable: (images, targets, epoch=, batch=) -> (mixed images, soft targets [N, classes]).
    ``seed`` and ``rank`` (each rank mixes its own batches, with draws of its own) with the
    epoch and the batch's index in it choose the draws."""

    def __init__(self, num_classes: int, mixup: float = 0.0, cutmix: float = 0.0, label_smoothing: float = 0.0,
                 *, seed: int = 0, rank: int = 0):
        if mixup <= 0 and cutmix <= 0:
            raise ValueError("BatchMixer needs mixup or cutmix > 0")
        self.num_classes = num_classes
        self.mixup = mixup
        self.cutmix = cutmix
        self.smoothing = label_smoothing
        self.seed, self.rank = seed, rank

    def _rng(self, epoch: int, batch: int) -> np.random.Generator:
        # SeedSequence takes non-negative integers; a negative --seed maps to its 64-bit pattern
        return np.random.default_rng([self.seed & (2 ** 64 - 1), self.rank, epoch, batch])

    def _soft(self, targets: torch.Tensor) -> torch.Tensor:
        off = self.smoothing / self.num_classes
        return F.one_hot(targets, self.num_classes).float() * (1.0 - self.smoothing) + off

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, *, epoch: int, batch: int) -> tuple:
        rng = self._rng(epoch, batch)
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or rng.random() < 0.5)
        alpha = self.cutmix if use_cutmix else self.mixup
        lam = float(rng.beta(alpha, alpha))
        partner = images.flip(0)
        if use_cutmix:
            h, w = images.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = int(rng.integers(h)), int(rng.integers(w))
            y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
            x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
            images = images.clone()
            images[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the fraction actually kept
        else:
            images = images.mul(lam).add_(partner, alpha=1.0 - lam)
        soft = self._soft(targets)
        return images, soft.mul(lam).add_(soft.flip(0), alpha=1.0 - lam)
