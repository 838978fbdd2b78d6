"""Batches onto the device: copied one batch ahead on a side stream, normalised there.

Loaders yield ``(images, targets, skipped_paths)``. uint8 NHWC images (the fast decode path)
are converted to float and normalised on the device (where the device is the CPU, the workers
do it instead: :class:`imagenet.data.loaders.CollateNormalized`); the NHWC layout is already channels_last
memory, so that layout costs nothing. Float NCHW images (the classic torchvision transforms,
synthetic data) pass through, laid out as asked.

With ``background=True`` (``--decode gpu``) one thread takes the batches from the DataLoader
and prepares them -- the JPEG decode, crops, resizes -- on a high-priority stream of its own,
up to ``depth`` batches ahead. The decoder call waits on the host for its decode: in the
training thread it would hold up the step's own launches. One thread is enough: the decoder
takes a whole batch per call, and more calls side by side did not raise the rate (docs/INPUT.md).
The thread keeps an account of its waits and work, of the GPU time of its kernels and of the
workers' own times that came with each batch (:mod:`imagenet.data.gpu.account`), read per
epoch with :meth:`DeviceLoader.stage_account`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Iterator, Optional, Sequence

import torch

from .gpu import jpeg as gpujpeg
from .images.cropbatch import CropBatch
from .gpu.decode import JpegBatch, decode_batch
from .gpu.account import InputAccount


class Normalize:
    """uint8 NHWC images -> float NCHW (channels_last memory), ``(x / 255 - mean) / std``, on
    ``device``, as ``shift + x * scale`` in one kernel (``addcmul`` promotes the uint8 input):
    one pass writing the float batch, where a conversion, a multiply and an add made three."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device = torch.device("cpu")):
        std_t = torch.tensor(std, dtype=torch.float32)
        self.scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1).to(device)
        self.shift = (-torch.tensor(mean, dtype=torch.float32) / std_t).view(1, 3, 1, 1).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        # NHWC memory == channels_last NCHW, and the result keeps that layout
        return torch.addcmul(self.shift, images.permute(0, 3, 1, 2), self.scale)


def is_uint8_batch(images) -> bool:
    return isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 4


