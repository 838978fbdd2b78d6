"""The JPEG decoder of ``--decode gpu``, behind one small interface: a list of compressed images
(1-D uint8 CPU tensors) in, a list of RGB CHW uint8 images on the device out, ``None`` where
an image could not be decoded.

Two implementations, the first one importable wins (``IMAGENET_GPU_JPEG=torchcodec`` or
``=torchvision`` picks one, for measurements):

* ``torchcodec`` -- TorchCodec's ``decode_jpeg`` (torchcodec >= 0.16, which needs no FFmpeg for
  images): the successor torchvision 0.29 names for its image decoders. One batched nvJPEG
  call, like torchvision's, but on the caller's stream (ours, high priority) rather than a pool
  stream of its own. It applies EXIF orientation, which the CPU path does not: the workers
  send EXIF-rotated JPEGs to the CPU decoder (:mod:`imagenet.data.gpudecode`), so every backend
  sees only unrotated ones.
* ``torchvision`` -- torchvision's nvJPEG op (``torch.ops.image.decode_jpegs_cuda``), the call
  behind ``torchvision.io.decode_jpeg(list, device="cuda")``. torchvision 0.29 deprecates its
  image decoders in favour of TorchCodec: its Python wrapper warns on every call (a
  DeprecationWarning, shown under pytest and ``-W default``). The op is called directly, so
  nothing warns per batch; the deprecation is stated once, in the banner's pipeline line and
  docs/INPUT.md. When torchvision drops the op this backend reports itself missing and the
  message says to install TorchCodec.

Both take the whole batch in one call, first wait on the host for the caller's stream to be
idle (nvJPEG's hardware path does not order its writes after work queued before it), decode
baseline JPEGs on the GPU's hardware JPEG engines where it has them (A100, H100, H200) and
host-synchronise before returning: the calling thread waits for the decode, the training stream
does not. One bad image fails the batched call; then the batch is decoded image by image, and
the ones that still fail come back as ``None``. On a CPU device (the tests) both decode with
libjpeg.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from ..base.errors import UserError

ENV = "IMAGENET_GPU_JPEG"
BACKENDS = ("torchcodec", "torchvision")


class JpegDecoder:
    """A batched JPEG decoder: ``decode(datas, device)`` -> list of CHW uint8 RGB or None."""

    def __init__(self, name: str, batched: Callable, single: Callable):
        self.name = name
        self._batched = batched  # (list of CPU uint8 tensors, device) -> list of CHW uint8
        self._single = single  # (one CPU uint8 tensor, device) -> CHW uint8

    def decode(self, datas: list, device: torch.device) -> list:
        if not datas:
            return []
        try:
            return list(self._batched(datas, device))
        except RuntimeError:  # one bad file fails the batched call: decode one by one
            out = []
            for data in datas:
                try:
                    out.append(self._single(data, device))
                except RuntimeError:
                    out.append(None)
            return out

    def __repr__(self) -> str:
        return f"JpegDecoder({self.name})"


def _torchcodec() -> Optional[JpegDecoder]:
    try:
        from torchcodec.decoders import decode_jpeg
    except Exception:  # not installed, or its libraries do not load here
        return None

    def batched(datas, device):
        return decode_jpeg(datas, mode="RGB", device=device)

    def single(data, device):
        return decode_jpeg(data, mode="RGB", device=device)
    return JpegDecoder("torchcodec", batched, single)


def _torchvision() -> Optional[JpegDecoder]:
    try:
        import torchvision.io.image as tv_image  # loads the image ops; warns only when one is called
        ops = torch.ops.image
        cuda_op, cpu_op = ops.decode_jpegs_cuda, ops.decode_jpeg
    except (ImportError, AttributeError, RuntimeError):
        return None
    rgb = tv_image.ImageReadMode.RGB.value

    def batched(datas, device):
        if device.type != "cuda":
            return [cpu_op(d, rgb, False) for d in datas]
        # The op allocates its outputs on the caller's stream but writes them from a pool
        # stream of its own, which waits for nothing of ours: memory this stream freed (the
        # last batch's decoded images) could be written while its kernels still read it. Let
        # our stream drain first (TorchCodec does the same on the stream it decodes on).
        torch.cuda.current_stream(device).synchronize()
        return cuda_op(datas, rgb, device)

    def single(data, device):
        return batched([data], device)[0]
    return JpegDecoder("torchvision", batched, single)


_FACTORIES = {"torchcodec": _torchcodec, "torchvision": _torchvision}
_found: dict = {}


def find(name: Optional[str] = None) -> Optional[JpegDecoder]:
    """The decoder ``name`` asks for (default: ``$IMAGENET_GPU_JPEG``, else the first of
    :data:`BACKENDS` that imports), or None where none does. Looked up once per process."""
    name = name or os.environ.get(ENV, "auto") or "auto"
    if name not in _found:
        if name != "auto" and name not in _FACTORIES:
            raise UserError(f"{ENV}={name} names no JPEG decoder; choose one of auto, {', '.join(BACKENDS)}")
        order = BACKENDS if name == "auto" else (name,)
        _found[name] = next((d for d in (_FACTORIES[b]() for b in order) if d is not None), None)
    return _found[name]


def require(name: Optional[str] = None) -> JpegDecoder:
    """:func:`find`, or a UserError saying what to install."""
    decoder = find(name)
    if decoder is None:
        asked = name or os.environ.get(ENV, "auto")
        raise UserError(f"--decode gpu found no GPU JPEG decoder ({ENV}={asked}): install TorchCodec "
                        "(pip install torchcodec), or use --decode cpu")
    return decoder


def describe(decoder: JpegDecoder) -> str:
    """The decoder for the banner; for torchvision's, its deprecation and the way forward."""
    if decoder.name == "torchvision":
        return ("torchvision's op; torchvision 0.29 deprecates its image decoders for TorchCodec, "
                "used instead once installed: pip install torchcodec")
    return decoder.name


def gpu_capable(decoder: Optional[JpegDecoder]) -> bool:
    """Whether ``decoder`` can decode on a CUDA device in this build (torchvision's op exists
    in CPU builds too, where it refuses to run)."""
    if decoder is None:
        return False
    if decoder.name == "torchvision":
        import torchvision
        return torchvision.version.cuda is not None
    return True
