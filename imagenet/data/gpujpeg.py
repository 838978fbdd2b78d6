"""The JPEG decoder of ``--decode gpu``, behind one small interface: a list of compressed images
(1-D uint8 CPU tensors) in, a list of RGB images on the device out (CHW uint8 views, of any
strides: the geometry kernel reads each one as it lies), ``None`` where an image could not be
decoded.

Five implementations; the first that decodes a small JPEG on this GPU wins
(``IMAGENET_GPU_JPEG=torchvision``, ``=torchcodec``, ``=nvimgcodec``, ``=nvjpeg`` or ``=dali``
picks one, for measurements). The order is measured: on an H200 training ResNet-50 from 4
workers, torchvision's op fed 73-80% of the step's rate, nvImageCodec 62%, our nvJPEG binding
69-76% (with 1, 2 or 4 decode threads alike), DALI 61-64% (docs/BENCHMARKS.md, EE, FF and GG).

* ``torchvision`` -- torchvision's nvJPEG op (``torch.ops.image.decode_jpegs_cuda``), the call
  behind ``torchvision.io.decode_jpeg(list, device="cuda")``: nvJPEG's batched decode, which
  torchvision sets up on the hardware JPEG engines where the GPU has them (A100, H100, H200) and
  on the CUDA cores elsewhere (our own nvJPEG binding set up that way decoded the same pixels,
  docs/BENCHMARKS.md FF2; the engines were busy 17-22% at their peaks under it, DD3). torchvision
  0.29 deprecates its image decoders in favour of TorchCodec: its Python wrapper warns on every
  call (a DeprecationWarning, shown under pytest and ``-W default``). The op is called directly,
  so nothing warns per batch; the deprecation is stated once, in the banner's pipeline line and
  docs/INPUT.md. When torchvision drops the op this backend reports itself missing and the
  message says what to install.
* ``torchcodec`` -- TorchCodec's ``decode_jpeg`` (torchcodec >= 0.16, which needs no FFmpeg for
  images): the successor torchvision 0.29 names for its image decoders. One batched nvJPEG
  call, like torchvision's, but on the caller's stream (ours, high priority) rather than a pool
  stream of its own. It applies EXIF orientation, which the CPU path does not: the workers
  send EXIF-rotated JPEGs to the CPU decoder (:mod:`imagenet.data.gpudecode`), so every backend
  sees only unrotated ones. Its CPU wheels have no nvJPEG and fail every CUDA call: the probe
  leaves them out.
* ``nvimgcodec`` -- NVIDIA's nvImageCodec (``pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg``,
  or ``-cu12``), an optional extra: baseline JPEGs on the GPU's hardware JPEG engines (A100,
  H100, H200), meant to leave the CUDA cores to the training step (on the H200 its call still
  took 62-66 ms a batch of 384 while the step ran, 57-60 ms of it the decode thread's CPU time;
  docs/BENCHMARKS.md EE); what the engines do not take goes to nvJPEG's CUDA decoder
  (``IMAGENET_NVIMGCODEC_BACKENDS``, default ``hw,gpu``, orders them and can share a batch
  between them, e.g. ``hw:0.7,gpu``; ``hybrid`` adds the CPU+GPU one). Its pixels are further from libjpeg's than nvJPEG's CUDA decoder's (on small
  colour photos 2.4 levels on average with ``hw,gpu``, 5.0 with ``hw`` alone), and its accuracy
  on a real set is not measured. The decoded images are interleaved RGB (HWC), handed on as
  CHW views; their buffers are reused batch after batch by the thread that decoded them (an
  image stays valid until that thread's next call). Only its JPEG extension is loaded (its other
  codecs print install advice for libraries a trainer never needs).

* ``nvjpeg`` -- our ctypes binding of nvJPEG (:mod:`.nvjpeg`), set up as torchvision sets up its
  op (the same pixels), on the caller's stream and with a decoding state per thread: several
  decode threads (``IMAGENET_DECODE_THREADS``, :mod:`.prefetch`) keep several batches in flight,
  where torchvision's op decodes one at a time behind a process-wide lock (on the H200 that did
  not raise the rate: docs/BENCHMARKS.md GG1). It rests on libnvjpeg
  itself (torchvision's bundled copy or the ``nvidia-nvjpeg`` wheel), not on a deprecated call.
* ``dali`` -- NVIDIA DALI's image decoder (``pip install nvidia-dali-cuda130``, or ``-cuda120``),
  an optional extra: a pipeline per decode thread feeds it a batch's JPEGs and runs its
  ``mixed`` decoder, which gives ``IMAGENET_DALI_HW_LOAD`` of the batch (DALI's default 0.65) to
  the hardware engines and the rest to the CUDA cores, parsing on :data:`DALI_THREADS` host
  threads. Its images are copied, in one call on our stream, into memory torch's allocator
  owns (DALI's own buffers go back to its pool unordered after our kernels). Its pixels agree
  with torchvision's op within nvImageCodec's bounds (tests/test_gpudecode.py on the H200, GG4; DALI 2.x
  decodes through nvImageCodec).

Each takes the whole batch in one call, first waits on the host for the caller's stream to be
idle (nvJPEG's hardware path does not order its writes after work queued before it, and
nvImageCodec reuses the last batch's buffers) and host-synchronises before returning: the calling
thread waits for the decode, the training stream does not. A bad image fails torchvision's and
TorchCodec's batched call; then the batch is decoded image by image, and the ones that still
fail come back as ``None`` (nvImageCodec returns ``None`` for them itself); out-of-memory and CUDA
errors are not a bad image and propagate. On a CPU device (the tests) each decodes with libjpeg.
"""

