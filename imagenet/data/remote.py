"""Shard folders behind a URL (``s3://``, ``gs://``, any fsspec protocol): copied once into a
local cache, then read like a local shard folder.

A sample is one small random read; over a network each costs a round trip of 10-50 ms, so
reading samples remotely would need hundreds of requests in flight to feed a GPU. Whole shards
are copied instead, each to a temporary name and renamed, the index last, under
``CACHE/shards/<hash of the URL>``: an interrupted copy continues where it stopped, a later run
on the same URL reads the copy, and a URL whose ``index.json`` changed is copied again.
Processes of one machine share the copy: one copies (holding a lock the system releases if it
dies), the others wait for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path

from ..base.errors import UserError
from .shardindex import CLASSES, INDEX, MAKE_HINT, SPLITS, parse_index, table_name

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


def cache_folder(url: str, cache_dir) -> Path:
    return Path(cache_dir) / "shards" / hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


def local_copy(url: str, cache_dir, progress: bool = True) -> str:
    """A local shard folder with the contents of ``url``, copied once (see the module)."""
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    try:
        text = fs.cat_file(f"{root}/{INDEX}").decode()
    except FileNotFoundError:
        raise UserError(f"{url} has no {INDEX}: it is no shard folder, or its conversion is unfinished; make one "
                        f"with {MAKE_HINT.format(root='OUT')} and copy OUT there") from None
    except Exception as e:  # network, permissions: fsspec's backends raise their own types
        raise UserError(f"cannot read {url}/{INDEX} ({type(e).__name__}: {e})") from None
    target = cache_folder(url, cache_dir)
    index = parse_index(text, str(target), where=f"{url}/{INDEX}")
    try:
        target.mkdir(parents=True, exist_ok=True)
        lock = open(target / ".lock", "w")
    except OSError as e:
        raise UserError(f"cannot make the shard cache {target} ({e.strerror or e}); set --cache-dir to a "
                        "writable local folder") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the system if this process dies
        local_index, pending = target / INDEX, target / f"{INDEX}.copying"
        current = local_index.exists() and local_index.read_text() == text
        if not current and not (pending.exists() and pending.read_text() == text):
            if local_index.exists():
                logger.info("=> %s changed since it was cached: copying it again", url)
            for old in target.iterdir():  # another version's files
                if old.name != ".lock":
                    old.unlink()
            pending.write_text(text)  # what an interrupted copy was copying, so a rerun continues it
        files = [(table_name(s), None) for s in SPLITS] + [(CLASSES, None)]
        files += [(shard["name"], shard["bytes"]) for s in SPLITS for shard in index.splits[s].shards]
        _copy(fs, root, target, files, url, progress)
        if not current:
            os.replace(pending, local_index)  # last: the copy is complete
    return str(target)


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
