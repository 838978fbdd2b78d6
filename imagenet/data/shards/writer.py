"""Writing tar shards from an image folder: ``scripts/make_shards.py``'s logic.

Every image is read and decoded once (JPEGs at 1/8 scale: the whole entropy stream is still
read, so a truncated or corrupt file fails) in a pool of processes. One that cannot be read
is not packed: it is listed in the report and in ``OUT/bad_files.txt``, and the index lists it
(``left_out``: its path, id, label and the shard it would have gone into), so a shard run
skips and counts the images a folder run of the same data does, at the same places. The bytes
are copied as they are (:mod:`.tarwrite`), so a shard's sample decodes to the file's pixels.
The index also counts the images per format (``--decode auto`` asks whether they are JPEGs).

The training images are shuffled once (``seed``) before packing: every shard is then a
uniform sample of the set, and a batch drawn from a few shards holds as many classes as one
drawn from the whole set. Validation keeps the folder's order. A sample's id is its index in
the split's ImageFolder, which is what a folder run seeds its augmentations with.

Restartable (:mod:`.journal`): every shard is written under a temporary name and renamed, then
recorded in the journal with its index rows; a rerun continues after the last recorded shard, or
from the first one whose files changed. The index is written last, so a folder without
``index.json`` is an unfinished conversion (the trainer says so). A rebuild never changes a file
that a finished index names, since a running job may read it: it is the index's next generation
(:mod:`.index`), whose shards and tables get names of their own, and the finished index stays
until the new one replaces it by a rename; then the files of earlier generations that no run
reads go (:mod:`.files`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from PIL import Image

from ...base.errors import UserError
from ..images.folder import check_layout
from .dataset import SampleBytes
from .files import BAD_FILES, atomic, read_json, record_generation, tidy
from .index import CLASSES, FORMAT, INDEX, ROW, SPLITS, VERSION, shard_name, table_name
from .journal import Journal, SourceSplit, list_splits, plan_of, resume_point, start
from .tarwrite import BLOCK, TarShard, sample_keys

logger = logging.getLogger(__name__)

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


@dataclass
class _Writer:
    """Where and how a conversion writes: its folder, journal, largest shard, reading pool, progress
    bar, and the generation of the index it writes (which names its new shards)."""

    out: str
    journal: Journal
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
    splits = list_splits(src, seed)
    plan = plan_of(src, splits, shard_size, seed)
    report = Report(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out} ({e.strerror or e}); choose a writable folder") from None
    pool = None
    try:  # a full disk or a failed write anywhere below: one line, and a rerun continues
        done = start(out, plan, splits, overwrite)
        if done is not None:
            report.finished_before, report.note = True, done.get("note", "")
            for split in SPLITS:
                report.samples[split] = done["splits"][split]["samples"]
                report.shards[split] = len(done["splits"][split]["shards"])
            report.generation = int(done.get("generation", 0))
            try:
                report.removed, report.in_use = tidy(out, prune)
            except OSError as e:  # a folder this user may read, not write: nothing to do is still nothing
                logger.warning("could not remove the files of older versions of the index in %s (%s)", out,
                               e.strerror or e)
            return report
        journal = Journal(out)
        report.changed_source = journal.read("reopened") is not None
        resume = {split: resume_point(out, journal, splits[split]) for split in SPLITS}
        report.continued_from = sum(r[1] for r in resume.values())
        pool = multiprocessing.get_context().Pool(workers, initializer=_pool_worker) if workers > 0 else None
        with tqdm(total=sum(len(s.samples) for s in splits.values()), initial=report.continued_from, unit="img",
                  desc="make_shards", disable=not progress or None) as bar:
            writer = _Writer(out, journal, shard_size, pool, bar, journal.generation())
            for split in SPLITS:
                _pack(writer, splits[split], resume[split])
        _finish(src, writer, classes, plan, splits, report)
        report.removed, report.in_use = tidy(out, prune)
        return report
    except OSError as e:
        raise UserError(f"cannot write into {out} ({e.strerror or e}); free space there and rerun: the conversion "
                        "continues where it stopped") from None
    finally:
        if pool is not None:
            pool.terminate()


def _pack(writer: _Writer, split: SourceSplit, resume: tuple) -> None:
    """Write a split's shards from ``resume`` = (shard number, position in its order) on."""
    number, position = resume
    if number is None:
        return
    keys = sample_keys(split.dir, split.samples)
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
            shard = TarShard(os.path.join(writer.out, shard_name(split.name, number, writer.generation)))
        members, size = shard.cost(keys[image_id], ext, data, label)
        if shard.rows and shard.bytes + size + 2 * BLOCK > writer.shard_size:
            _close(writer.journal, split, number, shard, (start, position + step), bad)
            number, bad, start = number + 1, [], position + step
            shard = TarShard(os.path.join(writer.out, shard_name(split.name, number, writer.generation)))
        shard.add(members, size, label, image_id)
        shard.formats[ext] = shard.formats.get(ext, 0) + 1
    if shard is not None and shard.rows:
        _close(writer.journal, split, number, shard, (start, len(split.order)), bad)
        bad = []
    writer.journal.write(f"{split.name}-done", {"bad": bad, "positions": len(split.order)})


def _close(journal: Journal, split: SourceSplit, number: int, shard: TarShard, positions: tuple, bad: list) -> None:
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
        atomic(os.path.join(out, table), lambda fh, rows=rows: np.save(fh, np.array(rows, dtype=ROW)))
        entries[split] = {"samples": len(rows), "table": table, "shards": shards, "formats": formats,
                          "skipped": len(left_out),
                          "left_out": [{"name": path, "id": image_id, "label": label, "shard": shard, "reason": reason}
                                       for shard, path, reason, image_id, label in left_out]}
        report.samples[split], report.shards[split] = len(rows), len(shards)
    atomic(os.path.join(out, CLASSES), lambda fh: fh.write("".join(f"{c}\n" for c in classes).encode()))
    bad_path = os.path.join(out, BAD_FILES)
    if report.bad:
        atomic(bad_path, lambda fh: fh.write("".join(f"{s}/{p}\t{r}\n" for s, p, r in report.bad).encode()))
    elif os.path.exists(bad_path):
        os.unlink(bad_path)
    index = {"format": FORMAT, "version": VERSION, "generation": generation, "classes": classes, "made_by": plan,
             "source": os.path.realpath(src), "splits": entries}
    outgoing = read_json(os.path.join(out, INDEX))
    if outgoing:  # one written before the records: what it names must be known once it is replaced
        record_generation(out, outgoing)
    record_generation(out, index)
    atomic(os.path.join(out, INDEX), lambda fh: fh.write(json.dumps(index, indent=1).encode()))
    shutil.rmtree(journal.dir, ignore_errors=True)
    report.generation = generation
