"""Writing tar shards from an image folder: ``scripts/make_shards.py``'s logic.

Every image is read and decoded once (JPEGs at 1/8 scale: the whole entropy stream is still
read, so a truncated or corrupt file fails) in a pool of processes. One that cannot be read
is not packed: it is listed in the report and in ``OUT/bad_files.txt``, and the index lists it
(``left_out``: its path, id, label and the shard it would have gone into), so a shard run
skips and counts the images a folder run of the same data does, at the same places. The bytes
are copied as they are, so a shard's sample decodes to the file's pixels. The index also
counts the images per format (``--decode auto`` asks whether they are JPEGs).

The training images are shuffled once (``seed``) before packing: every shard is then a
uniform sample of the set, and a batch drawn from a few shards holds as many classes as one
drawn from the whole set. Validation keeps the folder's order. A sample's id is its index in
the split's ImageFolder, which is what a folder run seeds its augmentations with.

Restartable: every shard is written under a temporary name and renamed, then recorded in a
journal (``OUT/.make_shards/``) with its index rows. A rerun of the same conversion continues
after the last recorded shard; a rerun with other settings starts over. The index is written
last, so a folder without ``index.json`` is an unfinished conversion (the trainer says so).

The plan a conversion is recognised by holds the settings and the source's listing (each
file's path relative to the source folder and its label), so the same folder reached through
another path or a symlink is the same conversion. Each shard records a digest of the size and
modification time of the files it covers (and of the next one, whose size decided where the
shard ended): a rerun after files changed (a bad file repaired, an image replaced) rewrites
the shards from the first one whose files changed on, and keeps those before it, which are
then byte for byte what a fresh conversion writes.

A rebuild never changes a file that a finished index names, since a running job may read it (a
job opens shards long after it read the index). It is the index's next generation
(:mod:`.index`): the shards it rewrites and its tables get names of their own, the finished
index stays in place, read, until the new one replaces it by a rename, and ``--overwrite``
builds the next generation afresh beside the one in use. Then the files of earlier generations
that no run reads go (:func:`_tidy`, also on a run with nothing to do): a run leases the
generation it reads (:func:`.index.hold`), and the previous generation's files stay in any case,
for a job that read it where locks do not reach (another machine on a file system without them);
``prune`` removes those too, when no run holds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tarfile
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
from PIL import Image

from ...base.errors import UserError
from ..images.folder import SafeImageFolder, check_layout
from .dataset import SampleBytes
from .index import (CLASSES, FORMAT, GENERATIONS, INDEX, ROW, SPLITS, VERSION, record_path, shard_name,
                    table_name)
from .lease import remove_unread

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
    continued_from: int = 0  # images already packed by an interrupted run, or kept from a changed source's
    finished_before: bool = False  # the folder already held this conversion
    changed_source: bool = False  # source files changed since the folder's conversion: its later shards rewritten
    note: str = ""  # what the user should know about a finished conversion left as it was
    generation: int = 0  # of the index the folder holds now (0: its first conversion)
    removed: list = field(default_factory=list)  # earlier generations whose files went: no run read them
    in_use: list = field(default_factory=list)  # earlier generations kept: a run reads them, or no lock can tell


def _load(path: str) -> tuple:
    """(bytes, extension, None) for a readable image, (None, None, reason) otherwise."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        with Image.open(SampleBytes(data, os.path.basename(path))) as img:  # PIL's messages name the file
            fmt = img.format
            if fmt == "JPEG":
                img.draft(img.mode, (max(img.size[0] // 8, 1), max(img.size[1] // 8, 1)))
            img.convert("RGB")  # decodes everything, as training would
    except Exception as e:  # whatever a decoder raises: the file is unreadable
        return None, None, f"{type(e).__name__}: {e}"
    return data, _EXTENSIONS.get(fmt) or os.path.splitext(path)[1][1:].lower() or "img", None


def _pool_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process answers it


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
        self.formats: dict = {}  # extension -> images

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

    def remove(self, name: str) -> None:
        os.unlink(self._path(name))

    def generation(self) -> int:
        """The generation of the index this conversion writes (0 in a journal from before they were counted)."""
        return int((self.read("generation") or {}).get("generation", 0))

    def write(self, name: str, record: dict) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = self._path(name) + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, self._path(name))


_SHARD_FILE = re.compile(r"(train|val)-(\d{6})(?:\.g(\d+))?\.tar(\.tmp)?")  # split, number, generation
_DATA_FILE = re.compile(r"((train|val)-\d{6}(\.g\d+)?\.tar|(train|val)-index(\.g\d+)?\.npy)(\.tmp)?")


def _ours(name: str) -> bool:
    """Files this tool writes into OUT (the only ones it ever removes)."""
    return (_DATA_FILE.fullmatch(name) is not None or name in {INDEX, CLASSES, BAD_FILES}
            or name in {f"{x}.tmp" for x in (INDEX, CLASSES, BAD_FILES)})


def _clear(out: str) -> None:
    """Remove every file of ours (``out`` holds no index: no run reads any of them)."""
    for name in os.listdir(out):
        if _ours(name):
            os.unlink(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, JOURNAL), ignore_errors=True)
    shutil.rmtree(os.path.join(out, GENERATIONS), ignore_errors=True)


@dataclass
class _Split:
    """One split of the source as the conversion packs it: its files in ImageFolder order (the
    order a folder run numbers them in: an image's id), their (size, mtime) and the packing order."""

    name: str  # train | val
    dir: str
    samples: list  # [(path, label)]
    stats: list  # [(size, modification time in ns)] per sample; (-1, -1) for a file gone since the listing
    order: np.ndarray  # position -> image id

    def sources(self, first: int, end: int) -> str:
        """The digest a shard holding positions ``first`` to ``end - 1`` records: their files'
        names, sizes and times, and the next position's, whose size decided where the shard ended."""
        digest = hashlib.sha1()
        for image_id in self.order[first:end + 1].tolist():
            size, mtime = self.stats[image_id]
            digest.update(f"{os.path.relpath(self.samples[image_id][0], self.dir)}\t{size}\t{mtime}\n".encode())
        return digest.hexdigest()


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1  # unreadable; _load says why
    return st.st_size, st.st_mtime_ns


def _splits(src: str, seed: int) -> dict:
    """split -> :class:`_Split`; the training images shuffled once (``seed``), validation in order."""
    splits = {}
    for split in SPLITS:
        samples = SafeImageFolder(os.path.join(src, split)).samples
        order = (np.random.default_rng(seed).permutation(len(samples)) if split == "train"
                 else np.arange(len(samples)))
        splits[split] = _Split(split, os.path.join(src, split), samples, [_stat(p) for p, _ in samples], order)
    return splits


def _plan(src: str, splits: dict, shard_size: int, seed: int) -> dict:
    """What names a conversion: the settings and the listing, paths relative to ``src`` (the
    files' sizes and times are checked shard by shard: :meth:`_Split.sources`)."""
    digest = hashlib.sha1()
    for split in SPLITS:
        for path, label in splits[split].samples:
            digest.update(f"{split}\t{label}\t{os.path.relpath(path, src)}\n".encode())
    return {"seed": seed, "shard_size": shard_size, "listing": digest.hexdigest()}


def _start(out: str, plan: dict, splits: dict, overwrite: bool) -> Optional[dict]:
    """Decide what a run in ``out`` does; returns the finished index when there is nothing to do.
    A finished conversion of this plan whose source files changed becomes the journal of the
    index's next generation, which continues after its last unchanged shard; ``overwrite`` starts
    the next generation afresh. Either way the finished index stays, read by whoever reads it,
    until :func:`_finish` replaces it. Without an index no run reads the folder's files."""
    journal = _Journal(out)
    index_path = os.path.join(out, INDEX)
    if os.path.exists(index_path):
        with open(index_path) as fh:
            try:
                done = json.load(fh)
            except ValueError:
                done = {}
        made_by = done.get("made_by") or {}
        following = int(done.get("generation", 0)) + 1
        if made_by == plan and not overwrite:
            shards = {split: done["splits"][split]["shards"] for split in SPLITS}
            if all(_first_changed(splits[split], shards[split]) == len(shards[split]) for split in SPLITS):
                shutil.rmtree(journal.dir, ignore_errors=True)  # left if the last run stopped right here
                return done
            if not _continues(journal, plan, following, reopened=True):  # else an interrupted rebuild goes on
                _reopen(out, done, following)
            return None
        if {k: v for k, v in made_by.items() if k != "source"} == plan and not overwrite:
            # an earlier make_shards's: it recorded no sizes or times, so changes cannot be told
            done["note"] = ("it was made by an earlier make_shards, which did not record the files' sizes and "
                            "times, so changed files cannot be told: pass --overwrite to convert again")
            return done
        if not overwrite:
            raise UserError(f"{out} already holds a finished conversion of other images or other settings "
                            f"({made_by}); choose another folder, or pass --overwrite to replace it")
        if not _continues(journal, plan, following, reopened=False):
            _begin(journal, plan, following)
        return None
    previous = journal.read("plan")
    if previous is not None and previous != plan:
        logger.info("%s holds an unfinished conversion of other images or settings: starting over", out)
        _clear(out)
    elif previous is None and any(_ours(n) for n in os.listdir(out)):
        if not overwrite:
            raise UserError(f"{out} holds shard files that no unfinished conversion explains; choose an empty "
                            "folder, or pass --overwrite to replace them")
        _clear(out)
    if previous != plan:
        _begin(journal, plan, 0)
    return None


def _continues(journal: _Journal, plan: dict, generation: int, reopened: bool) -> bool:
    """Whether the journal is an interrupted conversion into ``generation`` of this plan, of the
    same kind (a rebuild after changed files, or one from scratch)."""
    return (journal.read("plan") == plan and journal.generation() == generation
            and (journal.read("reopened") is not None) == reopened)


def _begin(journal: _Journal, plan: dict, generation: int) -> None:
    """A journal for a conversion from scratch into ``generation`` of the index."""
    shutil.rmtree(journal.dir, ignore_errors=True)
    journal.write("plan", plan)
    journal.write("generation", {"generation": generation})


def _first_changed(split: _Split, records: list) -> int:
    """The number of the first shard record (journal or index) whose files changed since it was
    written (``len(records)`` when none did)."""
    first = 0
    for number, record in enumerate(records):
        if record.get("sources") != split.sources(first, record.get("next", -1)):
            return number
        first = record["next"]
    return len(records)


def _reopen(out: str, done: dict, generation: int) -> None:
    """Turn the finished index ``done`` into the journal of ``generation``, which holds its shards
    (by their names) and continues after the ones whose files did not change (:func:`_resume_point`).
    The index stays: runs read it until the new generation's replaces it."""
    journal = _Journal(out)
    _begin(journal, done["made_by"], generation)
    for split in SPLITS:
        entry = done["splits"][split]
        table = np.load(os.path.join(out, entry.get("table") or table_name(split)))
        left_out = entry.get("left_out", [])
        for number, shard in enumerate(entry["shards"]):
            rows = table[table["shard"] == number]
            journal.write(shard_name(split, number), {
                "rows": [list(r) for r in zip(rows["offset"].tolist(), rows["size"].tolist(), rows["label"].tolist(),
                                              rows["id"].tolist())],
                "name": shard["name"], "bytes": shard["bytes"], "next": shard["next"], "sources": shard["sources"],
                "formats": shard.get("formats", {}),
                "bad": [[b["name"], b["reason"], b["id"], b["label"]] for b in left_out if b["shard"] == number]})
    journal.write("reopened", {})  # the source changed, no run was interrupted (for the report)


@dataclass
class _Writer:
    """Where and how a conversion writes: its folder, journal, largest shard, reading pool, progress
    bar, and the generation of the index it writes (which names its new shards)."""

    out: str
    journal: _Journal
    shard_size: int
    pool: object
    bar: object
    generation: int = 0


def make_shards(src: str, out: str, *, shard_size: int, seed: int = 0, workers: int = 0, progress: bool = True,
                overwrite: bool = False, prune: bool = False) -> Report:
    """Convert the image folder ``src`` (``train/``, ``val/``) into tar shards in ``out``; then
    remove the files of earlier generations of its index that no run reads (the previous
    generation's only with ``prune``)."""
    from tqdm import tqdm
    classes = check_layout(src)
    splits = _splits(src, seed)
    plan = _plan(src, splits, shard_size, seed)
    report = Report(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out} ({e.strerror or e}); choose a writable folder") from None
    pool = None
    try:  # a full disk or a failed write anywhere below: one line, and a rerun continues
        done = _start(out, plan, splits, overwrite)
        if done is not None:
            report.finished_before, report.note = True, done.get("note", "")
            for split in SPLITS:
                report.samples[split] = done["splits"][split]["samples"]
                report.shards[split] = len(done["splits"][split]["shards"])
            report.generation = int(done.get("generation", 0))
            try:
                report.removed, report.in_use = _tidy(out, prune)
            except OSError as e:  # a folder this user may read, not write: nothing to do is still nothing
                logger.warning("could not remove the files of older versions of the index in %s (%s)", out,
                               e.strerror or e)
            return report
        journal = _Journal(out)
        report.changed_source = journal.read("reopened") is not None
        resume = {split: _resume_point(out, journal, splits[split]) for split in SPLITS}
        report.continued_from = sum(r[1] for r in resume.values())
        pool = multiprocessing.get_context().Pool(workers, initializer=_pool_worker) if workers > 0 else None
        with tqdm(total=sum(len(s.samples) for s in splits.values()), initial=report.continued_from, unit="img",
                  desc="make_shards", disable=not progress or None) as bar:
            writer = _Writer(out, journal, shard_size, pool, bar, journal.generation())
            for split in SPLITS:
                _pack(writer, splits[split], resume[split])
        _finish(src, writer, classes, plan, splits, report)
        report.removed, report.in_use = _tidy(out, prune)
        return report
    except OSError as e:
        raise UserError(f"cannot write into {out} ({e.strerror or e}); free space there and rerun: the conversion "
                        "continues where it stopped") from None
    finally:
        if pool is not None:
            pool.terminate()


def _resume_point(out: str, journal: _Journal, split: _Split) -> tuple:
    """(next shard number or None when the split is done, images done) of ``split`` from the
    journal, up to the first shard whose files changed since; the files this generation wrote for
    later shards (one being written when the last run stopped, ones to rewrite) go. No index
    names them; the files of earlier generations stay."""
    done = journal.read(f"{split.name}-done")
    if done is not None:
        return None, done["positions"]
    records = []
    while (record := journal.read(shard_name(split.name, len(records)))) is not None:
        records.append(record)
    number = _first_changed(split, records)
    for stale in range(number, len(records)):
        journal.remove(shard_name(split.name, stale))
    generation = journal.generation()
    for name in os.listdir(out):
        m = _SHARD_FILE.fullmatch(name)
        if m and m.group(1) == split.name and int(m.group(2)) >= number and int(m.group(3) or 0) == generation:
            os.unlink(os.path.join(out, name))
    return number, records[number - 1]["next"] if number else 0


def _pack(writer: _Writer, split: _Split, resume: tuple) -> None:
    """Write a split's shards from ``resume`` = (shard number, position in its order) on."""
    number, position = resume
    if number is None:
        return
    keys = _keys(split.dir, split.samples)
    shard, bad, start = None, [], position
    paths = [split.samples[i][0] for i in split.order[position:]]
    for step, (data, ext, reason) in enumerate(_loaded(paths, writer.pool)):
        image_id = int(split.order[position + step])
        label = split.samples[image_id][1]
        writer.bar.update(1)
        if data is None:
            bad.append([os.path.relpath(split.samples[image_id][0], split.dir), reason, image_id, label])
            continue
        if shard is None:
            shard = _Shard(os.path.join(writer.out, shard_name(split.name, number, writer.generation)))
        members, size = shard.cost(keys[image_id], ext, data, label)
        if shard.rows and shard.bytes + size + 2 * BLOCK > writer.shard_size:
            _close(writer.journal, split, number, shard, (start, position + step), bad)
            number, bad, start = number + 1, [], position + step
            shard = _Shard(os.path.join(writer.out, shard_name(split.name, number, writer.generation)))
        shard.add(members, size, label, image_id)
        shard.formats[ext] = shard.formats.get(ext, 0) + 1
    if shard is not None and shard.rows:
        _close(writer.journal, split, number, shard, (start, len(split.order)), bad)
        bad = []
    writer.journal.write(f"{split.name}-done", {"bad": bad, "positions": len(split.order)})


def _close(journal: _Journal, split: _Split, number: int, shard: _Shard, positions: tuple, bad: list) -> None:
    """Finish shard ``number``, which holds ``positions`` = (first, end) of the split's order, and record it."""
    size = shard.close()
    journal.write(shard_name(split.name, number), {
        "name": os.path.basename(shard.path), "rows": shard.rows, "bytes": size, "next": positions[1], "bad": bad,
        "formats": shard.formats, "sources": split.sources(*positions)})


def _finish(src: str, writer: _Writer, classes: list, plan: dict, splits: dict, report: Report) -> None:
    """The tables, the class list, the bad-file list, the generation's record, then the index,
    replaced by a rename: the conversion is complete."""
    out, journal, generation = writer.out, writer.journal, writer.generation
    entries = {}
    for split in SPLITS:
        rows, shards, left_out, formats, number, first = [], [], [], {}, 0, 0
        while (record := journal.read(shard_name(split, number))) is not None:
            first = shards[-1]["next"] if shards else 0
            rows += [(number, *row) for row in record["rows"]]
            name = record.get("name") or shard_name(split, number, generation)  # a journal's from before names varied
            shards.append({"name": name, "bytes": record["bytes"], "samples": len(record["rows"]),
                           "next": record["next"], "sources": record["sources"], "formats": record["formats"]})
            left_out += [(number, *b) for b in record["bad"]]
            for ext, n in record["formats"].items():
                formats[ext] = formats.get(ext, 0) + n
            number += 1
        trailing = journal.read(f"{split}-done")["bad"]  # after the last shard (a rerun found only bad files)
        if trailing and shards:  # the last shard's, as a run that never stopped records them
            end = len(splits[split].order)
            shards[-1].update(next=end, sources=splits[split].sources(first, end))
        left_out += [(max(number - 1, 0), *b) for b in trailing]
        report.bad += [(split, path, reason) for _, path, reason, *_ in left_out]
        if not rows:
            raise UserError(f"no image of {os.path.join(src, split)} could be read ({len(splits[split].samples)} "
                            f"tried); see {os.path.join(out, BAD_FILES)}")
        table = table_name(split, generation)
        _atomic(os.path.join(out, table), lambda fh, rows=rows: np.save(fh, np.array(rows, dtype=ROW)))
        entries[split] = {"samples": len(rows), "table": table, "shards": shards, "formats": formats,
                          "skipped": len(left_out),
                          "left_out": [{"name": path, "id": image_id, "label": label, "shard": shard, "reason": reason}
                                       for shard, path, reason, image_id, label in left_out]}
        report.samples[split], report.shards[split] = len(rows), len(shards)
    _atomic(os.path.join(out, CLASSES), lambda fh: fh.write("".join(f"{c}\n" for c in classes).encode()))
    bad_path = os.path.join(out, BAD_FILES)
    if report.bad:
        _atomic(bad_path, lambda fh: fh.write("".join(f"{s}/{p}\t{r}\n" for s, p, r in report.bad).encode()))
    elif os.path.exists(bad_path):
        os.unlink(bad_path)
    index = {"format": FORMAT, "version": VERSION, "generation": generation, "classes": classes, "made_by": plan,
             "source": os.path.realpath(src), "splits": entries}
    outgoing = _read_json(os.path.join(out, INDEX))
    if outgoing:  # one written before the records: what it names must be known once it is replaced
        _record(out, outgoing)
    _record(out, index)
    _atomic(os.path.join(out, INDEX), lambda fh: fh.write(json.dumps(index, indent=1).encode()))
    shutil.rmtree(journal.dir, ignore_errors=True)
    report.generation = generation


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _named(index: dict) -> set:
    """The files an index (its JSON) names: its tables and shards."""
    return {name for split in SPLITS for name in [index["splits"][split].get("table") or table_name(split)]
            + [shard["name"] for shard in index["splits"][split]["shards"]]}


def _record(out: str, index: dict) -> None:
    """The record of the files ``index``'s generation names, which runs reading it lease (once made)."""
    path = record_path(out, int(index.get("generation", 0)))
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        record = {"generation": int(index.get("generation", 0)), "files": sorted(_named(index))}
        _atomic(path, lambda fh: fh.write(json.dumps(record).encode()))


def _tidy(out: str, prune: bool) -> tuple:
    """Remove the files of earlier generations of the index that no run reads: of each one whose
    record no run holds (:func:`.lease.remove_unread`), what no generation kept names, then the
    record; and files of ours that no record names (an abandoned conversion's). The current and,
    unless ``prune``, the previous generation stay. Returns (generations removed, generations
    kept because a run reads them or this file system has no locks to tell by)."""
    current = _read_json(os.path.join(out, INDEX))
    try:
        named = _named(current)
    except (KeyError, TypeError):
        return [], []  # an index we cannot read: it keeps everything
    _record(out, current)
    now = int(current.get("generation", 0))
    records = {}
    folder = os.path.join(out, GENERATIONS)
    for name in os.listdir(folder):
        m = re.fullmatch(r"(\d+)\.json", name)
        record = _read_json(os.path.join(folder, name)) if m else None
        if record is not None:
            records[int(m.group(1))] = set(record.get("files", []))
    earlier = sorted(g for g in records if g < now)
    keep = {now} | ({earlier[-1]} if earlier and not prune else set())
    removed, in_use = [], []
    for g in sorted(set(records) - keep):
        others = set().union(named, *(files for k, files in records.items() if k != g))

        def remove(g=g, others=others):
            for name in records[g] - others:
                if not _DATA_FILE.fullmatch(name):
                    continue  # a record names only shards and tables; anything else is not ours to remove
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(out, name))
            os.unlink(record_path(out, g))
        unread = remove_unread(record_path(out, g), remove)
        if unread is None and prune:  # no locks here: the user said no run reads it
            remove()
            unread = True
        if unread:
            del records[g]
            removed.append(g)
        else:
            in_use.append(g)
    named = named.union(*records.values())
    for name in os.listdir(out):
        if _DATA_FILE.fullmatch(name) and name not in named:
            os.unlink(os.path.join(out, name))
    return removed, in_use


def _atomic(path: str, write) -> None:
    """Write ``path`` through a temporary file and a rename; on a failure (a full disk) the
    temporary goes and ``path`` is as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            write(fh)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
