"""What a data folder holds, looked at before the loaders are built: whether its training images
are JPEGs (``--decode auto`` asks), for an image folder or a tar-shard folder alike."""

from __future__ import annotations

import os
from typing import Optional

from ..base.errors import UserError
from .images.folder import first_image_is_jpeg
from .shards.index import INDEX, read_index


def images_are_jpeg(root: str) -> Optional[bool]:
    """Whether ``root``'s training images are JPEGs: for a shard folder what its index counts, for
    an image folder its first class folder's first image file (by name). None where there is
    nothing to look at (a URL, a shard index older than its format counts, a layout the checks
    will report)."""
    if os.path.isfile(os.path.join(root, INDEX)):
        try:
            return read_index(root).images_are_jpeg()
        except UserError:
            return None  # start-up reports what is wrong with it
    return first_image_is_jpeg(root)
