"""Tar shards (WebDataset layout with our index): the format, the dataset that reads a sample with
one ``pread``, the converter from an image folder, and shard folders behind a URL copied into a
versioned local cache.

May import: ``imagenet.base``, the shared modules of ``imagenet.data``, and
``imagenet.data.images`` (the converter reads an image folder); not ``imagenet.data.gpu``.
"""
