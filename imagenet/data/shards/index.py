"""The tar-shard format: what ``scripts/make_shards.py`` writes and the trainer reads, and the
checks start-up makes on it.

A shard folder holds::

    train-000000.tar ...    WebDataset layout: KEY.jpg (or .png, ...) + KEY.cls (the label, in decimal),
    val-000000.tar ...      so webdataset, timm, OpenCLIP and DALI read the shards too
    train-index.npy         one ROW per sample: the shard, byte offset and size of its image's data,
    val-index.npy           its label and its id (its index in an ImageFolder of the source folder)
    classes.txt             the class names, one a line: line n is label n
    index.json              the classes and, per split, its table, its samples, its shards (name, bytes,
                            samples), the images left out (unreadable when packed) and the images' formats
    .generations/G.json     the files that generation G of the index names: what a run reading it leases

``index.json`` is written last: a folder without it is an unfinished conversion. With the index,
start-up lists no files and reads no tar headers, and a worker reads a sample with one pread.
An image the converter could not read is not packed but listed under ``left_out`` (its path in
the split, id, label, the shard it would have gone into, and why), so a run from the shards
skips and counts it where a run from the folder would. Indexes written before ``left_out`` and
``formats`` existed read as having none and as of unknown format.

A file the index names never changes. Each rebuild of the folder is a generation of its index
(``generation`` in ``index.json``; 0, the first, when absent): the shards and tables it writes
get names of their own (``train-000003.g2.tar``, ``train-index.g2.npy``), ``index.json`` is
replaced last, by a rename, and the files of earlier generations stay for the runs that read
them (:func:`hold`); ``make_shards`` removes them once no run does (its module says when).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...base.errors import UserError
from .lease import NO_LOCKS, Lease

FORMAT = "imagenet-shards"
VERSION = 1
INDEX = "index.json"
CLASSES = "classes.txt"
GENERATIONS = ".generations"  # one record per generation of the index: the files it names
SPLITS = ("train", "val")
ROW = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u4"), ("label", "<i4"), ("id", "<i8")])
MAKE_HINT = "python scripts/make_shards.py IMAGE_FOLDER {root}"


def _generation_tag(generation: int) -> str:
    return f".g{generation}" if generation else ""  # the first generation keeps the plain names


def shard_name(split: str, number: int, generation: int = 0) -> str:
    """Shard ``number`` as ``generation`` of the index writes it."""
    return f"{split}-{number:06d}{_generation_tag(generation)}.tar"


def table_name(split: str, generation: int = 0) -> str:
    return f"{split}-index{_generation_tag(generation)}.npy"


def record_path(root: str, generation: int) -> str:
    """The record of the files that ``generation`` of the index names, which a run reading it leases."""
    return os.path.join(root, GENERATIONS, f"{generation}.json")


def has_tars(root: str) -> bool:
    """Whether ``root`` holds tar files (shards, finished or not, ours or another tool's)."""
    try:
        return any(name.endswith((".tar", ".tar.tmp")) for name in os.listdir(root))
    except OSError:
        return False


@dataclass
class SplitIndex:
    """One split of a shard folder: its shards and where its table of samples is."""

    root: str
    name: str  # train | val
    shards: list  # {"name", "bytes", "samples"} per shard, in shard-number order
    samples: int  # packed: the rows of the table
    left_out: list = field(default_factory=list)  # {"name", "id", "label", "shard", "reason"} per image not packed
    formats: Optional[dict] = None  # images per format ("jpg": n, "png": m); None in older indexes
    table_file: str = ""  # the table's file name (default: the first generation's, table_name)

    def __post_init__(self):
        self.table_file = self.table_file or table_name(self.name)

    @property
    def table_path(self) -> str:
        return os.path.join(self.root, self.table_file)

    def path(self, shard: int) -> str:
        return os.path.join(self.root, self.shards[shard]["name"])

    def table(self) -> np.ndarray:
        """The rows, memory-mapped: every process of a node shares one page-cached copy."""
        return np.load(self.table_path, mmap_mode="r")


@dataclass
class ShardIndex:
    """A shard folder's ``index.json``."""

    root: str
    classes: list
    splits: dict  # name -> SplitIndex
    meta: dict  # the whole index.json, for the writer's restart check

    @property
    def shard_count(self) -> int:
        return sum(len(s.shards) for s in self.splits.values())

    @property
    def generation(self) -> int:
        """Which rebuild of the folder this index is (0: the first conversion)."""
        return int(self.meta.get("generation", 0))

    def files(self) -> list:
        """Every file this index names: the tables and the shards."""
        return [split.table_file for split in self.splits.values()] + [
            shard["name"] for split in self.splits.values() for shard in split.shards]

    def images_are_jpeg(self) -> Optional[bool]:
        """Whether most training images are JPEGs (``--decode auto``); None when the index does
        not say (written before it recorded the formats)."""
        formats = self.splits["train"].formats
        if not formats:
            return None
        return 2 * formats.get("jpg", 0) > sum(formats.values())


def parse_index(text: str, root: str, where: Optional[str] = None) -> ShardIndex:
    """``index.json``'s text -> :class:`ShardIndex`; UserError when it is not one of ours."""
    where = where or os.path.join(root, INDEX)
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise UserError(f"{where} is not valid JSON ({e}); rerun {MAKE_HINT.format(root=root)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{where} is not an index of {FORMAT} (written by scripts/make_shards.py); "
                        f"make one with {MAKE_HINT.format(root=root)}")
    if meta.get("version") != VERSION:
        raise UserError(f"{where} is version {meta.get('version')} of the shard index; this trainer reads "
                        f"version {VERSION}: rerun {MAKE_HINT.format(root=root)}")
    try:
        splits = {name: _split(root, name, meta["splits"][name]) for name in SPLITS}
        classes = [str(c) for c in meta["classes"]]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where} lacks {e} (an incomplete or hand-edited index); rerun "
                        f"{MAKE_HINT.format(root=root)}") from None
    return ShardIndex(root, classes, splits, meta)


