"""The input pipeline: from files to batches on the training device.

Three sub-packages, one per input path, and the modules every path shares:

* ``images/`` -- image folders: the layout checks and unreadable files (``folder``), the CPU
  crop with the resize on the device (``cropbatch``), array datasets exported as folders
  (``prepare``: the built-in MNIST-5k, Fashion-MNIST).
* ``shards/`` -- tar shards: the format and its index (``index``), the dataset (``dataset``),
  ``scripts/make_shards.py``'s converter (``writer``), shard folders behind a URL (``remote``).
* ``gpu/`` -- ``--decode gpu``: workers read bytes, the GPU decodes (``decode``), the JPEG decoder
  (``jpeg``), ``--decode auto``'s choice (``choice``), the input account (``account``).
* shared, below them: ``decode`` (the CPU decode: PIL decode, crop, resize, flip), ``transforms``,
  ``samplers``, ``synthetic`` (``--dummy``), ``mixing`` (mixup, CutMix).
* above them: ``loaders`` (a run's datasets and loaders), ``prefetch`` (the device loader and
  the decode thread), ``dataorder`` (the order's fingerprint), ``probe`` (what a folder holds).

The sub-packages import the shared modules, never the modules above them; ``gpu`` and
``shards`` never import each other, and ``images`` neither of them (``.importlinter``).

May import: ``imagenet.base``, ``imagenet.kernels``.
"""
