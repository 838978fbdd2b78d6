"""Writing tar shards from an image folder: ``scripts/make_shards.py``'s logic.

Every image is read and decoded once (JPEGs at 1/8 scale: the whole entropy stream is still
read, so a truncated or corrupt file fails) in a pool of processes. One that cannot be read
is not packed: it is listed in the report and in ``OUT/bad_files.txt``, and the index counts
it, so a folder run and a shard run of the same data skip the same images. The bytes are
copied as they are, so a shard's sample decodes to the file's pixels.

The training images are shuffled once (``seed``) before packing: every shard is then a
uniform sample of the set, and a batch drawn from a few shards holds as many classes as one
drawn from the whole set. Validation keeps the folder's order. A sample's id is its index in
the split's ImageFolder, which is what a folder run seeds its augmentations with.

Restartable: every shard is written under a temporary name and renamed, then recorded in a
journal (``OUT/.make_shards/``) with its index rows. A rerun of the same conversion continues
after the last recorded shard; a rerun with other settings starts over. The index is written
last, so a folder without ``index.json`` is an unfinished conversion (the trainer says so).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
from PIL import Image

from ..base.errors import UserError
from .folder import SafeImageFolder, check_layout
from .shardindex import CLASSES, FORMAT, INDEX, ROW, SPLITS, VERSION, shard_name, table_name

logger = logging.getLogger(__name__)

JOURNAL = ".make_shards"
BAD_FILES = "bad_files.txt"
BLOCK = 512
_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_WINDOW = 512  # images read ahead by the pool: bounds the memory held to a few hundred images


def parse_size(text: str) -> int:
    """``"1GB"``, ``"500MB"``, ``"256MiB"``, ``"1e9"`` -> bytes; UserError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise UserError(f"--shard-size {text!r} is not a size; write e.g. 1GB, 500MB or 256MiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size < 16 * BLOCK:
        raise UserError(f"--shard-size {text!r} is too small for a tar shard; use at least a few MB")
    return size


@dataclass
class Report:
    """What a conversion did."""

    out: str
    samples: dict = field(default_factory=dict)  # split -> images packed
    shards: dict = field(default_factory=dict)  # split -> shard count
    bad: list = field(default_factory=list)  # (split, path relative to the split, reason)
    continued_from: int = 0  # images already packed by an interrupted run
    finished_before: bool = False  # the folder already held this conversion


def _load(path: str) -> tuple:
    """(bytes, extension, None) for a readable image, (None, None, reason) otherwise."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            if fmt == "JPEG":
                img.draft(img.mode, (max(img.size[0] // 8, 1), max(img.size[1] // 8, 1)))
            img.convert("RGB")  # decodes everything, as training would
    except Exception as e:  # whatever a decoder raises: the file is unreadable
        return None, None, f"{type(e).__name__}: {e}"
    return data, _EXTENSIONS.get(fmt) or os.path.splitext(path)[1][1:].lower() or "img", None


def _loaded(paths: list, pool) -> Iterator[tuple]:
    """:func:`_load` of each path in order; with a pool, the next window is read while this one is written."""
    if pool is None:
        yield from map(_load, paths)
        return
    pending = None
    for first in range(0, len(paths), _WINDOW):
        ahead = pool.map_async(_load, paths[first:first + _WINDOW], chunksize=8)
        if pending is not None:
            yield from pending.get()
        pending = ahead
    if pending is not None:
        yield from pending.get()


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644  # no dates or owners: the same input gives the same bytes
    try:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    except ValueError:  # a name past USTAR's 255 characters
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class _Shard:
    """One tar being written: samples as KEY.EXT + KEY.cls, its index rows as it goes."""

    def __init__(self, path: str):
        self.path = path
        self.fh = open(path + ".tmp", "wb")
        self.bytes = 0
        self.rows: list = []  # [offset, size, label, id]

    @staticmethod
    def cost(key: str, ext: str, data: bytes, label: int) -> tuple:
        """The sample's members as (header, data) pairs and the bytes they take."""
        cls = str(label).encode()
        members = [(_header(f"{key}.{ext}", len(data)), data), (_header(f"{key}.cls", len(cls)), cls)]
        return members, sum(len(h) + _padded(len(d)) for h, d in members)

    def add(self, members: list, size: int, label: int, image_id: int) -> None:
        (header, data), _ = members
        self.rows.append([self.bytes + len(header), len(data), label, image_id])
        for header, data in members:
            self.fh.write(header)
            self.fh.write(data)
            self.fh.write(b"\0" * (_padded(len(data)) - len(data)))
        self.bytes += size

    def close(self) -> int:
        """Finish the archive and give it its name; returns its size."""
        self.fh.write(b"\0" * (2 * BLOCK))  # the end-of-archive marker
        self.fh.close()
        os.replace(self.path + ".tmp", self.path)
        return self.bytes + 2 * BLOCK


def _keys(split_dir: str, samples: list) -> list:
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


class _Journal:
    """``OUT/.make_shards``: the plan of the conversion under way and what it has finished."""

    def __init__(self, out: str):
        self.dir = os.path.join(out, JOURNAL)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name + ".json")

    def read(self, name: str) -> Optional[dict]:
        try:
            with open(self._path(name)) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def write(self, name: str, record: dict) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = self._path(name) + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, self._path(name))


