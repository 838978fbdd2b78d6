"""Tar-shard datasets (:mod:`imagenet.data.shards.index`): recognising a shard folder, and reading
its samples as :class:`imagenet.data.images.folder.SafeImageFolder` reads files.

A sample is one ``os.pread`` at the offset its index row gives: no tar parsing at training
time, so a damaged tar header costs nothing and every sample is reachable in any order. The
decoders get the bytes as a file object and do exactly what they do with a file, so a sample
and the file it was packed from give the same pixels, crops and flips for the same seed.
An unreadable sample comes back as ``(None, label, "train-000012.tar:KEY.jpg")``, skipped and
counted like an unreadable file. So does an image the converter left out (unreadable when it was
packed; the index lists it), at its place in the epoch, without a read: a shard run skips and
counts what a run from its folder does.

A dataset opens a shard on its first sample and keeps up to :data:`MAX_OPEN_SHARDS` open;
:meth:`ShardDataset.close` (the run's end), a forked worker (for the parent's copies) and the
garbage collector close them.
"""

from __future__ import annotations

import io
import logging
import os
import time
import weakref
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ...base.errors import UserError
from .index import (INDEX, MAKE_HINT, ShardIndex, SplitIndex, check_shards, has_tars, header_name,
                         member_name, read_index)
from ..transforms import set_output_size

logger = logging.getLogger(__name__)

MAX_OPEN_SHARDS = 128  # per process: ImageNet in 64 MB shards is 2,300 files, past a common fd limit of 1,024


def find_shards(root: str) -> Optional[ShardIndex]:
    """The checked index of the shard folder ``root``; None when ``root`` is no shard folder
    (an image folder); UserError for tars without an index (an unfinished conversion)."""
    if not os.path.isfile(os.path.join(root, INDEX)):
        if has_tars(root) and not os.path.isdir(os.path.join(root, "train")):
            raise UserError(f"{root} holds tar files but no {INDEX}: an unfinished conversion, or shards another "
                            f"tool wrote; run {MAKE_HINT.format(root=root)} (it continues an unfinished one)")
        return None
    index = read_index(root)
    check_shards(index)
    return index


def open_rgb(fp) -> Image.Image:
    """torchvision's ``pil_loader`` for a file object: the classic pipeline's loader."""
    return Image.open(fp).convert("RGB")


class SampleBytes(io.BytesIO):
    """A sample's encoded image as a file PIL can open, named for the skipped-images report (and
    for PIL's messages, which show a file object's repr); ``read_s``: the seconds reading it took
    (``--decode gpu``'s per-stage account reports them)."""

    def __init__(self, data: bytes, name: str, read_s: float = 0.0):
        super().__init__(data)
        self.name = name
        self.read_s = read_s

    def __repr__(self) -> str:
        return repr(self.name)


def _close_fds(fds: OrderedDict) -> None:
    while fds:
        try:
            os.close(fds.popitem()[1])
        except OSError:
            pass


class ShardDataset(Dataset):
    """One split of a shard folder. Keys as :class:`SafeImageFolder`'s: ``row``, or
    ``(row, seed[, size])`` from a sampler; ``loader`` turns a :class:`SampleBytes` into what
    ``transform`` takes (the fast decoders take it as it is). Rows past the table's are the
    images the converter left out (:attr:`image_ids` and :attr:`shard_of_rows` include them)."""

    def __init__(self, split: SplitIndex, transform, loader):
        self.split = split
        self.transform = transform
        self.loader = loader
        self._table = None
        self._open()

    def _open(self) -> None:
        self._fds: OrderedDict = OrderedDict()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)  # a dataset dropped unclosed

    def close(self) -> None:
        """Close the shards this process opened and unmap the table (the run is over). A later
        sample opens what it needs again."""
        _close_fds(self._fds)
        self._table = None

    def __len__(self) -> int:
        return self.split.samples + len(self.split.left_out)

    @property
    def table(self):
        """The index rows of the packed samples (memory-mapped)."""
        if self._table is None:
            self._table = self.split.table()
        return self._table

    @property
    def image_ids(self) -> np.ndarray:
        """Each row's id (its index in the source folder's split), left-out images included."""
        return np.concatenate([self.table["id"].astype(np.int64),
                               np.array([item["id"] for item in self.split.left_out], dtype=np.int64)])

    @property
    def shard_of_rows(self) -> np.ndarray:
        """Each row's shard; a left-out image's is the shard it would have been packed into."""
        return np.concatenate([self.table["shard"].astype(np.int64),
                               np.array([item["shard"] for item in self.split.left_out], dtype=np.int64)])

    def __getstate__(self) -> dict:
        # Workers map the table themselves (one page-cached copy, not a pickled one each) and
        # open their own file descriptors.
        return {k: v for k, v in self.__dict__.items() if k not in ("_table", "_fds", "_finalizer")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._table = None
        self._open()

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: its copies of the parent's descriptors go
            _close_fds(self._fds)
            self._pid = os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SHARDS:
                os.close(self._fds.popitem(last=False)[1])
            fd = self._fds[shard] = os.open(self.split.path(shard), os.O_RDONLY)
        else:
            self._fds.move_to_end(shard)
        return fd

    def name(self, shard: int, offset: int) -> str:
        """``train-000012.tar:KEY.jpg`` (the member's name from its tar header), for reports."""
        shard_file = self.split.shards[shard]["name"]
        try:
            member = member_name(self._fd(shard), offset)
        except OSError:
            member = None
        return f"{shard_file}:{member}" if member else f"{shard_file}@{offset}"

    def _left_out(self, row: int) -> tuple:
        item = self.split.left_out[row - self.split.samples]
        return None, item["label"], f"{self.split.name}/{item['name']} (not in the shards: {item['reason']})"

    def __getitem__(self, key):
        index, seed, size = (tuple(key) + (None,))[:3] if isinstance(key, tuple) else (key, None, None)
        if index >= self.split.samples:
            return self._left_out(index)
        if seed is not None:
            torch.default_generator.manual_seed(seed)  # as SafeImageFolder: the CPU generator only
        if size is not None:
            set_output_size(self.transform, size)
        shard, offset, length, label, _ = self.table[index].item()
        try:
            started = time.perf_counter()
            fd = self._fd(shard)
            data = os.pread(fd, length, offset)
            header = os.pread(fd, 512, offset - 512) if offset >= 512 else b""
            read_s = time.perf_counter() - started
            if len(data) != length:
                raise EOFError(f"{len(data)} of {length} bytes: the shard was truncated after start-up")
            member = header_name(header)
            shard_file = self.split.shards[shard]["name"]
            name = f"{shard_file}:{member}" if member else f"{shard_file}@{offset}"
            image = self.loader(SampleBytes(data, name, read_s))
            if self.transform is not None:
                image = self.transform(image)
        except Exception as e:  # a broken sample must not end a multi-day run
            name = self.name(shard, offset)
            logger.debug("skipping unreadable sample %s: %s", name, e)
            return None, label, name
        return image, label, None
