"""The JPEG decoder of ``--decode gpu``, behind one small interface: a list of compressed images
(1-D uint8 CPU tensors) in, a list of RGB images on the device out (CHW uint8, of any strides:
the geometry kernel reads each one as it lies), ``None`` where an image could not be decoded.

Two implementations of the same batched nvJPEG decode, tried in this order (``IMAGENET_GPU_JPEG``
picks one, for measurements):

* ``torchvision`` -- torchvision's op (``torch.ops.image.decode_jpegs_cuda``, behind
  ``torchvision.io.decode_jpeg(list, device="cuda")``), on the hardware JPEG engines where the
  GPU has them. It fed the training step fastest of every GPU decoder measured (docs/INPUT.md).
  torchvision 0.29 deprecates its decoders and its wrapper warns per call: the op is called
  directly, and the banner states the deprecation once.
* ``torchcodec`` -- TorchCodec's ``decode_jpeg``, the successor torchvision names; it takes over
  when the op is gone. It applies EXIF orientation, so the workers decode EXIF-rotated JPEGs
  themselves (:mod:`.decode`). Its CPU wheels have no nvJPEG: the probe passes them over.

Each call first waits for the caller's stream to drain (nvJPEG's hardware path does not order its
writes after work queued before it) and returns once the decode is done: the decode thread
waits, the training stream does not. A bad image fails the batched call; the batch is then decoded image by
image and the ones that still fail come back ``None``. Out-of-memory and CUDA errors are no bad
image and propagate. On a CPU device (the tests) each decodes with libjpeg.
"""

from __future__ import annotations

import io
import os
from typing import Callable, Optional

import torch
from PIL import Image

from ...base.errors import UserError
from ..decode import _rgb, _to_tensor

ENV = "IMAGENET_GPU_JPEG"
BACKENDS = ("torchvision", "torchcodec")  # the order find() tries them in: the measured default first
INSTALL = "a CUDA build of torchvision, or pip install -U 'torchcodec>=0.16'"


def _not_a_bad_image(e: Exception) -> bool:
    """Errors of the device, not of one file: out of memory, and CUDA errors (a fault of earlier
    kernels surfaces at the decoder's synchronisation)."""
    device_errors = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError,
                                      getattr(torch, "AcceleratorError", None)) if t is not None)
    return isinstance(e, device_errors) or "CUDA error" in str(e)


class JpegDecoder:
    """A batched JPEG decoder: ``decode(datas, device)`` -> list of CHW uint8 RGB or None."""

    def __init__(self, name: str, batched: Callable, single: Optional[Callable] = None):
        self.name = name
        self._batched = batched  # (list of CPU uint8 tensors, device) -> list of CHW uint8
        # (one CPU uint8 tensor, device) -> CHW uint8; default: the batched call on that image alone
        self._single = single or (lambda data, device: batched([data], device)[0])

    def decode(self, datas: list, device: torch.device) -> list:
        if not datas:
            return []
        try:
            return list(self._batched(datas, device))
        except RuntimeError as e:  # one bad file fails the batched call: decode one by one
            if _not_a_bad_image(e):
                raise
            out = []
            for data in datas:
                try:
                    out.append(self._single(data, device))
                except RuntimeError as e:
                    if _not_a_bad_image(e):
                        raise
                    out.append(None)
            return out

    def __repr__(self) -> str:
        return f"JpegDecoder({self.name})"


