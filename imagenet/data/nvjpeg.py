"""nvJPEG's batched decode through ``ctypes``: the ``nvjpeg`` backend of :mod:`.gpujpeg`.

What it adds over torchvision's op, which makes the same nvJPEG calls:
- **Calls side by side.** A handle and decoding state per thread (torchvision's op holds one
  process-wide lock for its one decoder), so several decode threads keep several batches in
  flight (``IMAGENET_DECODE_THREADS``, :mod:`.prefetch`). Each call waits on the host about once
  per image for the GPU, and beside a training step those waits are long (docs/BENCHMARKS.md,
  FF1). Calls side by side were meant to overlap them; on the H200 they did not: with N threads
  each call took N times as long and the rate stayed where one thread had it (GG1).
- **The caller's stream.** The decode is queued on the stream the caller makes current (the
  decode thread's, high priority), where torchvision's op uses a pool stream of its own.
- **No deprecated call.** It rests on libnvjpeg itself, which torchvision 0.29's deprecation of
  its image decoders does not touch.

Set up as torchvision sets up its op: nvJPEG's hardware backend (the JPEG engines of the A100,
H100 and H200), else, where nvJPEG finds no engines, its GPU_HYBRID backend (Huffman decoding on
the CUDA cores too). Each image comes out as planar RGB in one device buffer for the batch,
handed on as CHW views; its pixels equal torchvision's op's (docs/BENCHMARKS.md, FF2). An image
nvJPEG cannot parse, or the engines do not take (progressive, unusual samplings), comes back
``None``: the caller decodes it on the CPU. ``backend="gpu"`` forces the CUDA-core decoder (for
measurements: ``scripts/perf/jpeg_decoders.py --decoders nvjpeg:gpu``).

The library is the one torchvision's CUDA wheels bundle (``torchvision.libs/libnvjpeg*``), else
the ``nvidia-nvjpeg`` wheel's (``pip install nvidia-nvjpeg``, or ``nvidia-nvjpeg-cu12``), else the
system's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys
import threading
from typing import Optional

import torch

_SUCCESS = 0
_GPU_HYBRID, _HARDWARE = 2, 3  # nvjpegBackend_t
_OUTPUT_RGB = 3  # nvjpegOutputFormat_t: planar RGB
_MAX_COMPONENT = 4
BACKENDS = {"hw": _HARDWARE, "gpu": _GPU_HYBRID}
_STATUS = {1: "not initialized", 2: "invalid parameter", 3: "bad JPEG", 4: "JPEG not supported",
           5: "allocator failure", 6: "execution failed", 7: "architecture mismatch", 8: "internal error",
           9: "implementation not supported", 10: "incomplete bitstream"}
_ALIGN = 256  # bytes between images in the batch's buffer


class _Image(ctypes.Structure):
    """nvjpegImage_t: a plane pointer and row pitch per component."""

    _fields_ = [("channel", ctypes.c_void_p * _MAX_COMPONENT), ("pitch", ctypes.c_size_t * _MAX_COMPONENT)]


def _candidates() -> list:
    """Where libnvjpeg may be, in order: torchvision's bundled copy, the nvidia-nvjpeg wheels', the system's."""
    paths = []
    for package in ("torchvision", "nvidia"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            if package == "torchvision":
                paths += sorted(glob.glob(os.path.join(os.path.dirname(root), "torchvision.libs", "libnvjpeg*.so*")))
            else:
                paths += sorted(glob.glob(os.path.join(root, "cu1*", "lib", "libnvjpeg.so*")))
                paths += sorted(glob.glob(os.path.join(root, "nvjpeg", "lib", "libnvjpeg.so*")))
    found = ctypes.util.find_library("nvjpeg")
    return paths + ([found] if found else [])


def _load() -> Optional[ctypes.CDLL]:
    """The first libnvjpeg that loads and has the batched calls, their signatures declared."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
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
            for name in ("nvjpegJpegStreamDestroy", "nvjpegJpegStateDestroy", "nvjpegDestroy"):
                getattr(lib, name).argtypes = [p]
        except (OSError, AttributeError):  # not loadable here, or a library without the batched calls
            continue
        return lib
    return None


def _check(status: int, call: str) -> None:
    if status != _SUCCESS:
        raise RuntimeError(f"nvJPEG {call} failed: {_STATUS.get(status, status)}")


class _State:
    """One thread's nvJPEG handle, decoding state and parsed-header object for one device."""

    def __init__(self, lib: ctypes.CDLL, backend: int):
        self.lib = lib
        self.handle, self.state, self.stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.hardware = backend == _HARDWARE and \
            lib.nvjpegCreateEx(_HARDWARE, None, None, 0, ctypes.byref(self.handle)) == _SUCCESS
        if not self.hardware:  # no engines on this GPU (or an nvJPEG without them): the CUDA cores decode
            _check(lib.nvjpegCreateEx(_GPU_HYBRID, None, None, 0, ctypes.byref(self.handle)), "create")
        _check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "state create")
        _check(lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.stream)), "stream create")

    def __del__(self):
        """Freed with its thread (the trainer starts its decode threads again each epoch); left to
        the process's end at interpreter exit, when CUDA may already be gone."""
        if sys.is_finalizing():
            return
        try:
            for call, obj in (("nvjpegJpegStreamDestroy", self.stream), ("nvjpegJpegStateDestroy", self.state),
                              ("nvjpegDestroy", self.handle)):
                if obj:
                    getattr(self.lib, call)(obj)
        except Exception:  # a half-made state, or a library already unloaded
            pass


