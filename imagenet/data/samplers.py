"""Which images a rank reads in an epoch, in which order, with which augmentation seed."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


class _SeededKeys(Sampler):
    """What the training samplers share: the epoch, the samples already done, the crop size, and
    keys ``(index, augmentation_seed[, size])`` whose seed is a function of (seed, epoch, image id)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.epoch = 0
        self.start = 0
        self.image_size: Optional[int] = None  # set per epoch under --progressive-resize

    def set_image_size(self, size: Optional[int]) -> None:
        """Ask the dataset for ``size`` px training crops (travels with every key to the workers)."""
        self.image_size = size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = 0

    def set_start(self, samples_done: int) -> None:
        """Skip the first ``samples_done`` samples of this rank's share of the epoch."""
        self.start = samples_done

    def order_settings(self) -> dict:
        """The settings of this sampler that decide which images an epoch's batches hold, beside
        the dataset itself (:mod:`imagenet.data.dataorder`). Not the world size: rank r of w
        takes positions r, r+w, ... of one global order, so the first k global batches hold the
        same images for any world size with the same global batch."""
        return {"seed": self.seed}

    def _keys(self, indices, ids):
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        for idx, image_id in zip(indices, ids):
            if self.image_size is None:
                yield idx, (base + image_id) % (2 ** 63)
            else:
                yield idx, (base + image_id) % (2 ** 63), self.image_size


class SeededSampler(_SeededKeys):
    """A rank's shuffled share of an epoch, as ``(index, augmentation_seed)`` pairs.

    Shuffling is DistributedSampler's (a world of one is a single process, so every launch mode
    sees the same global batches), without padding. The per-sample seed is a function of
    (seed, epoch, index): a run resumed in the middle of an epoch (``set_start``) draws the same
    crops and flips as one that never stopped, whatever the worker count.
    """

    def __init__(self, dataset, world_size: int, rank: int, seed: int):
        super().__init__(seed)
        self.inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                        drop_last=True)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)
        super().set_epoch(epoch)

    def __iter__(self):
        indices = list(self.inner)[self.start:]
        return self._keys(indices, indices)

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


class ShardWindowSampler(_SeededKeys):
    """:class:`SeededSampler`'s contract over tar shards: the same keys, lengths and resume, an
    order that reads ``window`` samples' worth of shards at a time.

    The epoch's order is global and a pure function of (seed, epoch): the shards in a shuffled
    order, taken in groups of whole shards holding about ``window`` samples, each group's samples
    fully permuted. Rank ``r`` of ``w`` takes positions r, r+w, ... of it, the tail that does not
    divide evenly dropped, so a DDP run's global batches hold the images a single process's do
    and every rank has the same length. A sample's seed comes from its id (its index in the
    source image folder), so it gets the crops and flips a folder run gives it. When one group
    covers every shard (``window`` at least the set) the order is the folder run's own.
    """

    def __init__(self, shard_of_row, ids, world_size: int, rank: int, seed: int, window: int):
        super().__init__(seed)
        shard_of_row = np.asarray(shard_of_row, dtype=np.int64)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.world, self.rank, self.window = world_size, rank, window
        n_shards = int(shard_of_row.max()) + 1 if len(shard_of_row) else 1
        by_shard = np.argsort(shard_of_row, kind="stable")
        self.rows_of = np.split(by_shard, np.cumsum(np.bincount(shard_of_row, minlength=n_shards))[:-1])
        self.group = max(1, round(window * n_shards / max(len(self.ids), 1)))  # shards shuffled together
        # position p of a full shuffle is the row of the p-th smallest id: the folder's index p
        self.by_id = np.argsort(self.ids, kind="stable")

    def order_settings(self) -> dict:
        """The seed and how many shards are shuffled together (``--shuffle-window`` as it applies
        to this set: every window at least the set's size is one full shuffle)."""
        return {"seed": self.seed, "shuffle_window": self.window,
                "shards_together": min(self.group, len(self.rows_of))}

    def epoch_order(self) -> np.ndarray:
        """Every row once, in this epoch's global order (40 ms for ImageNet's 1.28 M rows in 141 shards,
        140 ms as one full shuffle, on one core of the 2-core machine)."""
        n_shards = len(self.rows_of)
        if self.group >= n_shards:  # DistributedSampler's permutation: the folder run's order
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return self.by_id[torch.randperm(len(self.ids), generator=g).numpy()]
        seed = self.seed % (1 << 64)  # numpy's seeds are non-negative
        shards = np.random.default_rng([seed, self.epoch, 0]).permutation(n_shards)
        parts = []
        for g, first in enumerate(range(0, n_shards, self.group)):
            rows = np.concatenate([self.rows_of[s] for s in shards[first:first + self.group]])
            parts.append(rows[np.random.default_rng([seed, self.epoch, 1 + g]).permutation(len(rows))])
        return np.concatenate(parts)

    def __iter__(self):
        total = len(self.ids) // self.world * self.world
        mine = self.epoch_order()[self.rank:total:self.world][self.start:]
        return self._keys(mine.tolist(), self.ids[mine].tolist())

    def __len__(self) -> int:
        return max(len(self.ids) // self.world - self.start, 0)


class ShardSampler(Sampler):
    """Rank ``r`` of ``w`` gets indices r, r+w, r+2w, ...: every sample exactly once, no padding."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = list(range(rank, length, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class BlockSampler(Sampler):
    """Rank ``r`` of ``w`` gets the contiguous block [r n / w, (r + 1) n / w): every sample exactly
    once, no padding, block sizes differing by at most one. Over tar shards a rank reads about
    1/w of the shards instead of a part of every one. ``order``: the indices in the order the
    blocks are cut from (default: 0 .. n-1)."""

    def __init__(self, length: int, rank: int, world_size: int, order: Optional[Sequence[int]] = None):
        block = range(rank * length // world_size, (rank + 1) * length // world_size)
        self.indices = block if order is None else [int(order[i]) for i in block]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
