"""``--decode gpu``: workers read JPEG bytes and draw the crop; the GPU decodes, crops and resizes.

Worker side: read the file once (a tar shard's sample comes already read), parse its header,
draw the crop box and flip from the per-sample seeded RNG exactly as the CPU path does (so
``--seed`` gives the same crops either way), and time each step (:mod:`.account`). The
collate function lays the targets, the geometry kernel's table and the compressed bytes in one
shared-memory buffer: a batch crosses to the training process as one file descriptor, not as
bytes pickled through a pipe.

Device side (:func:`decode_batch`): one batched call of the JPEG decoder (:mod:`.jpeg`;
:func:`decode_images`), then one kernel (:mod:`imagenet.kernels.gpugeometry`;
:func:`finish_batch`) crops, resizes with PIL's antialiased bilinear filter (the CPU path's
pixels within rounding) and flips every image, reading each decoded image where the decoder left
it; without Triton, torch's resize does it image by image. The two halves are separate so that
the background path can run them in two threads (:mod:`imagenet.data.prefetch`).

Fallbacks, counted per epoch: files the GPU decoder does not take as they are (not JPEG, not RGB
or greyscale, progressive: the hardware engines take baseline JPEGs only; EXIF-rotated: TorchCodec
would turn them, the CPU path does not) are decoded in the worker as on the CPU path; a JPEG the
decoder rejects is decoded on the CPU in the training process; a file neither can read is
skipped like any unreadable image. The workers' share of the JPEGs (:mod:`.share`) takes the
fallbacks' path, counted apart.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import get_worker_info

from ...base.torch_private import shared_bytes
from ...kernels import gpugeometry
from . import jpeg as gpujpeg
from ..decode import TrainDecoderReader
from .account import InputAccount
from .share import Credit, DecodeShare

_JPEG_MODES = ("RGB", "L")  # what nvJPEG decodes to RGB reliably; CMYK/YCCK go to the CPU
_ORIENTATION = 0x0112  # the EXIF tag


@dataclass
class JpegJob:
    """One image to decode on the device (worker side; collated into a :class:`JpegBatch`)."""

    data: bytes  # the file
    path: str  # or a tar shard's sample's name: for the report of unreadable images
    # train: (top, left, height, width) crop in full-resolution pixels, then resize to out x out;
    # val: resize to (height, width) first, then crop out x out at (top, left).
    kind: str
    box: tuple
    out: int
    flip: bool = False
    size: tuple = (0, 0)  # (height, width), from the header
    read_s: float = 0.0  # seconds the worker spent reading the file
    parse_s: float = 0.0  # and parsing its header and drawing the crop


@dataclass
class CpuDecoded:
    """An image the worker decoded itself: uint8 HWC, a fallback (not a plain JPEG) or one of the
    workers' share of the JPEGs."""

    image: torch.Tensor
    read_s: float = 0.0  # seconds the worker spent reading the file
    decode_s: float = 0.0  # and decoding it
    shared: bool = False  # a JPEG the GPU would take, decoded here as one of the workers' share


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


def _gpu_decodable(img: Image.Image) -> bool:
    """A baseline RGB or greyscale JPEG without an EXIF rotation: what every GPU decoder turns
    into the CPU path's pixels in one batched call."""
    if img.format != "JPEG" or img.mode not in _JPEG_MODES or img.info.get("progressive"):
        return False
    if "exif" not in img.info:
        return True
    try:
        return img.getexif().get(_ORIENTATION, 1) in (0, 1)
    except Exception:  # EXIF PIL cannot read: a decoder might still turn the image by it
        return False


