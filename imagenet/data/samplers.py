"""Which images a rank reads in an epoch, in which order, with which augmentation seed."""

from __future__ import annotations

from typing import Optional

from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

class SeededSampler(Sampler):
    """A rank's shuffled share of an epoch, as ``(index, augmentation_seed)`` pairs.

    Shuffling is DistributedSampler's (a world of one is a single process, so every launch mode
    sees the same global batches), without padding. The per-sample seed is a function of
    (seed, epoch, index): a run resumed in the middle of an epoch (``set_start``) draws the same
    crops and flips as one that never stopped, whatever the worker count.
    """

    def __init__(self, dataset, world_size: int, rank: int, seed: int):
        self.inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                        drop_last=True)
        self.seed = seed
        self.epoch = 0
        self.start = 0
        self.image_size: Optional[int] = None  # set per epoch under --progressive-resize

    def set_image_size(self, size: Optional[int]) -> None:
        """Ask the dataset for ``size`` px training crops (travels with every key to the workers)."""
        self.image_size = size

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)
        self.epoch = epoch
        self.start = 0

    def set_start(self, samples_done: int) -> None:
        """Skip the first ``samples_done`` samples of this rank's share of the epoch."""
        self.start = samples_done

    def __iter__(self):
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        for idx in list(self.inner)[self.start:]:
            if self.image_size is None:
                yield idx, (base + idx) % (2 ** 63)
            else:
                yield idx, (base + idx) % (2 ** 63), self.image_size

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


class ShardSampler(Sampler):
    """Rank ``r`` of ``w`` gets indices r, r+w, r+2w, ...: every sample exactly once, no padding."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = list(range(rank, length, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
