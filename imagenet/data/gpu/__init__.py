"""``--decode gpu``: the workers read JPEG bytes and draw crops, the GPU decodes (nvJPEG behind one
interface) and one kernel crops, resizes and flips; ``--decode auto``'s choice between the two
paths; the per-stage account of where a batch's time went.

May import: ``imagenet.base``, ``imagenet.kernels``, the shared modules of ``imagenet.data``;
not ``imagenet.data.shards`` or ``imagenet.data.images``.
"""