class TrainJpegReader(TrainDecoderReader):
    """Worker side of the training transform: path (or a shard's sample) -> JpegJob, or the CPU
    decoder's image (the same crop distribution, the same RNG draws): a fallback, or one of the
    workers' share of the JPEGs (``share``: :mod:`.share`; None: every JPEG goes to the GPU)."""

    def __init__(self, cpu_decoder, share: Optional[DecodeShare] = None):
        super().__init__(cpu_decoder)
        self.credit = Credit(share)

    def __call__(self, path):
        data, read_s = _read_bytes(path)
        start = time.perf_counter()
        with Image.open(io.BytesIO(data)) as img:
            decodable = _gpu_decodable(img)
            if not decodable or self.credit.take():  # decoded here from the same bytes
                image = self.cpu.decode(img, *self.cpu.draw(img))  # what self.cpu(path) does
                return CpuDecoded(image, read_s, time.perf_counter() - start, shared=decodable)
            box, flip = self.cpu.draw(img)
            width, height = img.size
        return JpegJob(data, _name(path), "train", box, self.cpu.size, flip, (height, width), read_s,
                       time.perf_counter() - start)


class ValJpegReader:
    """Worker side of the validation transform: Resize(shorter side) + CenterCrop, deferred."""

    def __init__(self, cpu_decoder):
        self.cpu = cpu_decoder  # a decode.ValDecoder

    def __call__(self, path):
        data, read_s = _read_bytes(path)
        start = time.perf_counter()
        with Image.open(io.BytesIO(data)) as img:
            if not _gpu_decodable(img):
                image = self.cpu.decode(img)  # what self.cpu(path) does
                return CpuDecoded(image, read_s, time.perf_counter() - start)
            width, height = img.size
            new_w, new_h, top, left = self.cpu.geometry(width, height)
        return JpegJob(data, _name(path), "val", (top, left, new_h, new_w), self.cpu.size, size=(height, width),
                       read_s=read_s, parse_s=time.perf_counter() - start)


class _Clock:
    """Unpickles as the time it was unpickled: put first among a batch's fields, it starts the
    clock on the batch's own unpickling."""

    def __reduce__(self):
        return time.perf_counter, ()


def _unpickled(started: float, *fields) -> "JpegBatch":
    batch = JpegBatch(*fields)
    batch.handoff = time.perf_counter() - started
    return batch