from __future__ import annotations

import ctypes
import importlib.util
import io
import os
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
from PIL import Image

from ..base.errors import UserError
from .decode import _rgb, _to_tensor

ENV = "IMAGENET_GPU_JPEG"
# the order "auto" tries them in: torchvision's op trained fastest on the H200 (73-80% of the step at
# -j 4 against nvImageCodec's 62%, our nvJPEG binding's 69-76% and DALI's 61-64%, docs/BENCHMARKS.md
# EE, FF and GG); TorchCodec makes the same nvJPEG call
BACKENDS = ("torchvision", "torchcodec", "nvimgcodec", "nvjpeg", "dali")
INSTALL = ("pip install -U 'torchcodec>=0.16' (or nvImageCodec: pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg; "
           "for CUDA 12 nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12)")
NVIMGCODEC_ENV = "IMAGENET_NVIMGCODEC_BACKENDS"
NVIMGCODEC_KINDS = {"hw": "HW_GPU_ONLY", "gpu": "GPU_ONLY", "hybrid": "HYBRID_CPU_GPU"}
NVIMGCODEC_THREADS = 4  # its host threads (parsing, the engines' submission); not one per core
DALI_ENV = "IMAGENET_DALI_HW_LOAD"
DALI_THREADS = 4  # DALI's host threads (parsing; Huffman decoding of the CUDA cores' share)


def _not_a_bad_image(e: Exception) -> bool:
    """Errors of the device, not of one file: out of memory, and CUDA errors (a fault of earlier
    kernels surfaces at the decoder's synchronisation)."""
    device_errors = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError,
                                      getattr(torch, "AcceleratorError", None)) if t is not None)
    return isinstance(e, device_errors) or "CUDA error" in str(e)


class JpegDecoder:
    """A batched JPEG decoder: ``decode(datas, device)`` -> list of CHW uint8 RGB or None."""

    def __init__(self, name: str, batched: Callable, single: Optional[Callable] = None, detail: str = ""):
        self.name = name
        self.detail = detail  # how it is set up, for the banner (nvImageCodec's backends)
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


def _torchcodec() -> Optional[JpegDecoder]:
    try:
        from torchcodec.decoders import decode_jpeg
    except Exception:  # not installed, or its libraries do not load here
        return None

    def batched(datas, device):
        if device.type == "cuda":  # as torchvision's below: its writes are not ordered after ours
            torch.cuda.current_stream(device).synchronize()
        return decode_jpeg(datas, mode="RGB", device=device)

    return JpegDecoder("torchcodec", batched)


