"""nvJPEG's batched decode through ``ctypes``, on the caller's CUDA stream: a measurement tool.

``scripts/perf/jpeg_decoders.py --decoders nvjpeg:BACKEND:STAGING`` times it beside torchvision's
op and nvImageCodec. It exists to answer one question of issue 28: does the decode keep its pace
beside a training step when its kernels go on a stream we choose (``--decode gpu``'s background
thread makes its stream high priority), where torchvision's op runs nvJPEG on a normal-priority
pool stream of its own and nvImageCodec on internal ones? Measured on an H200 (docs/BENCHMARKS.md,
Runs FF1-FF4): no. Beside a ResNet-50 training loop every variant was starved like the libraries
(258-1,983 img/s against 13,900-24,800 alone). Its pixels equalled torchvision's op exactly, and
in main.py it trained slower than the op (69-76% of the CUDA-graph step against 78%). So the
trainer keeps torchvision's op, and this binding stays here for the next measurement.

BACKEND: ``hw`` (the hardware JPEG engines of the A100, H100 and H200, where nvJPEG finds them;
else the CUDA cores), ``gpu`` (nvJPEG's GPU_HYBRID backend: Huffman decoding on the CUDA cores too)
or ``hw-yuv`` (the engines, writing the Y, Cb and Cr planes as decoded, with no colour conversion
by nvJPEG: a speed probe, its images are not RGB). STAGING: ``pinned`` copies the batch's JPEGs
into page-locked memory first; ``pageable`` hands nvJPEG the bytes where they are. Each image
comes out in one device buffer for the batch, planar, as CHW views; an image nvJPEG cannot parse,
or the engines do not take, comes back as ``None``. The library is the one torchvision's CUDA
wheels bundle (``torchvision.libs/libnvjpeg*``), else the ``nvidia-nvjpeg`` wheel's, else the
system's. A handle and state per thread and device, kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from typing import Optional

import torch

_SUCCESS = 0
_BACKEND_GPU_HYBRID, _BACKEND_HARDWARE = 2, 3
_OUTPUT_YUV, _OUTPUT_RGB = 1, 3  # planar
# name -> (nvJPEG backend, output format)
BACKENDS = {"hw": (_BACKEND_HARDWARE, _OUTPUT_RGB), "gpu": (_BACKEND_GPU_HYBRID, _OUTPUT_RGB),
            "hw-yuv": (_BACKEND_HARDWARE, _OUTPUT_YUV)}
_ARCH_MISMATCH = 7
_MAX_COMPONENT = 4
_STATUS = {1: "not initialized", 2: "invalid parameter", 3: "bad JPEG", 4: "JPEG not supported",
           5: "allocator failure", 6: "execution failed", 7: "architecture mismatch", 8: "internal error",
           9: "implementation not supported", 10: "incomplete bitstream"}


class _Image(ctypes.Structure):
    """nvjpegImage_t: a plane pointer and row pitch per component."""

    _fields_ = [("channel", ctypes.c_void_p * _MAX_COMPONENT), ("pitch", ctypes.c_size_t * _MAX_COMPONENT)]


def _candidates() -> list:
    """Where libnvjpeg may be, in order: torchvision's bundled copy, the nvidia-nvjpeg wheels', the system's."""
    paths = []
    for package in ("torchvision", "nvidia"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            parent = os.path.dirname(root)
            if package == "torchvision":
                paths += sorted(glob.glob(os.path.join(parent, "torchvision.libs", "libnvjpeg*.so*")))
            else:
                paths += sorted(glob.glob(os.path.join(root, "cu1*", "lib", "libnvjpeg.so*")))
                paths += sorted(glob.glob(os.path.join(root, "nvjpeg", "lib", "libnvjpeg.so*")))
    found = ctypes.util.find_library("nvjpeg")
    return paths + ([found] if found else [])


def _load() -> Optional[ctypes.CDLL]:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        p, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.nvjpegCreateEx.argtypes = [i, p, p, ctypes.c_uint, ctypes.POINTER(p)]
        lib.nvjpegJpegStateCreate.argtypes = [p, ctypes.POINTER(p)]
        lib.nvjpegJpegStreamCreate.argtypes = [p, ctypes.POINTER(p)]
        lib.nvjpegGetImageInfo.argtypes = [p, p, u, ctypes.POINTER(i), ctypes.POINTER(i), ctypes.POINTER(i),
                                           ctypes.POINTER(i)]
        lib.nvjpegJpegStreamParseHeader.argtypes = [p, p, u, p]
        lib.nvjpegDecodeBatchedSupported.argtypes = [p, p, ctypes.POINTER(i)]
        lib.nvjpegDecodeBatchedInitialize.argtypes = [p, p, i, i, i]
        lib.nvjpegDecodeBatched.argtypes = [p, p, ctypes.POINTER(p), ctypes.POINTER(u), ctypes.POINTER(_Image), p]
        return lib
    return None


def _check(status: int, call: str) -> None:
    if status != _SUCCESS:
        raise RuntimeError(f"nvJPEG {call} failed: {_STATUS.get(status, status)}")


class _State:
    """One thread's nvJPEG handle, decoding state and a parsed-stream object for one device."""

    def __init__(self, lib: ctypes.CDLL, backend: Optional[int] = None):
        self.handle, self.state, self.stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.hardware = backend in (None, _BACKEND_HARDWARE)
        status = lib.nvjpegCreateEx(_BACKEND_HARDWARE, None, None, 0, ctypes.byref(self.handle)) \
            if self.hardware else _ARCH_MISMATCH
        if status != _SUCCESS:  # no engines on this GPU (or nvJPEG without them): the CUDA cores decode
            self.hardware = False
            other = backend if backend not in (None, _BACKEND_HARDWARE) else _BACKEND_GPU_HYBRID
            _check(lib.nvjpegCreateEx(other, None, None, 0, ctypes.byref(self.handle)), "create")
        self.pinned = torch.empty(0, dtype=torch.uint8)  # the batch's JPEGs staged in page-locked memory
        _check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "state create")
        _check(lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.stream)), "stream create")


