"""``--decode gpu``: workers read JPEG bytes and draw the crop; the GPU decodes, crops and resizes.

Workers do what needs no pixels: read the file once (a tar shard's sample comes already read),
parse its header from those bytes, draw the RandomResizedCrop box and the flip from the
per-sample seeded RNG exactly as the CPU path does (so ``--seed`` gives the same crops either
way), and ship the compressed bytes (a tenth of the decoded size), with the seconds each of
those took (:mod:`imagenet.data.inputaccount` sums them per epoch).
On the device, one batched nvJPEG call (``torchvision.io.decode_jpeg(device='cuda')``) decodes
the batch, and one kernel (:mod:`imagenet.kernels.gpugeometry`) crops, resizes with antialiased bilinear
interpolation (PIL's filter, so the pixels match the CPU path within rounding) and flips every
image of it; without Triton, torch's resize does it image by image.

Fallbacks, counted per epoch in metrics.jsonl: files that are not baseline RGB/greyscale JPEGs
(PNG, CMYK JPEG, ...) are decoded on the CPU in the worker as before; a JPEG that the GPU
decoder rejects is decoded on the CPU in the main process; a file neither can read is skipped
like any unreadable image.
"""

from __future__ import annotations

import io
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from PIL import Image

from ..kernels import gpugeometry
from .decode import TrainDecoderReader, _rgb, _to_tensor

_JPEG_MODES = ("RGB", "L")  # what nvJPEG decodes to RGB reliably; CMYK/YCCK go to the CPU


@dataclass
class JpegJob:
    """One image to decode on the device: compressed bytes and what to do with the pixels."""

    data: bytes  # the file (plain bytes travel between processes faster than one tensor each)
    path: str
    # train: (top, left, height, width) crop in full-resolution pixels, then resize to out x out;
    # val: resize to (height, width) first, then crop out x out at (top, left).
    kind: str
    box: tuple
    out: int
    flip: bool = False
    read_s: float = 0.0  # seconds the worker spent reading the file
    parse_s: float = 0.0  # and parsing its header and drawing the crop


@dataclass
class CpuDecoded:
    """An image the worker decoded itself (not a plain JPEG): uint8 HWC, counted as a fallback."""

    image: torch.Tensor
    read_s: float = 0.0  # seconds the worker spent reading the file
    decode_s: float = 0.0  # and decoding it


@dataclass
class JpegBatch:
    """A collated batch mixing device jobs and images the worker already decoded (fallbacks)."""

    items: list  # JpegJob or CpuDecoded, in batch order
    worker_seconds: tuple = ()  # the worker's (read, parse, fallback) seconds over the batch

    @staticmethod
    def collate(items: list) -> "JpegBatch":
        """Runs in the worker: the batch, with its worker's time per stage summed."""
        jobs = [it for it in items if isinstance(it, JpegJob)]
        fallbacks = [it for it in items if isinstance(it, CpuDecoded)]
        return JpegBatch(items, (sum(it.read_s for it in items), sum(job.parse_s for job in jobs),
                                 sum(f.decode_s for f in fallbacks)))

    def pin_memory(self, device=None):  # the DataLoader's pin-memory thread: bytes stay pageable
        return self


def _read_bytes(src) -> tuple:
    """The encoded image of ``src`` (a path, or a tar shard's sample already in memory) and the
    seconds reading it took (a sample's: the dataset's ``pread``, carried as ``read_s``)."""
    start = time.perf_counter()
    if hasattr(src, "getvalue"):
        data = src.getvalue()
        return data, getattr(src, "read_s", 0.0) + time.perf_counter() - start
    with open(src, "rb") as fh:
        data = fh.read()
    return data, time.perf_counter() - start


def _name(src) -> str:
    return getattr(src, "name", src)  # a shard's sample is named for the report


class TrainJpegReader(TrainDecoderReader):
    """Worker side of the training transform: path -> JpegJob, or the CPU decoder's image (the
    same crop distribution, the same RNG draws)."""

    def __call__(self, path: str):
        data, read_s = _read_bytes(path)
        start = time.perf_counter()
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode not in _JPEG_MODES:  # decoded here: counted as a fallback
                image = self.cpu.decode(img, *self.cpu.draw(img))  # what self.cpu(path) does
                return CpuDecoded(image, read_s, time.perf_counter() - start)
            box, flip = self.cpu.draw(img)
        return JpegJob(data, _name(path), "train", box, self.cpu.size, flip, read_s, time.perf_counter() - start)


class ValJpegReader:
    """Worker side of the validation transform: Resize(shorter side) + CenterCrop, deferred."""

    def __init__(self, cpu_decoder):
        self.cpu = cpu_decoder  # a decode.ValDecoder

    def __call__(self, path: str):
        data, read_s = _read_bytes(path)
        start = time.perf_counter()
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode not in _JPEG_MODES:
                image = self.cpu.decode(img)  # what self.cpu(path) does
                return CpuDecoded(image, read_s, time.perf_counter() - start)
            new_w, new_h, top, left = self.cpu.geometry(*img.size)
        return JpegJob(data, _name(path), "val", (top, left, new_h, new_w), self.cpu.size, read_s=read_s,
                       parse_s=time.perf_counter() - start)


