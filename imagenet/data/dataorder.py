"""What decides which images a training epoch's batches hold, as a fingerprint a checkpoint keeps.

A mid-epoch checkpoint says "step k of epoch e": the images of the epoch's first k global batches
are done. That is true on resume only if the order is the same: the same training images in the
same dataset order (an image folder's file list, a shard folder's index) and the same sampler
settings (:meth:`imagenet.data.samplers.SeededSampler.order_settings`). :func:`fingerprint`
records them; :func:`changes` says in words what differs between two fingerprints.

A folder's file list is taken relative to its ``train/`` folder, and a shard folder's index by its
content, so the same data copied elsewhere (local disk, a URL's cache) is the same data.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import numpy as np

from .images.folder import SafeImageFolder
from .shards.dataset import ShardDataset

FOLDER, SHARDS = "image folder", "tar shards"


def fingerprint(dataset, sampler) -> Optional[dict]:
    """``{"source", "images", "digest", **sampler.order_settings()}`` for a training set read in
    ``sampler``'s order; None for data without files (``--dummy``). Hashes the file list (0.4 s
    for ImageNet's 1.28 M paths) or the shard index's table (0.08 s)."""
    if isinstance(dataset, SafeImageFolder):
        prefix = os.path.join(dataset.root, "")
        names = "\n".join(p[len(prefix):] if p.startswith(prefix) else p for p, _ in dataset.samples)
        source, digest = FOLDER, hashlib.blake2b(names.encode("utf-8", "surrogateescape"), digest_size=16)
    elif isinstance(dataset, ShardDataset):
        table = np.ascontiguousarray(dataset.table)
        source, digest = SHARDS, hashlib.blake2b(table.view(np.uint8), digest_size=16)
    else:
        return None
    return {"source": source, "images": len(dataset), "digest": digest.hexdigest(), **sampler.order_settings()}


def changes(saved: dict, now: dict) -> list:
    """What differs between the fingerprints ``saved`` (a checkpoint's) and ``now``, one phrase
    each; empty when the order is the same."""
    found = []
    if saved.get("source") != now.get("source"):
        found.append(f"the training data was {saved.get('source')}, now {now.get('source')}")
    elif saved.get("digest") != now.get("digest"):
        what = "the training folder's file list" if now["source"] == FOLDER else "the shard index (make_shards re-run?)"
        found.append(f"{what} changed: {saved.get('images')} images then, {now['images']} now")
    if saved.get("seed") != now.get("seed"):
        found.append(f"--seed {saved.get('seed')} then, {now.get('seed')} now")
    if saved.get("source") == now.get("source") == SHARDS and \
            saved.get("shards_together") != now.get("shards_together"):
        found.append(f"--shuffle-window {saved.get('shuffle_window')} then ({saved.get('shards_together')} shards "
                     f"shuffled together), {now.get('shuffle_window')} now ({now.get('shards_together')})")
    return found
