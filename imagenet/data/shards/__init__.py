"""Tar shards, in the WebDataset layout with an index of our own.

* ``index`` -- the format: ``index.json``, the per-sample tables, the start-up checks.
* ``dataset`` -- a shard folder recognised, its samples read with one ``pread`` each.
* ``writer`` -- ``scripts/make_shards.py``: an image folder packed into shards, restartably.
* ``remote`` -- shard folders behind a URL (fsspec), copied into a local cache versioned by content.

May import: ``imagenet.base``, the shared modules of ``imagenet.data``, and
``imagenet.data.images`` (the writer reads an image folder); not ``imagenet.data.gpu``.
"""
