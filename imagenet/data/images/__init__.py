"""Image folders (``DIR/train``, ``DIR/val``, a folder per class): datasets with their layout checks
and bad-file policy, the CPU crop whose resize runs on the device, and array datasets exported
as such folders.

May import: ``imagenet.base``, ``imagenet.kernels``, the shared modules of ``imagenet.data``
(``decode``, ``transforms``, ...); not ``imagenet.data.shards`` or ``imagenet.data.gpu``.
"""