def pil_decode(data: torch.Tensor) -> Optional[torch.Tensor]:
    """libjpeg's RGB pixels of one encoded image (through PIL, as the CPU path decodes), as a CHW
    view of HWC memory; None where PIL cannot read it (as nvImageCodec answers for an image it
    cannot decode). Also what decodes, in the training process, a JPEG a GPU decoder refused."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            return _to_tensor(_rgb(img)).permute(2, 0, 1)
    except Exception:
        return None


def _jpeg_extension_only() -> None:
    """Point nvImageCodec at its JPEG extension alone, before it is imported (unless the user set
    ``NVIMGCODEC_EXTENSIONS_PATH``): on import it loads every extension, and its JPEG 2000 and
    TIFF ones print install advice for libraries they miss. The extension then loads from a
    folder of links, where its run path no longer finds the nvJPEG wheel's library: that is
    loaded first."""
    spec = importlib.util.find_spec("nvidia.nvimgcodec") if importlib.util.find_spec("nvidia") else None
    if "NVIMGCODEC_EXTENSIONS_PATH" in os.environ or spec is None or not spec.origin:
        return
    package = Path(spec.origin).parent
    extensions = sorted((package / "extensions").glob("libnvjpeg_ext.so*"))
    if not extensions:
        return
    wheels = [*sorted(package.parent.glob("cu1*/lib/libnvjpeg.so.1*")),  # nvidia-nvjpeg's CUDA 13 layout
              *sorted(package.parent.glob("nvjpeg/lib/libnvjpeg.so.1*"))]  # nvidia-nvjpeg-cu12's
    for lib in wheels:
        try:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    folder = tempfile.mkdtemp(prefix="imagenet-nvimgcodec-")
    os.symlink(extensions[0], os.path.join(folder, extensions[0].name))
    os.environ["NVIMGCODEC_EXTENSIONS_PATH"] = folder


def nvimgcodec_backends(spec: str) -> list:
    """``IMAGENET_NVIMGCODEC_BACKENDS`` -> [(backend kind, load hint)]: backends in order, each
    ``NAME`` or ``NAME:FRACTION`` (the share of a batch nvImageCodec gives it, the rest going on
    to the next; default 1), e.g. ``hw:0.7,gpu`` (DALI's way of sharing a batch between the
    hardware engines and the CUDA cores)."""
    out = []
    for item in (part.strip() for part in spec.split(",")):
        name, _, share = item.partition(":")
        try:
            hint = float(share) if share else 1.0
        except ValueError:
            hint = -1.0
        if name not in NVIMGCODEC_KINDS or not 0.0 < hint <= 1.0:
            raise UserError(f"{NVIMGCODEC_ENV}={spec!r}: give nvImageCodec's backends in order, each one of "
                            f"{', '.join(NVIMGCODEC_KINDS)}, optionally with the share of a batch it takes "
                            "(NAME:FRACTION, 0 < FRACTION <= 1), e.g. hw:0.7,gpu (default hw,gpu)")
        out.append((NVIMGCODEC_KINDS[name], hint))
    return out


def nvimgcodec_decoder(spec: Optional[str] = None) -> Optional[JpegDecoder]:
    """nvImageCodec with the backends of ``spec`` (default: ``$IMAGENET_NVIMGCODEC_BACKENDS``,
    else ``hw,gpu``), or None where it is not installed."""
    spec = spec or os.environ.get(NVIMGCODEC_ENV) or "hw,gpu"
    backends = nvimgcodec_backends(spec)
    try:
        _jpeg_extension_only()
        from nvidia import nvimgcodec
        params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                         allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.I_RGB)
    except Exception:  # not installed, its libraries do not load, or a version with another interface
        return None
    # per thread (freed with it), device index -> [its Decoder, the last full batch's images, their
    # buffers reused]: a thread reuses only its own buffers, after its own stream has drained
    local = threading.local()

    def batched(datas, device):
        if device.type != "cuda":
            return [pil_decode(d) for d in datas]
        index = device.index if device.index is not None else torch.cuda.current_device()
        per_device = local.__dict__.setdefault("per_device", {})
        if index not in per_device:
            kinds = [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind), load_hint=hint)
                     for kind, hint in backends]
            per_device[index] = [nvimgcodec.Decoder(device_id=index, max_num_cpu_threads=NVIMGCODEC_THREADS,
                                                    backends=kinds), []]
        decoder, pool = per_device[index]
        stream = torch.cuda.current_stream(device)
        stream.synchronize()  # the last batch's kernel has read the buffers that are reused now
        streams = [nvimgcodec.CodeStream(d.numpy()) for d in datas]
        reuse = pool[:len(streams)] if len(pool) >= len(streams) else None
        images = decoder.decode(streams, images=reuse, params=params, cuda_stream=stream.cuda_stream)
        if reuse is None and all(img is not None for img in images):
            pool[:] = images
        out = [None if img is None else torch.from_dlpack(img).permute(2, 0, 1) for img in images]
        stream.synchronize()
        return out

    return JpegDecoder("nvimgcodec", batched, detail=f"backends {spec}")


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


def nvjpeg_decoder(backend: str = "hw") -> Optional[JpegDecoder]:
    """Our ctypes binding of nvJPEG (:mod:`.nvjpeg`; ``backend="gpu"`` forces the CUDA-core
    decoder), or None where no libnvjpeg loads."""
    from . import nvjpeg
    lib = nvjpeg.decoder(backend)
    if lib is None:
        return None

    def batched(datas, device):
        if device.type != "cuda":
            return [pil_decode(d) for d in datas]
        return lib.decode(datas, device)

    return JpegDecoder("nvjpeg", batched, detail=backend)


def dali_hw_load(value: Optional[str] = None) -> Optional[float]:
    """``IMAGENET_DALI_HW_LOAD``: the share of a batch DALI's decoder gives the hardware engines
    (0 < x <= 1), or None for DALI's own default."""
    value = os.environ.get(DALI_ENV, "") if value is None else value
    if not value:
        return None
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise UserError(f"{DALI_ENV}={value!r}: give the share of a batch DALI's decoder sends to the hardware "
                        "JPEG engines, 0 < x <= 1 (the rest goes to the CUDA cores), e.g. 0.65")
    return share


