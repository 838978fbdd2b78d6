"""What a conversion has done, so that a rerun continues it: the plan a conversion is recognised
by (its settings and the source's listing), the journal of its finished shards
(``OUT/.make_shards/``), the decision a run starts with (nothing to do; continue an interrupted
conversion; rebuild from the first shard whose files changed, as the index's next generation;
start over), and where each split resumes.

The plan holds each file's path relative to the source folder and its label, so the same folder
reached through another path or a symlink is the same conversion. Each shard records a digest of
the size and modification time of the files it covers (and of the next one, whose size decided
where the shard ended): a rerun after files changed rewrites the shards from the first one whose
files changed on, and keeps those before it, which are then byte for byte what a fresh
conversion writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...base.errors import UserError
from ..images.folder import SafeImageFolder
from .files import JOURNAL, SHARD_FILE, clear, ours
from .index import INDEX, SPLITS, shard_name, table_name

logger = logging.getLogger(__name__)


class Journal:
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


@dataclass
class SourceSplit:
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


def stat_of(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1  # unreadable; _load says why
    return st.st_size, st.st_mtime_ns


def list_splits(src: str, seed: int) -> dict:
    """split -> :class:`SourceSplit`; the training images shuffled once (``seed``), validation in order."""
    splits = {}
    for split in SPLITS:
        samples = SafeImageFolder(os.path.join(src, split)).samples
        order = (np.random.default_rng(seed).permutation(len(samples)) if split == "train"
                 else np.arange(len(samples)))
        splits[split] = SourceSplit(split, os.path.join(src, split), samples, [stat_of(p) for p, _ in samples], order)
    return splits


def plan_of(src: str, splits: dict, shard_size: int, seed: int) -> dict:
    """What names a conversion: the settings and the listing, paths relative to ``src`` (the
    files' sizes and times are checked shard by shard: :meth:`SourceSplit.sources`)."""
    digest = hashlib.sha1()
    for split in SPLITS:
        for path, label in splits[split].samples:
            digest.update(f"{split}\t{label}\t{os.path.relpath(path, src)}\n".encode())
    return {"seed": seed, "shard_size": shard_size, "listing": digest.hexdigest()}


def start(out: str, plan: dict, splits: dict, overwrite: bool) -> Optional[dict]:
    """Decide what a run in ``out`` does; returns the finished index when there is nothing to do.
    A finished conversion of this plan whose source files changed becomes the journal of the
    index's next generation, which continues after its last unchanged shard; ``overwrite`` starts
    the next generation afresh. Either way the finished index stays, read by whoever reads it,
    until the writer's last step (:mod:`.writer`) replaces it. Without an index no run reads the
    folder's files."""
    journal = Journal(out)
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
            if all(first_changed(splits[split], shards[split]) == len(shards[split]) for split in SPLITS):
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
        clear(out)
    elif previous is None and any(ours(n) for n in os.listdir(out)):
        if not overwrite:
            raise UserError(f"{out} holds shard files that no unfinished conversion explains; choose an empty "
                            "folder, or pass --overwrite to replace them")
        clear(out)
    if previous != plan:
        _begin(journal, plan, 0)
    return None


def _continues(journal: Journal, plan: dict, generation: int, reopened: bool) -> bool:
    """Whether the journal is an interrupted conversion into ``generation`` of this plan, of the
    same kind (a rebuild after changed files, or one from scratch)."""
    return (journal.read("plan") == plan and journal.generation() == generation
            and (journal.read("reopened") is not None) == reopened)


def _begin(journal: Journal, plan: dict, generation: int) -> None:
    """A journal for a conversion from scratch into ``generation`` of the index."""
    shutil.rmtree(journal.dir, ignore_errors=True)
    journal.write("plan", plan)
    journal.write("generation", {"generation": generation})


def first_changed(split: SourceSplit, records: list) -> int:
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
    (by their names) and continues after the ones whose files did not change (:func:`resume_point`).
    The index stays: runs read it until the new generation's replaces it."""
    journal = Journal(out)
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


def resume_point(out: str, journal: Journal, split: SourceSplit) -> tuple:
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
    number = first_changed(split, records)
    for stale in range(number, len(records)):
        journal.remove(shard_name(split.name, stale))
    generation = journal.generation()
    for name in os.listdir(out):
        m = SHARD_FILE.fullmatch(name)
        if m and m.group(1) == split.name and int(m.group(2)) >= number and int(m.group(3) or 0) == generation:
            os.unlink(os.path.join(out, name))
    return number, records[number - 1]["next"] if number else 0
