"""Image folders (``DIR/train``, ``DIR/val``, a folder per class).

* ``folder`` -- ImageFolder datasets, the layout checks, unreadable files skipped and counted.
* ``cropbatch`` -- ``--decode cpu`` on a GPU: the workers decode and crop, the device resizes and flips.
* ``prepare`` -- array datasets exported as image folders: the built-in MNIST-5k, Fashion-MNIST.

May import: ``imagenet.base``, ``imagenet.kernels``, the shared modules of ``imagenet.data``
(``decode``, ``transforms``, ...); not ``imagenet.data.shards`` or ``imagenet.data.gpu``.
"""