def dali_decoder(hw_load: Optional[float] = None) -> Optional[JpegDecoder]:
    """DALI's image decoder (``nvidia-dali-cuda130``/``-cuda120``), its ``mixed`` device: the
    hardware engines take ``hw_load`` of a batch (default ``$IMAGENET_DALI_HW_LOAD``, else DALI's
    own), the CUDA cores the rest, its host threads parse. None where DALI is not installed."""
    hw_load = dali_hw_load() if hw_load is None else hw_load
    try:
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline
    except Exception:  # not installed, or its libraries do not load here
        return None
    # per thread (freed with it): device index -> its pipeline; a pipeline runs one call at a time
    local = threading.local()

    def pipeline(index: int, size: int):
        pipes = local.__dict__.setdefault("pipes", {})
        if index not in pipes or pipes[index].max_batch_size < size:
            pipe = Pipeline(batch_size=size, num_threads=DALI_THREADS, device_id=index, prefetch_queue_depth=1)
            with pipe:
                jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
                extra = {} if hw_load is None else {"hw_decoder_load": hw_load}
                pipe.set_outputs(fn.decoders.image(jpegs, device="mixed", output_type=types.RGB, **extra))
            pipe.build()
            pipes[index] = pipe
        return pipes[index]

    def batched(datas, device):
        if device.type != "cuda":
            return [pil_decode(d) for d in datas]
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device)
        pipe = pipeline(index, len(datas))
        try:
            pipe.feed_input("jpegs", [d.numpy() for d in datas])
            images, = pipe.run()
        except Exception as e:  # a bad image fails the batch and leaves the pipeline unusable
            local.pipes.pop(index, None)
            raise RuntimeError(f"DALI could not decode the batch: {str(e).splitlines()[0] if str(e) else e}") from e
        # copied out, in one call on our stream, into memory torch's allocator owns: DALI's own
        # buffers return to its pool when dropped, unordered after our kernels that read them
        shapes = [tuple(images[k].shape()) for k in range(len(images))]
        buffer = torch.empty(sum(h * w * c for h, w, c in shapes), dtype=torch.uint8, device=device)
        images.copy_to_external(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_void_p(stream.cuda_stream), True)
        out, start = [], 0
        for h, w, c in shapes:
            out.append(buffer[start:start + h * w * c].view(h, w, c).permute(2, 0, 1))
            start += h * w * c
        stream.synchronize()
        return out

    return JpegDecoder("dali", batched, detail="hardware engines' share " + ("DALI's default" if hw_load is None
                                                                             else f"{hw_load:g}"))


_FACTORIES = {"dali": dali_decoder, "nvimgcodec": nvimgcodec_decoder, "nvjpeg": nvjpeg_decoder,
              "torchcodec": _torchcodec, "torchvision": _torchvision}
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
            raise UserError(f"{ENV}={name} names no JPEG decoder; choose one of auto, {', '.join(BACKENDS)}")
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
    if decoder.name == "nvimgcodec":
        return f"nvImageCodec, {decoder.detail}; hw: the GPU's hardware JPEG engines"
    if decoder.name == "torchvision":
        return ("torchvision's op, nvJPEG on the hardware JPEG engines where the GPU has them; torchvision 0.29 "
                "deprecates it, TorchCodec or nvImageCodec "
                f"take over when it is gone: {INSTALL}")
    if decoder.name == "nvjpeg":
        return "nvJPEG through our binding, on the hardware JPEG engines where the GPU has them"
    if decoder.name == "dali":
        return f"DALI's decoder, the hardware JPEG engines and the CUDA cores ({decoder.detail})"
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