def _ours(name: str) -> bool:
    """Files this tool writes into OUT (the only ones it ever removes)."""
    return (re.fullmatch(r"(train|val)-\d{6}\.tar(\.tmp)?", name) is not None
            or name in {INDEX, CLASSES, BAD_FILES, *(table_name(s) for s in SPLITS)}
            or name.startswith(tuple(f"{x}.tmp" for x in (INDEX, *(table_name(s) for s in SPLITS)))))


def _clear(out: str) -> None:
    for name in os.listdir(out):
        if _ours(name):
            os.unlink(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, JOURNAL), ignore_errors=True)


def _listing(src: str) -> dict:
    """split -> [(path, label)] in ImageFolder order: the order a folder run numbers images in."""
    return {split: SafeImageFolder(os.path.join(src, split)).samples for split in SPLITS}


def _plan(src: str, listing: dict, shard_size: int, seed: int) -> dict:
    digest = hashlib.sha1()
    for split in SPLITS:
        for path, label in listing[split]:
            digest.update(f"{split}\t{label}\t{os.path.relpath(path, src)}\n".encode())
    return {"source": os.path.abspath(src), "seed": seed, "shard_size": shard_size, "listing": digest.hexdigest()}


def _start(out: str, plan: dict, overwrite: bool) -> Optional[dict]:
    """Decide what a run in ``out`` does; returns the finished index when there is nothing to do."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out} ({e.strerror or e}); choose a writable folder") from None
    index_path = os.path.join(out, INDEX)
    if os.path.exists(index_path):
        with open(index_path) as fh:
            try:
                done = json.load(fh)
            except ValueError:
                done = {}
        if done.get("made_by") == plan and not overwrite:
            shutil.rmtree(os.path.join(out, JOURNAL), ignore_errors=True)  # left if the last run stopped right here
            return done
        if not overwrite:
            raise UserError(f"{out} already holds a finished conversion of other images or other settings "
                            f"({done.get('made_by')}); choose another folder, or pass --overwrite to replace it")
        _clear(out)
    journal = _Journal(out)
    previous = journal.read("plan")
    if previous is not None and previous != plan:
        logger.info("%s holds an unfinished conversion of other images or settings: starting over", out)
        _clear(out)
    elif previous is None and any(_ours(n) for n in os.listdir(out)):
        if not overwrite:
            raise UserError(f"{out} holds shard files that no unfinished conversion explains; choose an empty "
                            "folder, or pass --overwrite to replace them")
        _clear(out)
    journal.write("plan", plan)
    return None


def make_shards(src: str, out: str, *, shard_size: int, seed: int = 0, workers: int = 0, progress: bool = True,
                overwrite: bool = False) -> Report:
    """Convert the image folder ``src`` (``train/``, ``val/``) into tar shards in ``out``."""
    from tqdm import tqdm
    classes = check_layout(src)
    listing = _listing(src)
    plan = _plan(src, listing, shard_size, seed)
    report = Report(out)
    done = _start(out, plan, overwrite)
    if done is not None:
        report.finished_before = True
        for split in SPLITS:
            report.samples[split] = done["splits"][split]["samples"]
            report.shards[split] = len(done["splits"][split]["shards"])
        return report
    journal = _Journal(out)
    orders = {"train": np.random.default_rng(seed).permutation(len(listing["train"])),
              "val": np.arange(len(listing["val"]))}
    resume = {split: _resume_point(out, journal, split) for split in SPLITS}
    report.continued_from = sum(r[1] for r in resume.values())
    pool = multiprocessing.get_context().Pool(workers) if workers > 0 else None
    try:
        with tqdm(total=sum(len(v) for v in listing.values()), initial=report.continued_from, unit="img",
                  desc="make_shards", disable=not progress or None) as bar:
            for split in SPLITS:
                _pack(out, journal, os.path.join(src, split), listing[split], orders[split], resume[split],
                      shard_size, pool, bar)
    except OSError as e:
        raise UserError(f"cannot write into {out} ({e.strerror or e}); free space there and rerun: the conversion "
                        "continues where it stopped") from None
    finally:
        if pool is not None:
            pool.terminate()
    return _finish(src, out, journal, classes, plan, listing, report)


def _resume_point(out: str, journal: _Journal, split: str) -> tuple:
    """(next shard number or None when the split is done, images done) of ``split`` from the
    journal; the files of later shards (one being written when the last run stopped) go."""
    done = journal.read(f"{split}-done")
    if done is not None:
        return None, done["positions"]
    number, position = 0, 0
    while (record := journal.read(shard_name(split, number))) is not None:
        number, position = number + 1, record["next"]
    for name in os.listdir(out):
        m = re.fullmatch(rf"{split}-(\d{{6}})\.tar(\.tmp)?", name)
        if m and int(m.group(1)) >= number:
            os.unlink(os.path.join(out, name))
    return number, position


def _pack(out: str, journal: _Journal, split_dir: str, samples: list, order: np.ndarray, resume: tuple,
          shard_size: int, pool, bar) -> None:
    """Write a split's shards from ``resume`` = (shard number, position in ``order``) on."""
    split = os.path.basename(split_dir)
    number, position = resume
    if number is None:
        return
    keys = _keys(split_dir, samples)
    shard, bad = None, []
    paths = [samples[i][0] for i in order[position:]]
    for step, (data, ext, reason) in enumerate(_loaded(paths, pool)):
        image_id = int(order[position + step])
        label = samples[image_id][1]
        bar.update(1)
        if data is None:
            bad.append([os.path.relpath(samples[image_id][0], split_dir), reason])
            continue
        if shard is None:
            shard = _Shard(os.path.join(out, shard_name(split, number)))
        members, size = shard.cost(keys[image_id], ext, data, label)
        if shard.rows and shard.bytes + size + 2 * BLOCK > shard_size:
            _close(journal, split, number, shard, position + step, bad)
            number, bad = number + 1, []
            shard = _Shard(os.path.join(out, shard_name(split, number)))
        shard.add(members, size, label, image_id)
    if shard is not None and shard.rows:
        _close(journal, split, number, shard, len(order), bad)
        bad = []
    journal.write(f"{split}-done", {"bad": bad, "positions": len(order)})


