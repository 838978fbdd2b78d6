"""Batches onto the device: copied one batch ahead on a side stream, normalised there.

Loaders yield ``(images, targets, skipped_paths)``. uint8 NHWC images (the fast decode path)
are converted to float and normalised on the device (where the device is the CPU, the workers
do it instead: :class:`imagenet.data.loaders.CollateNormalized`); the NHWC layout is already channels_last
memory, so that layout costs nothing. Float NCHW images (the classic torchvision transforms,
synthetic data) pass through, laid out as asked.

With ``background=True`` (``--decode gpu``) a thread takes the batches from the DataLoader and
prepares them -- nvJPEG decode, crops, resizes -- on its own stream, up to ``depth`` batches
ahead; with ``decode_threads=N`` (``IMAGENET_DECODE_THREADS``) N threads do so side by side, each
on its own stream, and the loop still gets the batches in the loader's order. The decoder call
waits on the host for its decode; in the training thread it would hold up the step's own
launches. The threads keep an account of their waits for the workers and their work, of the GPU
time of their kernels (events, read once done) and of the workers' own times that came with each
batch (:mod:`imagenet.data.inputaccount`), read per epoch with :meth:`DeviceLoader.stage_account`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator, Optional, Sequence

import torch

from ..base.errors import UserError
from . import gpujpeg
from .cropbatch import CropBatch
from .gpudecode import JpegBatch, decode_batch
from .inputaccount import InputAccount


DECODE_THREADS_ENV = "IMAGENET_DECODE_THREADS"


def decode_threads() -> int:
    """``--decode gpu``'s decode threads: ``$IMAGENET_DECODE_THREADS`` (for measurements), else 1."""
    value = os.environ.get(DECODE_THREADS_ENV, "1") or "1"
    if not value.isdigit() or not 1 <= int(value) <= 16:
        raise UserError(f"{DECODE_THREADS_ENV}={value!r}: give the number of threads that prepare --decode gpu's "
                        "batches side by side, 1 to 16 (default 1)")
    return int(value)


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
                 decoder: Optional[gpujpeg.JpegDecoder] = None, decode_threads: int = 1):
        self.loader = loader
        self.background = background
        self.depth = depth
        self.decode_threads = decode_threads  # background: threads preparing batches side by side
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
        last call (:meth:`imagenet.data.inputaccount.InputAccount.take`; empty on the other paths)."""
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
        stage = _DecodeStage(self, cuda)
        main = torch.cuda.current_stream(self.device) if cuda else None
        try:
            first = True
            while True:
                asked = time.perf_counter()
                kind, prepared, event = stage.next()
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
            stage.close()


class _DecodeStage:
    """``--decode gpu``'s background stage: ``threads`` threads take the loader's batches in turn
    and prepare them side by side, each on a high-priority stream of its own (the batch's small
    crop/resize kernels go ahead of the training step's queued kernels instead of waiting for gaps
    in them: at normal priority the step waited for its next batch); :meth:`next` hands them out
    in the loader's order. A thread holds a prepared batch until it is among the next ``depth``
    to go out, so the batches made ahead stay bounded and the one the loop waits for always has
    room. Each thread keeps the account of its waits and work (:mod:`.inputaccount`: with several
    threads the stages sum their times)."""

    def __init__(self, loader: "DeviceLoader", cuda: bool):
        self.loader, self.cuda, self.depth = loader, cuda, loader.depth
        self.it = iter(loader.loader)
        self.taking = threading.Lock()  # the DataLoader's iterator is not thread-safe
        self.changed = threading.Condition()  # guards the fields below
        self.taken = 0  # batches taken from the iterator: the next one's place
        self.given = 0  # batches handed out: the next one to go
        self.end: Optional[int] = None  # the place where the iterator ended (or failed)
        self.done: dict = {}  # place -> ("batch", prepared, event) or ("error", exception, None)
        self.stop = threading.Event()
        threads = max(1, loader.decode_threads)
        loader.account.threads = threads
        self.threads = [threading.Thread(target=self._run, name=f"batch-prepare-{k}", daemon=True)
                        for k in range(threads)]
        for t in self.threads:
            t.start()

    def _take(self) -> tuple:
        """(place, batch) of the loader's next batch: batch None at its end, or the exception the
        iterator raised (the place is this batch's, so the error goes out in order)."""
        with self.taking:
            place = self.taken
            if self.end is not None and place >= self.end:
                return place, None
            try:
                batch = next(self.it)
            except StopIteration:
                self._finish(place)
                return place, None
            except BaseException as e:  # a worker's error, a dead worker
                batch = e
            self.taken += 1
            return place, batch

    def _finish(self, end: int, item: Optional[tuple] = None) -> None:
        """Nothing goes out from ``end`` on; ``item`` (an error) goes out at ``end - 1``."""
        with self.changed:
            if item is not None:
                self.done[end - 1] = item
            self.end = end if self.end is None else min(self.end, end)
            self.changed.notify_all()

    def _put(self, place: int, item: tuple) -> bool:
        """Hand ``item`` over once ``place`` is among the next ``depth`` to go out; False if stopped."""
        with self.changed:
            while place >= self.given + self.depth and not self.stop.is_set():
                self.changed.wait(0.1)
            if self.stop.is_set():
                return False
            self.done[place] = item
            self.changed.notify_all()
            return True

    def _run(self) -> None:
        loader, account = self.loader, self.loader.account
        place = None
        try:
            stream = torch.cuda.Stream(loader.device, priority=-1) if self.cuda else None
            with torch.cuda.device(loader.device) if self.cuda else contextlib.nullcontext(), \
                    torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
                cpu, first = time.thread_time(), True
                while not self.stop.is_set():
                    clock = time.perf_counter()
                    place, batch = self._take()
                    if batch is None:
                        return
                    if isinstance(batch, BaseException):
                        raise batch
                    arrived = time.perf_counter()
                    if not first:  # a thread's first wait is the workers starting up
                        account.add("starved", arrived - clock)
                    first = False
                    images = batch[0]
                    if isinstance(images, JpegBatch):
                        account.batch(images.worker_seconds, images.handoff)
                    else:
                        account.batch()
                    prepared = loader._to_device(batch)
                    event = None
                    if self.cuda:
                        event = torch.cuda.Event()
                        event.record(stream)
                    made = time.perf_counter()
                    account.add("busy", made - arrived)
                    if not self._put(place, ("batch", prepared, event)):
                        return
                    place = None
                    account.add("ahead", time.perf_counter() - made)  # room only once the step took one
                    account.add("thread_cpu", time.thread_time() - cpu)
                    cpu = time.thread_time()
        except BaseException as e:  # raised again in the training thread, at this batch's place
            if place is None:  # before taking a batch: a place of its own, the next one
                with self.taking:
                    place, self.taken = self.taken, self.taken + 1
            self._finish(place + 1, ("error", e, None))

    def next(self) -> tuple:
        """The next batch in the loader's order: ("batch", prepared, event), ("error", e, None) or
        ("end", None, None)."""
        with self.changed:
            while self.given not in self.done:
                if self.end is not None and self.given >= self.end:
                    return "end", None, None
                self.changed.wait(0.1)
            item = self.done.pop(self.given)
            self.given += 1
            self.changed.notify_all()
            return item

    def close(self) -> None:
        """Stop the threads and wait for the batches they are on: the loader's iterator must be
        done with before anyone makes a new one (persistent workers reuse it). The DataLoader
        notices dead workers within seconds, so the wait is bounded; the limit only keeps an
        interrupted run from hanging at exit."""
        self.stop.set()
        with self.changed:
            self.changed.notify_all()
        for t in self.threads:
            t.join(timeout=120)


def _used_on(main: torch.cuda.Stream, batch: tuple) -> tuple:
    """A batch made on a side stream, handed to ``main``: its memory is kept until main is done."""
    images, targets, _ = batch
    if targets.numel():
        images.record_stream(main)
        targets.record_stream(main)
    return batch