class Decoder:
    """``decode(datas, device)``: 1-D uint8 CPU tensors -> CHW uint8 views on ``device`` (None where
    nvJPEG cannot take the image), decoded on the current stream; returns once they are decoded."""

    def __init__(self, lib: ctypes.CDLL, backend: Optional[int] = None, pinned: bool = True,
                 output: int = _OUTPUT_RGB):
        self.lib = lib
        self.backend = backend  # None: the engines where there are, else the CUDA cores
        self.output = output  # planar RGB, or the decoded planes (YUV: each plane laid out full size)
        self.stage = pinned  # copy the JPEGs into page-locked memory first (nvJPEG's copies then need no staging)
        self._local = threading.local()

    def _state(self, index: int) -> _State:
        states = self._local.__dict__.setdefault("states", {})
        if index not in states:
            with torch.cuda.device(index):
                states[index] = _State(self.lib, self.backend)
        return states[index]

    def decode(self, datas: list, device: torch.device) -> list:
        index = device.index if device.index is not None else torch.cuda.current_device()
        st, lib = self._state(index), self.lib
        sizes, take = [], []
        n, c, w, h = ctypes.c_int(), ctypes.c_int(), (ctypes.c_int * _MAX_COMPONENT)(), (ctypes.c_int * _MAX_COMPONENT)()
        ok = ctypes.c_int()
        for k, data in enumerate(datas):
            ptr, length = data.data_ptr(), data.numel()
            if lib.nvjpegGetImageInfo(st.handle, ptr, length, ctypes.byref(n), ctypes.byref(c), w, h) != _SUCCESS \
                    or c.value < 0:
                sizes.append(None)
                continue
            if st.hardware:  # the engines take baseline JPEGs of the usual samplings; the rest go back
                if lib.nvjpegJpegStreamParseHeader(st.handle, ptr, length, st.stream) != _SUCCESS or \
                        lib.nvjpegDecodeBatchedSupported(st.handle, st.stream, ctypes.byref(ok)) != _SUCCESS or \
                        ok.value != 0:
                    sizes.append(None)
                    continue
            sizes.append((h[0], w[0]))
            take.append(k)
        out: list = [None] * len(datas)
        if not take:
            return out
        stream = torch.cuda.current_stream(device)
        # the engines' writes are not ordered after work queued before them on the stream: the
        # buffer below may be memory the last batch's kernels still read until the stream drains
        stream.synchronize()
        sources = [datas[k] for k in take]
        if self.stage:
            lengths_ = [d.numel() for d in sources]
            total = sum(lengths_)
            if st.pinned.numel() < total:
                st.pinned = torch.empty(int(total * 1.25), dtype=torch.uint8).pin_memory()
            torch.cat(sources, out=st.pinned[:total])
            sources = list(st.pinned[:total].split(lengths_))
        areas = [3 * sizes[k][0] * sizes[k][1] for k in take]
        offsets = [0]
        for a in areas[:-1]:
            offsets.append(offsets[-1] + (-(-a // 256) * 256))  # each image 256-byte aligned
        buffer = torch.empty(offsets[-1] + areas[-1], dtype=torch.uint8, device=device)
        base = buffer.data_ptr()
        images = (_Image * len(take))()
        pointers = (ctypes.c_void_p * len(take))(*[d.data_ptr() for d in sources])
        lengths = (ctypes.c_size_t * len(take))(*[d.numel() for d in sources])
        for j, (k, off) in enumerate(zip(take, offsets)):
            height, width = sizes[k]
            for p in range(3):
                images[j].channel[p] = base + off + p * height * width
                images[j].pitch[p] = width
        _check(lib.nvjpegDecodeBatchedInitialize(st.handle, st.state, len(take), 1, self.output), "batched initialize")
        _check(lib.nvjpegDecodeBatched(st.handle, st.state, pointers, lengths, images,
                                       ctypes.c_void_p(stream.cuda_stream)), "batched decode")
        stream.synchronize()
        for k, off in zip(take, offsets):
            height, width = sizes[k]
            out[k] = buffer[off:off + 3 * height * width].view(3, height, width)
        return out


_libs: dict = {}


def decoder(name: str = "hw", pinned: bool = True) -> Optional[Decoder]:
    """A Decoder over libnvjpeg set up as :data:`BACKENDS` ``name`` says (None where no libnvjpeg
    loads here)."""
    if "lib" not in _libs:
        _libs["lib"] = _load()
    backend, output = BACKENDS[name]
    return Decoder(_libs["lib"], backend, pinned, output) if _libs["lib"] is not None else None