def _close(journal: _Journal, split: str, number: int, shard: _Shard, next_position: int, bad: list) -> None:
    size = shard.close()
    journal.write(shard_name(split, number), {"rows": shard.rows, "bytes": size, "next": next_position, "bad": bad})


def _finish(src: str, out: str, journal: _Journal, classes: list, plan: dict, listing: dict, report: Report) -> Report:
    """The tables, the class list, the bad-file list, then the index: the conversion is complete."""
    splits = {}
    for split in SPLITS:
        rows, shards, number = [], [], 0
        while (record := journal.read(shard_name(split, number))) is not None:
            rows += [(number, *row) for row in record["rows"]]
            shards.append({"name": shard_name(split, number), "bytes": record["bytes"], "samples": len(record["rows"])})
            report.bad += [(split, path, reason) for path, reason in record["bad"]]
            number += 1
        report.bad += [(split, path, reason) for path, reason in journal.read(f"{split}-done")["bad"]]
        if not rows:
            raise UserError(f"no image of {os.path.join(src, split)} could be read ({len(listing[split])} tried); "
                            f"see {os.path.join(out, BAD_FILES)}")
        _atomic(os.path.join(out, table_name(split)), lambda fh, rows=rows: np.save(fh, np.array(rows, dtype=ROW)))
        splits[split] = {"samples": len(rows), "table": table_name(split), "shards": shards,
                         "skipped": sum(1 for s, *_ in report.bad if s == split)}
        report.samples[split], report.shards[split] = len(rows), len(shards)
    _atomic(os.path.join(out, CLASSES), lambda fh: fh.write("".join(f"{c}\n" for c in classes).encode()))
    bad_path = os.path.join(out, BAD_FILES)
    if report.bad:
        _atomic(bad_path, lambda fh: fh.write("".join(f"{s}/{p}\t{r}\n" for s, p, r in report.bad).encode()))
    elif os.path.exists(bad_path):
        os.unlink(bad_path)
    index = {"format": FORMAT, "version": VERSION, "classes": classes, "made_by": plan, "splits": splits}
    _atomic(os.path.join(out, INDEX), lambda fh: fh.write(json.dumps(index, indent=1).encode()))
    shutil.rmtree(journal.dir, ignore_errors=True)
    return report


def _atomic(path: str, write) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        write(fh)
    os.replace(tmp, path)
