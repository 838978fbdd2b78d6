"""One tar shard being written, in the WebDataset layout: each sample's image and class as two
members (``KEY.EXT``, ``KEY.cls``) with headers carrying no dates or owners, so the same input
gives the same bytes; padded to tar's 512-byte blocks, written under a temporary name and renamed
when closed; the index rows (offset, size, label, id) of its samples as it goes. And the samples'
keys: ``class/stem``, unique within a split."""

from __future__ import annotations

import os
import tarfile

BLOCK = 512


def header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644  # no dates or owners: the same input gives the same bytes
    try:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    except ValueError:  # a name past USTAR's 255 characters
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class TarShard:
    """One tar being written: samples as KEY.EXT + KEY.cls, its index rows as it goes."""

    def __init__(self, path: str):
        self.path = path
        self.fh = open(path + ".tmp", "wb")
        self.bytes = 0
        self.rows: list = []  # [offset, size, label, id]
        self.formats: dict = {}  # extension -> images

    @staticmethod
    def cost(key: str, ext: str, data: bytes, label: int) -> tuple:
        """The sample's members as (header, data) pairs and the bytes they take."""
        cls = str(label).encode()
        members = [(header(f"{key}.{ext}", len(data)), data), (header(f"{key}.cls", len(cls)), cls)]
        return members, sum(len(h) + padded(len(d)) for h, d in members)

    def add(self, members: list, size: int, label: int, image_id: int) -> None:
        (header, data), _ = members
        self.rows.append([self.bytes + len(header), len(data), label, image_id])
        for header, data in members:
            self.fh.write(header)
            self.fh.write(data)
            self.fh.write(b"\0" * (padded(len(data)) - len(data)))
        self.bytes += size

    def close(self) -> int:
        """Finish the archive and give it its name; returns its size."""
        self.fh.write(b"\0" * (2 * BLOCK))  # the end-of-archive marker
        self.fh.close()
        os.replace(self.path + ".tmp", self.path)
        return self.bytes + 2 * BLOCK


def sample_keys(split_dir: str, samples: list) -> list:
    """Each sample's key, ``class/stem``: WebDataset cuts a key at the first dot of the file name,
    so the stem has none; a key two files would share (a.jpg, a.png) gets the image id."""
    keys, taken = [], set()
    for image_id, (path, _) in enumerate(samples):
        folder, name = os.path.split(os.path.relpath(path, split_dir))
        key = "/".join(filter(None, [folder.replace(os.sep, "/"), os.path.splitext(name)[0].replace(".", "_")]))
        if key in taken:
            key = f"{key}_{image_id}"
        taken.add(key)
        keys.append(key)
    return keys
