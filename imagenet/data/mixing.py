"""Mixup and CutMix on the device: a batch is mixed with its own reversal, labels become soft.

``--mixup A`` draws lam ~ Beta(A, A) and blends whole images; ``--cutmix A`` pastes a box of
area (1 - lam) from the partner image and sets lam to the exact pasted fraction. With both,
each batch picks one of the two with probability 1/2 (as timm and torchvision's references do).
The draws come from the torch RNG, which checkpoints save and restore.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class BatchMixer:
    """Callable: (images, targets) -> (mixed images, soft targets [N, classes])."""

    def __init__(self, num_classes: int, mixup: float = 0.0, cutmix: float = 0.0, label_smoothing: float = 0.0):
        if mixup <= 0 and cutmix <= 0:
            raise ValueError("BatchMixer needs mixup or cutmix > 0")
        self.num_classes = num_classes
        self.mixup = mixup
        self.cutmix = cutmix
        self.smoothing = label_smoothing

    def _soft(self, targets: torch.Tensor) -> torch.Tensor:
        off = self.smoothing / self.num_classes
        return F.one_hot(targets, self.num_classes).float() * (1.0 - self.smoothing) + off

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> tuple:
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or torch.rand(()).item() < 0.5)
        alpha = self.cutmix if use_cutmix else self.mixup
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        partner = images.flip(0)
        if use_cutmix:
            h, w = images.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
            y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
            x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
            images = images.clone()
            images[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the fraction actually kept
        else:
            images = images.mul(lam).add_(partner, alpha=1.0 - lam)
        soft = self._soft(targets)
        return images, soft.mul(lam).add_(soft.flip(0), alpha=1.0 - lam)