def pil_decode(data: torch.Tensor) -> Optional[torch.Tensor]:
    """libjpeg's RGB pixels of one encoded image (through PIL, as the CPU path decodes), as a CHW
    view of HWC memory; None where PIL cannot read it. What decodes, in the training process, a
    JPEG the GPU decoder refused."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            return _to_tensor(_rgb(img)).permute(2, 0, 1)
    except Exception:
        return None


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

    return JpegDecoder("torchvision", batched)


def _torchcodec() -> Optional[JpegDecoder]:
    try:
        from torchcodec.decoders import decode_jpeg
    except Exception:  # not installed, or its libraries do not load here
        return None

    def batched(datas, device):
        if device.type == "cuda":  # as torchvision's above: its writes are not ordered after ours
            torch.cuda.current_stream(device).synchronize()
        return decode_jpeg(datas, mode="RGB", device=device)

    return JpegDecoder("torchcodec", batched)


_FACTORIES = {"torchcodec": _torchcodec, "torchvision": _torchvision}
_lookups: dict = {}  # name asked for -> (the decoder or None, {backend: why it was passed over}), once a process


def _probe_jpeg() -> torch.Tensor:
    out = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 90)).save(out, "JPEG", quality=90)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def probe(decoder: JpegDecoder, device: torch.device) -> Optional[str]:
    """Why ``decoder`` cannot decode on ``device`` (None: it decoded a 16x8 JPEG there)."""
    try:
        image = decoder._batched([_probe_jpeg()], device)[0]
    except Exception as e:  # a CPU build, a library without nvJPEG, a driver it does not support
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if tuple(image.shape) != (3, 8, 16):
        return f"it decoded a 16x8 JPEG as {tuple(image.shape)}"
    return None


def _lookup(name: Optional[str]) -> tuple:
    """``(name, decoder or None, {backend: why it was passed over})`` for the name asked for."""
    name = name or os.environ.get(ENV, "auto") or "auto"
    if name not in _lookups:
        if name != "auto" and name not in _FACTORIES:
            raise UserError(f"{ENV}={name} names no JPEG decoder; choose one of auto, {', '.join(BACKENDS)} "
                            "(or unset it)")
        cuda, found, passed_over = torch.cuda.is_available(), None, {}
        for backend in BACKENDS if name == "auto" else (name,):
            decoder = _FACTORIES[backend]()
            why = None if decoder is None or not cuda else probe(decoder, torch.device("cuda"))
            if decoder is not None and why is None:
                found = decoder
                break
            passed_over[backend] = why or "not installed (or its libraries do not load)"
        _lookups[name] = (found, passed_over)
    return (name, *_lookups[name])


def find(name: Optional[str] = None) -> Optional[JpegDecoder]:
    """The decoder ``name`` asks for (default: ``$IMAGENET_GPU_JPEG``, else the first of
    :data:`BACKENDS` that imports and, where a CUDA GPU is visible, decodes a small JPEG on it),
    or None where none does. Looked up once per process."""
    return _lookup(name)[1]


def require(name: Optional[str] = None) -> JpegDecoder:
    """:func:`find`, or a UserError saying why each decoder cannot run and what to install."""
    asked, decoder, passed_over = _lookup(name)
    if decoder is None:
        tried = "; ".join(f"{b}: {why}" for b, why in passed_over.items())
        raise UserError(f"--decode gpu found no JPEG decoder that runs on this GPU ({ENV}={asked}; {tried}): "
                        f"{INSTALL}, or use --decode cpu")
    return decoder


def describe(decoder: JpegDecoder) -> str:
    """The decoder for the banner: which one, where it decodes, and for torchvision's its
    deprecation and the way forward."""
    if decoder.name == "torchvision":
        return ("torchvision's op, nvJPEG on the hardware JPEG engines where the GPU has them; torchvision 0.29 "
                "deprecates it, TorchCodec takes over when it is gone: pip install -U 'torchcodec>=0.16'")
    return "TorchCodec's nvJPEG call" if decoder.name == "torchcodec" else decoder.name


def gpu_capable(decoder: Optional[JpegDecoder]) -> bool:
    """Whether ``decoder`` can decode on a CUDA device here: :func:`find` probed it where a GPU
    is visible; without one, whether this build could (torchvision's op exists in CPU builds
    too, where it refuses to run)."""
    if decoder is None:
        return False
    if decoder.name == "torchvision" and not torch.cuda.is_available():
        import torchvision
        return torchvision.version.cuda is not None
    return True