class DeviceLoader:
    """Wraps a DataLoader; iterating yields device-ready ``(images, targets, skipped)``."""

    def __init__(self, loader, device: torch.device, channels_last: bool, mean: Sequence[float],
                 std: Sequence[float], background: bool = False, depth: int = 2,
                 decoder: Optional[gpujpeg.JpegDecoder] = None):
        self.loader = loader
        self.background = background
        self.depth = depth
        self.device = device
        self.channels_last = channels_last
        self.normalize = Normalize(mean, std, device)
        self.decoder = decoder  # --decode gpu's JPEG decoder (found at the first batch if None)
        self._counts = {"gpu": 0, "cpu": 0}
        self.account = InputAccount(cuda=device.type == "cuda")  # the background thread's (--decode gpu)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    def _convert(self, images: torch.Tensor) -> torch.Tensor:
        if is_uint8_batch(images):
            images = self.normalize(images)
        if images.dim() == 4:  # a no-op where the layout already is the one asked for
            return images.contiguous(memory_format=torch.channels_last if self.channels_last
                                     else torch.contiguous_format)
        return images

    def decode_counts(self) -> dict:
        """Images decoded on the device / on a CPU instead (``--decode gpu``) since the last call."""
        counts, self._counts = self._counts, {"gpu": 0, "cpu": 0}
        return counts

    def stage_account(self) -> dict:
        """Milliseconds per batch in each stage of the background thread's input path since the
        last call (:meth:`imagenet.data.gpu.account.InputAccount.take`; empty on the other paths)."""
        return self.account.take()

    def _to_device(self, batch) -> tuple:
        """(images, targets, skipped, decode counts) on the device."""
        images, targets, skipped = batch
        counts = None
        if targets.numel() == 0:
            return images, targets, skipped, counts
        if isinstance(images, JpegBatch):
            self.decoder = self.decoder or gpujpeg.require()
            images, keep, bad, counts = decode_batch(images, self.device, self.decoder, self.account)
            if bad:
                targets = targets[torch.tensor(keep)]
                skipped = skipped + bad
            if targets.numel() == 0:
                return torch.empty(0), targets, skipped, counts
            targets = targets.to(self.device, non_blocking=True)
            with self.account.gpu("normalise"):
                images = self._convert(images)
            return images, targets, skipped, counts
        if isinstance(images, CropBatch):  # --decode cpu's crops, resized and flipped here
            images = images.to_device(self.device)
        else:
            images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        return self._convert(images), targets, skipped, counts

    def _yielded(self, batch: tuple) -> tuple:
        # Counted when the loop takes the batch, not when it was prepared one ahead.
        *batch, counts = batch
        if counts:
            for k, v in counts.items():
                self._counts[k] += v
        return tuple(batch)

    def __iter__(self) -> Iterator[tuple]:
        if self.background:
            yield from self._in_background()
            return
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._yielded(self._to_device(batch))
            return
        yield from self._prefetching()

    def _prefetching(self) -> Iterator[tuple]:
        stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        it = iter(self.loader)

        def load():
            try:
                batch = next(it)
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                return self._to_device(batch)

        upcoming = load()
        while upcoming is not None:
            main.wait_stream(stream)
            current = _used_on(main, self._yielded(upcoming))
            upcoming = load()  # the next copy overlaps this batch's compute
            yield current

    def _in_background(self) -> Iterator[tuple]:
        cuda = self.device.type == "cuda"
        # high priority: the batch's small crop/resize kernels go ahead of the training step's
        # queued kernels instead of waiting for gaps in them
        stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._prepare, args=(iter(self.loader), stream, ready, stop),
                                  name="batch-prepare", daemon=True)
        thread.start()
        main = torch.cuda.current_stream(self.device) if cuda else None
        try:
            first = True
            while True:
                asked = time.perf_counter()
                kind, prepared, event = ready.get()
                if not first:  # the first is the workers starting up
                    self.account.add("train_wait", time.perf_counter() - asked)
                first = False
                if kind == "end":
                    return
                if kind == "error":
                    raise prepared
                current = self._yielded(prepared)
                if cuda:
                    main.wait_event(event)
                    current = _used_on(main, current)
                yield current
        finally:
            # The thread must be done with the loader's iterator before anyone makes a new one
            # (persistent workers reuse it): stop it and wait for the batch it is on. The
            # DataLoader notices dead workers within seconds, so the wait is bounded; the limit
            # only keeps an interrupted run from hanging at exit.
            stop.set()
            thread.join(timeout=120)

    def _prepare(self, it: Iterator, stream, ready: queue.Queue, stop: threading.Event) -> None:
        """The background thread: each batch of ``it`` (the loader's) prepared on ``stream``, put in
        ``ready`` as ("batch", prepared, event), then ("end", None, None), or ("error", e, None)."""
        account = self.account

        def offer(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            with torch.cuda.device(self.device) if stream is not None else contextlib.nullcontext(), \
                    torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                clock, cpu, first = time.perf_counter(), time.thread_time(), True
                for batch in it:
                    arrived = time.perf_counter()
                    if not first:  # the first wait is the workers starting up
                        account.add("starved", arrived - clock)
                    first = False
                    images = batch[0]
                    if isinstance(images, JpegBatch):
                        account.batch(images.worker_seconds, images.handoff)
                    else:
                        account.batch()
                    prepared = self._to_device(batch)
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    made = time.perf_counter()
                    account.add("busy", made - arrived)
                    if not offer(("batch", prepared, event)):
                        return
                    clock = time.perf_counter()
                    account.add("ahead", clock - made)  # room in the queue only once the step took one
                    account.add("thread_cpu", time.thread_time() - cpu)
                    cpu = time.thread_time()
            offer(("end", None, None))
        except BaseException as e:  # a worker's error, a dead worker: raised again in the training thread
            offer(("error", e, None))


def _used_on(main: torch.cuda.Stream, batch: tuple) -> tuple:
    """A batch made on a side stream, handed to ``main``: its memory is kept until main is done."""
    images, targets, _ = batch
    if targets.numel():
        images.record_stream(main)
        targets.record_stream(main)
    return batch
