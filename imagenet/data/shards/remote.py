"""Shard folders behind a URL (``s3://``, ``gs://``, any fsspec protocol): copied once into a
local cache, then read like a local shard folder.

A sample is one small random read; over a network each costs a round trip of 10-50 ms, so
reading samples remotely would need hundreds of requests in flight to feed a GPU. Whole shards
are copied instead, under ``CACHE/shards/<hash of the URL>/<hash of its index.json>``: one
folder per version of the data, each file copied to a temporary name and renamed, the index
last. A file in a version's folder never changes: a job still reading an older version (the
data was rebuilt at the URL while it ran) keeps reading the files it started with, while a new
job copies the new version beside it. An interrupted copy continues where it stopped; a later
run on the same unchanged URL reads the copy.

Processes of one machine share the copies: one copies (holding the URL's lock, which the system
releases if it dies), the others wait for it. A run holds a shared lock on the version it reads
(:class:`CacheLease`, released when it closes its data or dies); a copy, once complete, deletes
the URL's other versions that no run holds, so a cache keeps one version of a URL besides the
ones in use.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

from ...base.errors import UserError
from .index import CLASSES, INDEX, MAKE_HINT, parse_index
from .lease import Lease, remove_unread

logger = logging.getLogger(__name__)

CHUNK = 8 << 20


def is_url(root: str) -> bool:
    """Whether ``root`` names data behind a URL rather than a local path."""
    return "://" in root or root.startswith("pipe:")


def _filesystem(url: str):
    if url.startswith("pipe:"):
        # webdataset's pipe:CMD streams one tar through a command; the trainer needs index.json and
        # random access to every shard, which a pipe cannot give.
        raise UserError(f"{url}: pipe: URLs are not supported (training needs the shards' index and random "
                        "access); copy the shard folder to a local disk, or give its s3:// / gs:// / https:// URL")
    try:
        import fsspec
    except ImportError:
        raise UserError(f"{url} is a URL: reading it needs fsspec and the package for its protocol "
                        f"(pip install fsspec s3fs, or gcsfs for gs://)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec knows the protocol; its package is missing (fsspec names it)
        raise UserError(f"{url}: {e}") from None
    except ValueError as e:
        raise UserError(f"{url}: {e}; give a local shard folder or a URL of a protocol fsspec knows") from None


LOCK = ".lock"  # the URL's: held while copying or choosing a version
READERS = ".readers"  # a version's: runs reading it hold it shared


def cache_folder(url: str, cache_dir) -> Path:
    """The URL's folder of the cache; each version of its data is a folder inside."""
    return Path(cache_dir) / "shards" / hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


def version_name(index_text: str) -> str:
    """A version's folder name: the hash of its ``index.json``, which names every shard's size."""
    return hashlib.sha1(index_text.encode()).hexdigest()[:16]


class CacheLease(Lease):
    """A run's shared lock on the cached version it reads (:class:`.lease.Lease`): while held, no
    copy of a newer version deletes it. ``path``: the version's folder."""

    def __init__(self, version: Path):
        super().__init__(str(version / READERS))
        self.path = str(version)


def local_copy(url: str, cache_dir, progress: bool = True) -> CacheLease:
    """The local copy of ``url``'s shard folder (see the module), copied if this version is not
    cached yet; the lease's ``path`` is the folder, and the version stays while the lease is held."""
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    try:
        text = fs.cat_file(f"{root}/{INDEX}").decode()
    except FileNotFoundError:
        raise UserError(f"{url} has no {INDEX}: it is no shard folder, or its conversion is unfinished; make one "
                        f"with {MAKE_HINT.format(root='OUT')} and copy OUT there") from None
    except Exception as e:  # network, permissions: fsspec's backends raise their own types
        raise UserError(f"cannot read {url}/{INDEX} ({type(e).__name__}: {e})") from None
    folder = cache_folder(url, cache_dir)
    target = folder / version_name(text)
    index = parse_index(text, str(target), where=f"{url}/{INDEX}")
    try:
        target.mkdir(parents=True, exist_ok=True)
        lock = open(folder / LOCK, "w")
    except OSError as e:
        raise UserError(f"cannot make the shard cache {target} ({e.strerror or e}); set --cache-dir to a "
                        "writable local folder") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the system if this process dies
        target.mkdir(exist_ok=True)  # a copy of another version may have just removed it
        local_index = target / INDEX
        complete = local_index.exists() and local_index.read_text() == text
        if not complete and any(p.is_dir() for p in folder.iterdir() if p != target):
            logger.info("=> %s changed since it was cached: copying the new version beside the old", url)
        for stale in target.glob("*.tmp*"):  # an interrupted copy's (no other copy runs: the lock)
            stale.unlink(missing_ok=True)
        files = [(split.table_file, None) for split in index.splits.values()] + [(CLASSES, None)]
        files += [(shard["name"], shard["bytes"]) for split in index.splits.values() for shard in split.shards]
        _copy(fs, root, target, files, url, progress)  # what is missing: all of a new version, a file lost since
        if not complete:
            tmp = target / f"{INDEX}.tmp{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, local_index)  # last: the copy is complete
        lease = CacheLease(target)  # before the URL's lock goes: no other copy can remove it now
        _remove_unused(folder, keep=target)
    return lease


def _remove_unused(folder: Path, keep: Path) -> None:
    """Delete the URL's other versions that no run reads (called holding the URL's lock), and the
    files a copy made before versions had folders of their own."""
    for old in folder.iterdir():
        if old == keep or old.name == LOCK:
            continue
        if not old.is_dir():
            old.unlink(missing_ok=True)
            continue
        try:
            # False: a run still reads it, a later copy removes it; None: no locks here to tell by
            if remove_unread(str(old / READERS), lambda old=old: shutil.rmtree(old, ignore_errors=True)):
                logger.info("=> removed %s from the shard cache: an older version of the data, no run reads it", old)
        except OSError as e:
            logger.warning("=> could not remove the old cached version %s (%s)", old, e.strerror or e)


def _copy(fs, root: str, target: Path, files: list, url: str, progress: bool) -> None:
    """Copy the ``(name, size or None)`` files that ``target`` lacks, or holds at another size."""
    from tqdm import tqdm
    todo = [(name, size) for name, size in files
            if not (target / name).exists() or size not in (None, (target / name).stat().st_size)]
    if not todo:
        return
    total = sum(size or 0 for _, size in todo)
    logger.info("=> copying %d files (%.1f GB) of %s into %s, once", len(todo), total / 1e9, url, target)
    with tqdm(total=total, unit="B", unit_scale=True, desc="shard cache", disable=not progress or None) as bar:
        for name, size in todo:
            tmp = target / f"{name}.tmp{os.getpid()}"
            try:
                with fs.open(f"{root}/{name}", "rb") as src, open(tmp, "wb") as dst:
                    while True:
                        chunk = src.read(CHUNK)
                        if not chunk:
                            break
                        dst.write(chunk)
                        bar.update(len(chunk) if size is not None else 0)
            except FileNotFoundError:
                tmp.unlink(missing_ok=True)
                if name == CLASSES:
                    continue  # for other tools only; older folders may lack it
                raise UserError(f"{url}/{name} is missing, though {INDEX} lists it: copy the whole shard "
                                f"folder there") from None
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise UserError(f"cannot copy {url}/{name} into {target} ({e}); free space there or set "
                                f"--cache-dir to a local folder with room") from None
            os.replace(tmp, target / name)
