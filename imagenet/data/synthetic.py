"""``--dummy``: synthetic images made once on the training device, no files and no workers."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Dataset

class SyntheticDataset(Dataset):
    """``--dummy``: ``size`` images of one shape, labels cycling through the classes (one random
    normalised image per class, at most 64 distinct). No files and no workers: the loaders
    make their batches once, on the training device (:class:`SyntheticLoader`)."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0):
        self.size = size
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def batch(self, n: int, device: torch.device, channels_last: bool, size: Optional[int] = None) -> tuple:
        """Images (``size`` px, default the dataset's) and labels of samples 0..n-1, on ``device``."""
        g = torch.Generator().manual_seed(self.seed)
        size = size or self.image_size
        protos = torch.randn(min(self.num_classes, 64), 3, size, size, generator=g)
        index = torch.arange(n)
        images = protos[index % len(protos)].to(device)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, (index % self.num_classes).to(device)


class SyntheticLoader:
    """``--dummy``'s loader: one batch made on the device at start-up, handed out every step.

    A rank's epoch has as many steps as the file loaders would give it (the same sampler
    arithmetic), so ``--dummy`` runs the real loop, and measures the model alone: nothing is
    decoded, collated or copied per step.
    """

    def __init__(self, dataset: SyntheticDataset, *, batch: int, samples: int, drop_last: bool,
                 device: torch.device, channels_last: bool):
        self.batch_size = batch
        self.batches = samples // batch if drop_last else -(-samples // batch)
        self.last = batch if drop_last else samples - (self.batches - 1) * batch
        self.dataset, self.device, self.channels_last = dataset, device, channels_last
        self.images, self.targets = dataset.batch(min(batch, samples) or 1, device, channels_last)
        self.sampler = self  # the runner's per-epoch calls (set_epoch, set_start, set_image_size) land here
        self.start = 0

    def set_image_size(self, size: int) -> None:
        """``--progressive-resize``: the batch made again at ``size`` px (once a size change, on the
        device), so one ``--dummy`` run times the step at each size of the ramp."""
        if self.images.shape[-1] != size:
            self.images, self.targets = self.dataset.batch(len(self.targets), self.device, self.channels_last, size)

    def set_epoch(self, epoch: int) -> None:
        self.start = 0

    def set_start(self, samples_done: int) -> None:
        self.start = samples_done // self.batch_size

    def decode_counts(self) -> dict:
        return {"gpu": 0, "cpu": 0, "share": 0}

    def close(self) -> None:
        """Nothing to end: no workers."""

    def __len__(self) -> int:
        return max(self.batches - self.start, 0)

    def __iter__(self):
        for i in range(self.start, self.batches):
            n = self.batch_size if i < self.batches - 1 else self.last
            if n == len(self.targets):
                yield self.images, self.targets, []
            else:  # validation's last, partial batch
                yield self.images[:n], self.targets[:n], []
