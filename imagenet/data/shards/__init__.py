"""Tar shards, in the WebDataset layout with an index of our own.

* ``index`` -- the format: ``index.json``, the per-sample tables, the start-up checks.
* ``dataset`` -- a shard folder recognised, its samples read with one ``pread`` each.
* ``writer`` -- ``scripts/make_shards.py``: an image folder packed into shards, restartably; a
  rebuild writes the index's next generation beside the files a running job reads.
* ``tarwrite`` -- one tar shard being written: its members, padding and index rows.
* ``journal`` -- what a conversion has done: its plan, finished shards, and where a rerun resumes.
* ``files`` -- a shard folder's files: which are ours, each generation's record, their removal.
* ``remote`` -- shard folders behind a URL (fsspec), copied into a local cache versioned by content.
* ``lease`` -- a run's shared lock on the version it reads, which keeps a writer from deleting it.

May import: ``imagenet.base``, the shared modules of ``imagenet.data``, and
``imagenet.data.images`` (the writer reads an image folder); not ``imagenet.data.gpu``.
"""
