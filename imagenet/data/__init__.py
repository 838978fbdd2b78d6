"""The input pipeline: from files to batches on the training device.

* ``folder`` -- ImageFolder datasets, the layout checks, unreadable files skipped and counted.
* ``shardindex`` -- the tar-shard format: ``index.json``, the per-sample tables, start-up checks.
* ``shards`` -- tar-shard datasets: a shard folder recognised, samples read with one pread each.
* ``shardwriter`` -- ``scripts/make_shards.py``: an image folder packed into tar shards, restartably.
* ``remote`` -- shard folders behind a URL (fsspec), copied once into a local cache.
* ``synthetic`` -- ``--dummy``: batches made once on the device.
* ``transforms`` -- crop and resize geometry, torchvision's classic transforms, augmentation
  policies, the crop size per epoch (``--progressive-resize``).
* ``decode`` -- the fast CPU path: decode, crop, resize and flip in the workers (PIL).
* ``cropbatch`` -- ``--decode cpu`` on a GPU: workers crop, the device resizes and flips.
* ``gpudecode`` -- ``--decode gpu``: workers read bytes and draw crops, nvJPEG decodes.
* ``gpujpeg`` -- the GPU JPEG decoder behind one interface (torchvision's nvJPEG op, else TorchCodec).
* ``decodechoice`` -- ``--decode auto``: CPU or GPU decoding from what the machine has.
* ``inputaccount`` -- where a ``--decode gpu`` batch's time goes, per stage, per epoch.
* ``samplers`` -- which images a rank reads in an epoch, with per-sample augmentation seeds
  (over tar shards: shards shuffled, then a window of them at a time).
* ``dataorder`` -- what decides the training data's order, as a fingerprint checkpoints keep.
* ``loaders`` -- datasets and loaders of a run, collation, per-process batch sizes.
* ``prefetch`` -- the device loader: copies, normalisation and layout on the device, ahead;
  ``--decode gpu``'s decode thread.
* ``mixing`` -- mixup and CutMix on the device.
* ``prepare`` -- the built-in MNIST-5k export and dataset conversions.

May import: ``imagenet.base``, ``imagenet.kernels``.
"""
