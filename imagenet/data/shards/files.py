"""A shard folder's files: which of them this tool writes (the only ones it ever removes), the
record of the files each generation of the index names, and their removal once no run reads them
(:func:`tidy`); every file written through a temporary one and a rename (:func:`atomic`).

A run leases the generation it reads (:func:`.index.hold`), and the previous generation's files
stay in any case, for a job that read it where locks do not reach (another machine on a file
system without them); ``prune`` removes those too, when no run holds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Optional

from .index import CLASSES, GENERATIONS, INDEX, SPLITS, record_path, table_name
from .lease import remove_unread

JOURNAL = ".make_shards"  # the journal of a conversion under way (.journal)
BAD_FILES = "bad_files.txt"
SHARD_FILE = re.compile(r"(train|val)-(\d{6})(?:\.g(\d+))?\.tar(\.tmp)?")  # split, number, generation
DATA_FILE = re.compile(r"((train|val)-\d{6}(\.g\d+)?\.tar|(train|val)-index(\.g\d+)?\.npy)(\.tmp)?")


def ours(name: str) -> bool:
    """Files this tool writes into OUT (the only ones it ever removes)."""
    return (DATA_FILE.fullmatch(name) is not None or name in {INDEX, CLASSES, BAD_FILES}
            or name in {f"{x}.tmp" for x in (INDEX, CLASSES, BAD_FILES)})


def clear(out: str) -> None:
    """Remove every file of ours (``out`` holds no index: no run reads any of them)."""
    for name in os.listdir(out):
        if ours(name):
            os.unlink(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, JOURNAL), ignore_errors=True)
    shutil.rmtree(os.path.join(out, GENERATIONS), ignore_errors=True)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def named_files(index: dict) -> set:
    """The files an index (its JSON) names: its tables and shards."""
    return {name for split in SPLITS for name in [index["splits"][split].get("table") or table_name(split)]
            + [shard["name"] for shard in index["splits"][split]["shards"]]}


def record_generation(out: str, index: dict) -> None:
    """The record of the files ``index``'s generation names, which runs reading it lease (once made)."""
    path = record_path(out, int(index.get("generation", 0)))
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        record = {"generation": int(index.get("generation", 0)), "files": sorted(named_files(index))}
        atomic(path, lambda fh: fh.write(json.dumps(record).encode()))


def tidy(out: str, prune: bool) -> tuple:
    """Remove the files of earlier generations of the index that no run reads: of each one whose
    record no run holds (:func:`.lease.remove_unread`), what no generation kept names, then the
    record; and files of ours that no record names (an abandoned conversion's). The current and,
    unless ``prune``, the previous generation stay. Returns (generations removed, generations
    kept because a run reads them or this file system has no locks to tell by)."""
    current = read_json(os.path.join(out, INDEX))
    try:
        named = named_files(current)
    except (KeyError, TypeError):
        return [], []  # an index we cannot read: it keeps everything
    record_generation(out, current)
    now = int(current.get("generation", 0))
    records = {}
    folder = os.path.join(out, GENERATIONS)
    for name in os.listdir(folder):
        m = re.fullmatch(r"(\d+)\.json", name)
        record = read_json(os.path.join(folder, name)) if m else None
        if record is not None:
            records[int(m.group(1))] = set(record.get("files", []))
    earlier = sorted(g for g in records if g < now)
    keep = {now} | ({earlier[-1]} if earlier and not prune else set())
    removed, in_use = [], []
    for g in sorted(set(records) - keep):
        others = set().union(named, *(files for k, files in records.items() if k != g))

        def remove(g=g, others=others):
            for name in records[g] - others:
                if not DATA_FILE.fullmatch(name):
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
        if DATA_FILE.fullmatch(name) and name not in named:
            os.unlink(os.path.join(out, name))
    return removed, in_use


def atomic(path: str, write) -> None:
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
