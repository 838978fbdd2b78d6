"""Batches onto the device: copied one batch ahead on a side stream, normalised there.

Loaders yield ``(images, targets, skipped_paths)``. uint8 NHWC images (the fast decode path)
are converted to float and normalised on the device (where the device is the CPU, the workers
do it instead: :class:`imagenet.data.loaders.CollateNormalized`); the NHWC layout is already channels_last
memory, so that layout costs nothing. Float NCHW images (the classic torchvision transforms,
synthetic data) pass through, laid out as asked.

With ``background=True`` (``--decode gpu``) two threads prepare the batches, up to ``depth``
ahead of the step. The first ("batch-decode") takes each batch from the DataLoader and makes the
decoder's one call over its JPEGs; the second ("batch-finish") lays out the geometry kernel's
table and launches the crops, resizes and normalisation on a high-priority stream of its own.
The decoder call waits on the host for its decode: in the training thread it would hold up the
step's own launches, and in one thread with the rest, the rest (the table, its pinned copies, the
launches) would add to it; in two threads the decoder call is all the first one does, and the
next batch decodes while this one is finished. One decode thread is enough: the decoder takes a
whole batch per call, and more calls side by side did not raise the rate (docs/INPUT.md). The
threads keep an account of their waits and work, of the GPU time of their kernels and of the
workers' own times that came with each batch (:mod:`imagenet.data.gpu.account`), read per epoch
with :meth:`DeviceLoader.stage_account`; the decode thread's own time steers the share of the
training JPEGs the workers decode instead (:mod:`imagenet.data.gpu.share`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Iterator, Optional, Sequence

import torch

from ..base.torch_private import shutdown_workers
from .gpu import jpeg as gpujpeg
from .images.cropbatch import CropBatch
from .gpu.decode import DecodedJpegs, JpegBatch, decode_images, finish_batch
from .gpu.account import InputAccount
from .gpu.share import DecodeShare


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
                 decoder: Optional[gpujpeg.JpegDecoder] = None, share: Optional[DecodeShare] = None):
        self.loader = loader
        self.background = background
        self.depth = depth
        self.device = device
        self.channels_last = channels_last
        self.normalize = Normalize(mean, std, device)
        self.decoder = decoder  # --decode gpu's JPEG decoder (found at the first batch if None)
        self.share = share  # the workers' share of the JPEGs, which the decode thread steers (--decode-share auto)
        self._counts = {"gpu": 0, "cpu": 0, "share": 0}
        self.account = InputAccount(cuda=device.type == "cuda")  # the background threads' (--decode gpu)

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """End the DataLoader's persistent workers (the run's end): otherwise they live until the
        loader is collected, which a kept exception's traceback or a reference cycle delays."""
        shutdown_workers(self.loader)

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
        """Images decoded on the device / on a CPU instead / by the workers as their share of the JPEGs
        (``--decode gpu``) since the last call."""
        counts, self._counts = self._counts, {"gpu": 0, "cpu": 0, "share": 0}
        return counts

    def stage_account(self) -> dict:
        """Milliseconds per batch in each stage of the background threads' input path since the
        last call (:meth:`imagenet.data.gpu.account.InputAccount.take`; empty on the other paths)."""
        return self.account.take()

    def _to_device(self, batch) -> tuple:
        """(images, targets, skipped, decode counts) on the device."""
        return self._finish(self._decode(batch))

    def _decode(self, batch) -> tuple:
        """A batch's first stage: its JPEGs decoded (a :class:`DecodedJpegs` in place of the
        JpegBatch); any other batch as it came."""
        images, targets, skipped = batch
        if isinstance(images, JpegBatch) and targets.numel():
            self.decoder = self.decoder or gpujpeg.require()
            return decode_images(images, self.device, self.decoder, self.account), targets, skipped
        return batch

    def _finish(self, batch) -> tuple:
        """A batch's second stage, after :meth:`_decode`: (images, targets, skipped, decode
        counts) on the device."""
        images, targets, skipped = batch
        counts = None
        if targets.numel() == 0:
            return images, targets, skipped, counts
        if isinstance(images, DecodedJpegs):
            images, keep, bad, counts = finish_batch(images, self.device, self.account)
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
        # the decoder writes from a stream of its own: this one has only the copies of the JPEGs
        # it refused (decoded on the CPU), so the decoder's wait for it to drain costs nothing
        decode_stream = torch.cuda.Stream(self.device) if cuda else None
        # high priority: the batch's small crop/resize kernels go ahead of the training step's
        # queued kernels instead of waiting for gaps in them
        finish_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        decoded: queue.Queue = queue.Queue(maxsize=1)  # one decoded batch waiting to be finished
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        threads = [threading.Thread(target=self._decode_stage, args=(iter(self.loader), decode_stream, decoded, stop),
                                    name="batch-decode", daemon=True),
                   threading.Thread(target=self._finish_stage, args=(decoded, finish_stream, ready, stop),
                                    name="batch-finish", daemon=True)]
        for thread in threads:
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
            # The decode thread must be done with the loader's iterator before anyone makes a new
            # one (persistent workers reuse it): stop both threads and wait for the batches they
            # are on. The DataLoader notices dead workers within seconds, so the wait is bounded;
            # the limit only keeps an interrupted run from hanging at exit.
            stop.set()
            deadline = time.monotonic() + 120
            for thread in threads:
                thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _decode_stage(self, it: Iterator, stream, decoded: queue.Queue, stop: threading.Event) -> None:
        """The first thread: each batch of ``it`` (the loader's) with its JPEGs decoded
        (:meth:`_decode`) on ``stream``, put in ``decoded`` as ("batch", batch, event: the end of
        its work on ``stream``), then ("end", None, None), or ("error", e, None). Its account is
        the decode thread's: waiting for the workers, busy, waiting for room, its CPU time."""
        account = self.account
        try:
            with _on(self.device, stream):
                clock, cpu, first = time.perf_counter(), time.thread_time(), True
                for batch in it:
                    arrived = time.perf_counter()
                    if stop.is_set():
                        return
                    starved = 0.0 if first else arrived - clock  # the first wait is the workers starting up
                    account.add("starved", starved)
                    images = batch[0]
                    if isinstance(images, JpegBatch):
                        account.batch(images.worker_seconds, images.handoff, len(images), images.shared)
                    else:
                        account.batch()
                    item = ("batch", self._decode(batch), _recorded(stream))
                    made = time.perf_counter()
                    account.add("busy", made - arrived)
                    if not _offer(decoded, item, stop):
                        return
                    del item  # the finishing thread's now: its images are freed when it is done
                    clock = time.perf_counter()
                    account.add("ahead", clock - made)  # room only once the finishing thread took the last
                    if self.share is not None and not first:
                        self.share.observe(made - arrived, starved + clock - made)
                    first = False
                    account.add("thread_cpu", time.thread_time() - cpu)
                    cpu = time.thread_time()
            _offer(decoded, ("end", None, None), stop)
        except BaseException as e:  # a worker's error, a dead worker: raised again in the training thread
            _offer(decoded, ("error", e, None), stop)

    def _finish_stage(self, decoded: queue.Queue, stream, ready: queue.Queue, stop: threading.Event) -> None:
        """The second thread: each item of ``decoded`` finished (:meth:`_finish`) on ``stream``
        and put in ``ready`` as ("batch", prepared, event), in order; the end or an error of the
        first thread passed on as it came, or ("error", e, None) of its own."""
        account = self.account
        try:
            with _on(self.device, stream):
                while True:
                    item = _take(decoded, stop)
                    if item is None:  # stopped
                        return
                    if item[0] != "batch":
                        _offer(ready, item, stop)
                        return
                    start = time.perf_counter()
                    prepared = self._finish_one(item, stream)
                    del item  # its decoded images: free once this stream is past the kernel reading them
                    made = time.perf_counter()
                    account.add("finish_busy", made - start)
                    if not _offer(ready, prepared, stop):
                        return
                    account.add("finish_ahead", time.perf_counter() - made)
        except BaseException as e:
            _offer(ready, ("error", e, None), stop)

    def _finish_one(self, item: tuple, stream) -> tuple:
        """("batch", prepared, event) of one item of the decode thread, finished on ``stream``."""
        _, batch, decode_done = item
        if stream is not None:
            # The decoded images were allocated on the decode stream (the decoder op allocates on
            # its caller's stream and writes from a pool stream of its own, returning once done;
            # the CPU-decoded ones are copied on the decode stream): this stream waits for that
            # stream's work. The caching allocator would hand an image's memory back to the
            # decode stream as soon as the last reference here goes, while the geometry kernel
            # on this stream may still be reading it, and the decoder's next batch, which no
            # stream ordering covers (its writes come from its own stream), could be written
            # there. record_stream makes the allocator wait, at the free, for this stream to
            # pass everything queued on it by then, the kernel included. The decoder's drain of
            # the decode stream covers what that stream itself queued.
            stream.wait_event(decode_done)
            images = batch[0]
            if isinstance(images, DecodedJpegs):
                for img in images.images:
                    if img is not None:
                        img.record_stream(stream)
        prepared = self._finish(batch)
        return "batch", prepared, _recorded(stream)


def _on(device: torch.device, stream):
    """The context of a background thread: ``stream`` current on ``device`` (nothing without a stream)."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _recorded(stream) -> Optional[torch.cuda.Event]:
    """An event at the end of the work queued on ``stream`` so far (None without a stream)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _offer(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` in ``q`` once there is room; False if ``stop`` came first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _take(q: queue.Queue, stop: threading.Event):
    """The next item of ``q``; None if ``stop`` came first."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue
    return None


def _used_on(main: torch.cuda.Stream, batch: tuple) -> tuple:
    """A batch made on a side stream, handed to ``main``: its memory is kept until main is done."""
    images, targets, _ = batch
    if targets.numel():
        images.record_stream(main)
        targets.record_stream(main)
    return batch