def _sections(jobs: int, fallbacks: int, size: int) -> tuple:
    """Byte offsets in a batch's blob where the targets end, the table ends, its scales end,
    the fallbacks' pixels start and end (the JPEGs' bytes follow); each aligned for its type."""
    targets_end = (jobs + fallbacks) * 8
    ints_end = targets_end + jobs * gpugeometry.COLUMNS * 8
    scales_end = ints_end + jobs * 2 * 4
    ready_start = -(-scales_end // 8) * 8
    return targets_end, ints_end, scales_end, ready_start, ready_start + fallbacks * size * size * 3


@dataclass(eq=False)
class JpegBatch:
    """A collated batch in one buffer (one file descriptor to the training process, where each
    further tensor costs a round trip to the worker): the targets, the geometry kernel's table
    for the JPEGs, its scales, the images the workers decoded themselves (fallbacks and their
    share of the JPEGs) and the JPEGs' bytes end to end. Rows (the table's ``ROW`` column, ``ready_rows``) are places in
    the batch, the targets' order. ``targets``, ``ints``, ``scales``, ``ready`` and ``data``
    view the blob."""

    blob: torch.Tensor  # uint8
    lengths: list  # bytes of each JPEG
    ready_rows: list  # places of the images the workers decoded
    size: int  # output pixels a side
    paths: list  # of the JPEGs, for the report of unreadable ones
    worker_seconds: tuple = ()  # the workers' (read, parse, fallback, collate, share) over the batch
    shared: int = 0  # of the images the workers decoded, those of their share of the JPEGs
    handoff: float = 0.0  # seconds unpickling it in the training process (set on arrival)

    def __post_init__(self):
        jobs, n = len(self.lengths), len(self.ready_rows)
        targets_end, ints_end, scales_end, ready_start, ready_end = _sections(jobs, n, self.size)
        self.targets = self.blob[:targets_end].view(torch.int64)
        self.ints = self.blob[targets_end:ints_end].view(torch.int64).view(jobs, gpugeometry.COLUMNS)
        self.scales = self.blob[ints_end:scales_end].view(torch.float32).view(jobs, 2)
        self.ready = self.blob[ready_start:ready_end].view(n, self.size, self.size, 3)
        self.data = self.blob[ready_end:]

    def __len__(self) -> int:
        return len(self.lengths) + len(self.ready_rows)

    def pin_memory(self, device=None) -> "JpegBatch":
        """The DataLoader's pin-memory thread leaves it as it is: the decoder reads the bytes on
        the host, and the table is pinned where it is used (a copy, its addresses filled in)."""
        return self

    def __reduce__(self):
        return _unpickled, (_Clock(), self.blob, self.lengths, self.ready_rows, self.size, self.paths,
                            self.worker_seconds, self.shared)

    @staticmethod
    def collate(items: list, targets: Optional[list] = None) -> "JpegBatch":
        """Runs in the worker: ``items`` (JpegJob or CpuDecoded, in batch order) and their
        ``targets`` (class indices; default 0) -> one batch whose blob is made in shared memory
        (not copied again on its way to the training process)."""
        start = time.perf_counter()
        jobs = [(row, it) for row, it in enumerate(items) if isinstance(it, JpegJob)]
        fallbacks = [(row, it) for row, it in enumerate(items) if isinstance(it, CpuDecoded)]
        lengths = [len(job.data) for _, job in jobs]
        size = jobs[0][1].out if jobs else fallbacks[0][1].image.shape[0]
        total = _sections(len(jobs), len(fallbacks), size)[-1] + sum(lengths)
        blob = shared_bytes(total) if get_worker_info() is not None else torch.empty(total, dtype=torch.uint8)
        batch = JpegBatch(blob, lengths, [row for row, _ in fallbacks], size, [job.path for _, job in jobs],
                          shared=sum(f.shared for _, f in fallbacks))
        samplings = [gpugeometry.Sampling.train(job.box, job.out) if job.kind == "train"
                     else gpugeometry.Sampling.val(*job.size, job.box) for _, job in jobs]
        ints, scales = gpugeometry.table([job.size for _, job in jobs], samplings, [job.flip for _, job in jobs],
                                         [row for row, _ in jobs])
        batch.targets.copy_(torch.tensor(targets if targets is not None else [0] * len(items), dtype=torch.int64))
        batch.ints.copy_(ints)
        batch.scales.copy_(scales)
        if fallbacks:
            torch.stack([f.image for _, f in fallbacks], out=batch.ready)
        buffer, offset = memoryview(batch.data.numpy()), 0
        for n, (_, job) in zip(lengths, jobs):
            buffer[offset:offset + n] = job.data
            offset += n
        read = sum(job.read_s for _, job in jobs) + sum(f.read_s for _, f in fallbacks)
        decoded = [sum(f.decode_s for _, f in fallbacks if f.shared == shared) for shared in (False, True)]
        batch.worker_seconds = (read, sum(job.parse_s for _, job in jobs), decoded[0], time.perf_counter() - start,
                                decoded[1])
        return batch


def _resized(img: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 CHW -> float CHW of (height, width), antialiased bilinear (PIL's filter when
    shrinking); not yet rounded (the batch is rounded once, in :func:`_finish`)."""
    x = img[None].float()
    if img.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x[0]


def _finish(images: list, flips: list, device: torch.device) -> torch.Tensor:
    """Float CHW images -> one uint8 NHWC batch: rounded, clamped and flipped for the whole
    batch at once (a handful of kernels instead of five per image)."""
    x = torch.stack(images).round_().clamp_(0, 255)
    if any(flips):
        idx = torch.tensor([i for i, f in enumerate(flips) if f], device=device)
        x[idx] = x[idx].flip(-1)
    # channels_last uint8 is NHWC memory: the DeviceLoader's conversion expects exactly that
    return x.to(torch.uint8, memory_format=torch.channels_last).permute(0, 2, 3, 1)


class Decoded(NamedTuple):
    """What :func:`decode_batch` made of a batch."""

    images: torch.Tensor  # uint8 NHWC of the readable items, in batch order
    keep: list  # bool per item of the batch: whether it made it
    bad: list  # paths of the unreadable ones
    counts: dict  # {"gpu": decoded on the device, "cpu": fallbacks decoded on a CPU, "share": the workers' share}


class DecodedJpegs(NamedTuple):
    """A batch's JPEGs decoded (:func:`decode_images`), not yet cropped (:func:`finish_batch`)."""

    batch: JpegBatch
    images: list  # per JPEG of the batch: CHW uint8 on the device, None where nothing could read it
    counts: dict  # {"gpu": by the decoder, "cpu": fallbacks on a CPU (the workers' and ours), "share": as above}


def decode_images(batch: JpegBatch, device: torch.device, decoder: Optional[gpujpeg.JpegDecoder] = None,
                  account: Optional[InputAccount] = None) -> DecodedJpegs:
    """The first half of :func:`decode_batch`: the decoder's one call over the batch's JPEGs, and
    the CPU's decode of those it refused; ``account``: where the call's time goes."""
    decoder = decoder or gpujpeg.require()
    account = account or InputAccount()
    views = list(batch.data.split(batch.lengths)) if batch.lengths else []
    t0, c0 = time.perf_counter(), time.thread_time()
    images = decoder.decode(views, device)
    account.add("decode", time.perf_counter() - t0)
    account.add("decode_cpu", time.thread_time() - c0)
    counts = {"gpu": len(images), "cpu": len(batch.ready_rows) - batch.shared, "share": batch.shared}
    # the kernel reads each image as the header said, in CHW planes: an image of another shape (a
    # decoder that turned it after all) is decoded again on the CPU, as a refused one is
    sizes = batch.ints[:, gpugeometry.HEIGHT:gpugeometry.WIDTH + 1].tolist()
    for k, (img, size) in enumerate(zip(images, sizes)):
        if img is not None and list(img.shape) != [3, *size]:
            images[k] = None
    for k in [k for k, img in enumerate(images) if img is None]:  # the decoder refused it (an odd JPEG)
        counts["gpu"] -= 1
        img = gpujpeg.pil_decode(views[k])
        if img is not None:
            images[k] = img.to(device)
            counts["cpu"] += 1
    return DecodedJpegs(batch, images, counts)


def finish_batch(decoded: DecodedJpegs, device: torch.device, account: Optional[InputAccount] = None) -> Decoded:
    """The second half of :func:`decode_batch`: every decoded image cropped, resized and flipped
    into one batch beside the workers' fallbacks, the unreadable ones left out; ``account``:
    where the kernel's GPU time goes."""
    account = account or InputAccount()
    batch, images, counts = decoded
    bad_jobs = [k for k, img in enumerate(images) if img is None]
    ints, scales, ready_rows = batch.ints, batch.scales, batch.ready_rows
    keep = [True] * len(batch)
    if bad_jobs:
        for k in bad_jobs:
            keep[int(ints[k, gpugeometry.ROW])] = False
        alive = torch.tensor([img is not None for img in images])
        images = [img for img in images if img is not None]
        row_of = torch.tensor(keep).cumsum(0) - 1  # a place in the batch -> its row among the kept
        ints, scales = ints[alive], scales[alive]  # copies: the batch's own table stays as it came
        ints[:, gpugeometry.ROW] = row_of[ints[:, gpugeometry.ROW]]
        ready_rows = row_of[torch.tensor(ready_rows, dtype=torch.long)].tolist()
    rows = len(images) + len(ready_rows)
    bad = [batch.paths[k] for k in bad_jobs]
    if not rows:
        return Decoded(torch.empty(0, dtype=torch.uint8, device=device), keep, bad, counts)
    with account.gpu("geometry"):
        if gpugeometry.available(device):
            out = _batched(images, ints, scales, batch.ready, ready_rows, batch.size, device)
        else:
            out = _per_image(images, ints, scales, batch.ready, ready_rows, batch.size, device)
    return Decoded(out, keep, bad, counts)


def decode_batch(batch: JpegBatch, device: torch.device, decoder: Optional[gpujpeg.JpegDecoder] = None,
                 account: Optional[InputAccount] = None) -> Decoded:
    """Decode a JpegBatch on ``device`` with ``decoder`` (default: :func:`gpujpeg.require`);
    ``account``: where the decoder call's and the kernel's time go. :func:`decode_images` then
    :func:`finish_batch`, which the background path runs in two threads."""
    account = account or InputAccount()
    return finish_batch(decode_images(batch, device, decoder, account), device, account)


def _batched(images: list, ints: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, ready_rows: list,
             size: int, device: torch.device) -> torch.Tensor:
    """uint8 NHWC batch: every crop/resize/flip in one kernel (see :mod:`imagenet.kernels.gpugeometry`),
    each image read where it lies (a CHW uint8 view on ``device``, of any strides): the table's SRC
    is its address relative to the first image's, which the kernel takes as its base pointer."""
    out = torch.empty((len(images) + len(ready_rows), size, size, 3), dtype=torch.uint8, device=device)
    if images:
        # copies of the table (pinned on a GPU: they go over without a host wait), its SRC filled in
        ints, scales = (ints.pin_memory(), scales.pin_memory()) if device.type == "cuda" else (ints.clone(), scales)
        # each image's address and strides as the decoder laid it out (CHW planes, or a CHW view of
        # interleaved HWC pixels with a padded row pitch)
        layout = torch.tensor([[img.data_ptr(), img.stride(2), img.stride(0), img.stride(1)] for img in images],
                              dtype=torch.int64)
        layout[:, 0] -= layout[0, 0].clone()
        ints[:, [gpugeometry.SRC, gpugeometry.PIXEL, gpugeometry.CHANNEL, gpugeometry.LINE]] = layout
        gpugeometry.launch(images[0], ints.to(device, non_blocking=True), scales.to(device, non_blocking=True), out)
    if ready_rows:  # already cropped and flipped by the worker
        rows = torch.tensor(ready_rows).to(device, non_blocking=True)
        out.index_copy_(0, rows, ready.to(device, non_blocking=True))
    return out


def _per_image(images: list, ints: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, ready_rows: list,
               size: int, device: torch.device) -> torch.Tensor:
    """The same batch with torch's own resize, a few kernels per image (no Triton), from the
    same table: the region at (TOP, LEFT), resized by the table's scales, cropped at (OFF_Y, OFF_X)."""
    G = gpugeometry
    out: list = [None] * (len(images) + len(ready_rows))
    flips = [False] * len(out)
    for img, r, (sy, sx) in zip(images, ints.tolist(), scales.tolist()):
        region = img[:, r[G.TOP]:r[G.TOP] + r[G.REGION_H], r[G.LEFT]:r[G.LEFT] + r[G.REGION_W]]
        resized = _resized(region, round(r[G.REGION_H] / sy), round(r[G.REGION_W] / sx))
        out[r[G.ROW]] = resized[:, r[G.OFF_Y]:r[G.OFF_Y] + size, r[G.OFF_X]:r[G.OFF_X] + size]
        flips[r[G.ROW]] = bool(r[G.FLIP])
    for row, img in zip(ready_rows, ready):  # the worker's decoder already flipped it
        out[row] = img.to(device, non_blocking=True).permute(2, 0, 1).float()
    return _finish(out, flips, device)