def _split(root: str, name: str, entry: dict) -> SplitIndex:
    left_out = [dict(item, id=int(item["id"]), label=int(item["label"]), shard=int(item["shard"]))
                for item in entry.get("left_out", [])]
    formats = entry.get("formats")
    return SplitIndex(root, name, list(entry["shards"]), int(entry["samples"]), left_out,
                      {str(k): int(v) for k, v in formats.items()} if isinstance(formats, dict) else None,
                      str(entry.get("table") or table_name(name)))


def read_index(root: str) -> ShardIndex:
    """The index of the shard folder ``root``, with its tables checked (UserError otherwise)."""
    path = os.path.join(root, INDEX)
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
    index = parse_index(text, root)
    for split in index.splits.values():
        try:
            table = split.table()
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {split.table_path} ({e}); the shard folder is incomplete: rerun "
                            f"{MAKE_HINT.format(root=root)}") from None
        if table.dtype != ROW or len(table) != split.samples:
            raise UserError(f"{split.table_path} does not match {INDEX} ({len(table)} rows of {table.dtype}, the "
                            f"index says {split.samples}); rerun {MAKE_HINT.format(root=root)}")
    return index


def hold(index: ShardIndex) -> Optional[Lease]:
    """A run's lease on the generation of ``index`` (:mod:`.lease`): while it is held, no rebuild
    by ``make_shards`` removes the files this index names. None where there is nothing to lease
    (a folder written before the records, a URL's cached copy) or this file system has no locks;
    the previous generation's files are kept in any case."""
    try:
        lease = Lease(record_path(index.root, index.generation), create=False)  # the run may not write here
    except FileNotFoundError:
        if os.path.isdir(os.path.join(index.root, GENERATIONS)):  # make_shards writes a record before its index
            raise _rebuilt(index.root) from None
        return None
    except OSError as e:
        if e.errno in NO_LOCKS or isinstance(e, PermissionError):
            return None
        raise UserError(f"cannot read {record_path(index.root, index.generation)} ({e.strerror or e})") from None
    if lease.removed:  # two rebuilds since this run read the index, the second removing its files
        lease.close()
        raise _rebuilt(index.root)
    return lease


def _rebuilt(root: str) -> UserError:
    return UserError(f"{root} was rebuilt by make_shards while this run started, and the files of the index it "
                     "read are gone; run the command again")


def check_shards(index: ShardIndex) -> None:
    """Every shard is there, with the size the index gives and room for every sample it points
    into: a truncated copy or a shard rewritten since the index stops the run here, with its name,
    not hours later. Costs one stat a shard and one pass over the tables."""
    for split in index.splits.values():
        table = split.table()
        ends = np.zeros(len(split.shards), dtype=np.int64)
        if len(table):
            if int(table["shard"].max()) >= len(split.shards):
                raise UserError(f"{split.table_path} points into shards the index does not list; rerun "
                                f"{MAKE_HINT.format(root=index.root)}")
            np.maximum.at(ends, table["shard"].astype(np.int64),
                          table["offset"].astype(np.int64) + table["size"].astype(np.int64))
        for number, shard in enumerate(split.shards):
            path = split.path(number)
            try:
                size = os.stat(path).st_size
            except OSError:
                raise UserError(f"shard {path} is missing (it holds {shard['samples']} {split.name} images); copy "
                                f"the whole shard folder, or rerun {MAKE_HINT.format(root=index.root)}") from None
            if size != shard["bytes"] or size < ends[number]:
                raise UserError(f"shard {path} has {size} bytes, its index says {shard['bytes']}: the file is "
                                f"truncated or was rewritten after the index; copy it again, or rerun "
                                f"{MAKE_HINT.format(root=index.root)}")


def header_name(header: bytes) -> Optional[str]:
    """The member name a 512-byte USTAR header holds (prefix/name), or None when it is no such
    header. A few slices, not :meth:`tarfile.TarInfo.frombuf` (50 us): a worker names every sample."""
    if len(header) != 512 or header[257:262] != b"ustar":
        return None
    name = header[:100].split(b"\0", 1)[0]
    prefix = header[345:500].split(b"\0", 1)[0]
    return (prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape") or None


def member_name(fd: int, offset: int) -> Optional[str]:
    """The name in the tar header just before the data at ``offset`` (for messages), or None."""
    try:
        return header_name(os.pread(fd, 512, offset - 512)) if offset >= 512 else None
    except OSError:
        return None
