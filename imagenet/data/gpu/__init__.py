"""``--decode gpu``: the workers read JPEG bytes and draw crops, the GPU decodes and one kernel
crops, resizes and flips.

* ``decode`` -- the workers' side (bytes, crop draws, CPU fallbacks) and the device side (one
  batched decoder call, then the geometry kernel).
* ``jpeg`` -- the GPU JPEG decoder behind one interface (torchvision's nvJPEG op, else TorchCodec).
* ``choice`` -- ``--decode auto``: the workers or the GPU, from what the machine and data are.
* ``share`` -- ``--decode-share``: the share of the training JPEGs the workers decode instead,
  steered by the decode thread's load.
* ``account`` -- where a ``--decode gpu`` batch's time goes, per stage, per epoch.

May import: ``imagenet.base``, ``imagenet.kernels``, the shared modules of ``imagenet.data``;
not ``imagenet.data.shards`` or ``imagenet.data.images``.
"""