def _resized(img: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 CHW -> float CHW of (height, width), antialiased bilinear (PIL's filter when
    shrinking); not yet rounded (the batch is rounded once, in :func:`_finish`)."""
    x = img[None].float()
    if img.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x[0]


def _geometry(job: JpegJob, img: torch.Tensor) -> torch.Tensor:
    """Crop/resize a decoded CHW uint8 image as the job says: float CHW, unrounded, unflipped."""
    if job.kind == "train":
        top, left, height, width = job.box
        return _resized(img[:, top:top + height, left:left + width], job.out, job.out)
    top, left, new_h, new_w = job.box
    return _resized(img, new_h, new_w)[:, top:top + job.out, left:left + job.out]


def _finish(images: list, flips: list, device: torch.device) -> torch.Tensor:
    """Float CHW images -> one uint8 NHWC batch: rounded, clamped and flipped for the whole
    batch at once (a handful of kernels instead of five per image)."""
    x = torch.stack(images).round_().clamp_(0, 255)
    if any(flips):
        idx = torch.tensor([i for i, f in enumerate(flips) if f], device=device)
        x[idx] = x[idx].flip(-1)
    # channels_last uint8 is NHWC memory: the DeviceLoader's conversion expects exactly that
    return x.to(torch.uint8, memory_format=torch.channels_last).permute(0, 2, 3, 1)


def _cpu_decode(job: JpegJob) -> Optional[torch.Tensor]:
    try:
        with Image.open(io.BytesIO(job.data)) as img:
            return _to_tensor(_rgb(img)).permute(2, 0, 1)
    except Exception:
        return None


def decode_batch(batch: JpegBatch, device: torch.device) -> tuple:
    """Decode a JpegBatch on ``device``.

    Returns ``(images, keep, bad_paths, counts)``: uint8 NHWC images of the readable items,
    a bool list over ``batch.items`` saying which made it, the paths of the unreadable ones,
    and ``{"gpu": n, "cpu": m}`` (images decoded on the device / fallbacks on a CPU).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    jobs = [(i, it) for i, it in enumerate(batch.items) if isinstance(it, JpegJob)]
    decoded: dict = {}
    if jobs:
        with warnings.catch_warnings():
            # decode_jpeg only reads the bytes: view them without a copy (torch warns that
            # a bytes object is not writable)
            warnings.filterwarnings("ignore", message=".*not writable.*")
            datas = [torch.frombuffer(job.data, dtype=torch.uint8) for _, job in jobs]
        try:
            # torchvision's batched decode sends the baseline JPEGs of a list to nvJPEG's hardware backend
            # where the GPU has JPEG engines (A100 and later), the rest one by one to its hybrid
            # software path, on a stream of its own that it synchronises before returning: this
            # thread waits for the batch's decode, the training stream does not.
            images = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one bad file fails the batched call: decode one by one
            images = []
            for data in datas:
                try:
                    images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    images.append(None)
        for (i, job), img in zip(jobs, images):
            decoded[i] = img
    keep, bad = [], []
    counts = {"gpu": 0, "cpu": 0}
    full, ready = [], []  # (output row, CHW image, job) to crop and resize; (row, HWC image) done by a worker
    for i, item in enumerate(batch.items):
        if isinstance(item, CpuDecoded):  # the worker decoded it (not a plain JPEG), HWC uint8
            ready.append((len(full) + len(ready), item.image))
            keep.append(True)
            counts["cpu"] += 1
            continue
        img = decoded.get(i)
        if img is None:
            img = _cpu_decode(item)  # nvJPEG refused it (e.g. a progressive or odd JPEG)
            if img is None:
                bad.append(item.path)
                keep.append(False)
                continue
            img = img.to(device)
            counts["cpu"] += 1
        else:
            counts["gpu"] += 1
        full.append((len(full) + len(ready), img, item))
        keep.append(True)
    if not full and not ready:
        return torch.empty(0, dtype=torch.uint8, device=device), keep, bad, counts
    if gpugeometry.available(device):
        images = _batched(full, ready, device)
    else:
        images = _per_image(full, ready, device)
    return images, keep, bad, counts


def _batched(full: list, ready: list, device: torch.device) -> torch.Tensor:
    """uint8 NHWC batch: every crop/resize/flip in one kernel (see :mod:`imagenet.kernels.gpugeometry`)."""
    size = (full[0][2].out if full else ready[0][1].shape[0])
    out = torch.empty((len(full) + len(ready), size, size, 3), dtype=torch.uint8, device=device)
    samplings = [gpugeometry.Sampling.train(job.box, job.out) if job.kind == "train"
                 else gpugeometry.Sampling.val(img.shape[1], img.shape[2], job.box) for _, img, job in full]
    gpugeometry.crop_resize_flip([img for _, img, _ in full], samplings, [job.flip for *_, job in full],
                                 [row for row, _, _ in full], out)
    if ready:  # already cropped and flipped by the worker
        rows = torch.tensor([row for row, _ in ready]).to(device, non_blocking=True)
        out.index_copy_(0, rows, torch.stack([img for _, img in ready]).to(device, non_blocking=True))
    return out


def _per_image(full: list, ready: list, device: torch.device) -> torch.Tensor:
    """The same batch with torch's own resize, a few kernels per image (no Triton)."""
    images = [None] * (len(full) + len(ready))
    flips = [False] * len(images)
    for row, img, job in full:
        images[row], flips[row] = _geometry(job, img), job.flip
    for row, img in ready:  # the worker's decoder already flipped it
        images[row] = img.to(device, non_blocking=True).permute(2, 0, 1).float()
    return _finish(images, flips, device)