class Decoder:
    """``decode(datas, device)``: 1-D uint8 CPU tensors -> CHW uint8 views on the CUDA ``device``
    (None where nvJPEG cannot take the image), decoded on the current stream; returns once they
    are decoded. Thread-safe: each thread has its own nvJPEG state."""

    def __init__(self, lib: ctypes.CDLL, backend: str = "hw"):
        self.lib = lib
        self.backend = BACKENDS[backend]
        self._local = threading.local()

    def _state(self, index: int) -> _State:
        states = self._local.__dict__.setdefault("states", {})
        if index not in states:
            with torch.cuda.device(index):
                states[index] = _State(self.lib, self.backend)
        return states[index]

    def _sizes(self, st: _State, datas: list) -> list:
        """(height, width) of each image nvJPEG will decode in this state, else None."""
        lib, sizes = self.lib, []
        n, sampling, ok = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        w, h = (ctypes.c_int * _MAX_COMPONENT)(), (ctypes.c_int * _MAX_COMPONENT)()
        for data in datas:
            ptr, length = data.data_ptr(), data.numel()
            readable = lib.nvjpegGetImageInfo(st.handle, ptr, length, ctypes.byref(n), ctypes.byref(sampling),
                                              w, h) == _SUCCESS and sampling.value >= 0  # -1: unknown sampling
            if readable and st.hardware:  # the engines take baseline JPEGs of the usual samplings
                readable = lib.nvjpegJpegStreamParseHeader(st.handle, ptr, length, st.stream) == _SUCCESS and \
                    lib.nvjpegDecodeBatchedSupported(st.handle, st.stream, ctypes.byref(ok)) == _SUCCESS and \
                    ok.value == 0
            sizes.append((h[0], w[0]) if readable else None)
        return sizes

    def decode(self, datas: list, device: torch.device) -> list:
        index = device.index if device.index is not None else torch.cuda.current_device()
        st, lib = self._state(index), self.lib
        sizes = self._sizes(st, datas)
        take = [k for k, s in enumerate(sizes) if s is not None]
        out: list = [None] * len(datas)
        if not take:
            return out
        stream = torch.cuda.current_stream(device)
        # the engines' writes are not ordered after work queued before them on the stream: the
        # buffer below may be memory the last batch's kernels read until the stream drains
        stream.synchronize()
        offsets, end = [], 0
        for k in take:
            offsets.append(end)
            end += -(-3 * sizes[k][0] * sizes[k][1] // _ALIGN) * _ALIGN
        buffer = torch.empty(end, dtype=torch.uint8, device=device)
        images = (_Image * len(take))()
        for image, k, off in zip(images, take, offsets):
            height, width = sizes[k]
            for plane in range(3):
                image.channel[plane] = buffer.data_ptr() + off + plane * height * width
                image.pitch[plane] = width
        pointers = (ctypes.c_void_p * len(take))(*[datas[k].data_ptr() for k in take])
        lengths = (ctypes.c_size_t * len(take))(*[datas[k].numel() for k in take])
        _check(lib.nvjpegDecodeBatchedInitialize(st.handle, st.state, len(take), 1, _OUTPUT_RGB), "batched initialize")
        _check(lib.nvjpegDecodeBatched(st.handle, st.state, pointers, lengths, images,
                                       ctypes.c_void_p(stream.cuda_stream)), "batched decode")
        stream.synchronize()
        for k, off in zip(take, offsets):
            height, width = sizes[k]
            out[k] = buffer[off:off + 3 * height * width].view(3, height, width)
        return out


_libs: dict = {}  # "lib" -> the loaded libnvjpeg or None, once a process


def decoder(backend: str = "hw") -> Optional[Decoder]:
    """A Decoder over libnvjpeg (None where none loads here)."""
    if "lib" not in _libs:
        _libs["lib"] = _load()
    return Decoder(_libs["lib"], backend) if _libs["lib"] is not None else None
