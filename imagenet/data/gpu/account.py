"""Where a ``--decode gpu`` training batch's time goes, per stage, summed over an epoch.

Stages (their meanings beside :data:`STAGES`): the workers' (one worker's seconds for the whole
batch; ``-j`` of them work side by side), the decode thread's
(:class:`imagenet.data.prefetch.DeviceLoader`'s first background thread, the one that calls the
decoder: all of its time and parts of it), the finishing thread's (the second: its work and its
wait for room), the GPU's (CUDA timing events on the finishing stream; zero on a CPU) and the
training thread's wait at the queue.

Host clocks are read around calls that return anyway, and the two GPU stages are events recorded
on the finishing stream and read once they are done (the epoch's last few when it is taken): nothing
here makes the host wait for the GPU. The wait for an epoch's first batch (the workers starting
on it) is left out, as the training rate leaves out the first steps. The training loop's own
share of waiting is the epoch's ``data_wait_frac``. :meth:`InputAccount.take` reports
milliseconds per batch and resets; :func:`limiting_stage` reads which stage an input-bound epoch
waited for.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Optional, Sequence

import torch

# read: reading the files (a tar shard's sample: its pread), where a slow disk shows; parse: the JPEG
# header, the crop and flip draw; fallback: decoding on the worker's CPU what the GPU does not take
# (PNG, CMYK, progressive, EXIF-rotated); collate: laying the batch in its shared-memory buffer; share:
# decoding the workers' share of the JPEGs (imagenet.data.gpu.share)
WORKER_STAGES = ("read", "parse", "fallback", "collate", "share")
# starved: waiting for the workers' next batch (the hand-off included); busy: decoding the batch
# (the decoder call, the CPU's decode of the JPEGs it refused); ahead: waiting for the finishing
# thread to take it, batches decoded before they are wanted
THREAD_STAGES = ("starved", "busy", "ahead")
# handoff: of starved, unpickling the batch (shared memory: descriptors, not bytes); decode: of busy,
# the decoder call, which waits on the host for nvJPEG; decode_cpu: that call's CPU time (the rest
# is waiting for the GPU); thread_cpu: the thread's CPU time (much of it holding the GIL)
DETAIL_STAGES = ("handoff", "decode", "decode_cpu", "thread_cpu")
# the finishing thread's finish_busy: the geometry kernel's table and launches, the normalisation's,
# the targets' copy; finish_ahead: waiting for room in the queue, batches ready before the step
# wants them (the rest of its time it waits for the decode thread)
FINISH_STAGES = ("finish_busy", "finish_ahead")
# geometry: the crop, resize and flip kernel and its copies; normalise: uint8 to normalised float
GPU_STAGES = ("geometry", "normalise")
# train_wait: the training thread waiting at the queue for a prepared batch
STAGES = WORKER_STAGES + THREAD_STAGES + DETAIL_STAGES + FINISH_STAGES + GPU_STAGES + ("train_wait",)


class InputAccount:
    """Seconds per stage, summed over the batches since the last :meth:`take`; thread-safe (the
    background threads add, the training thread takes)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda  # time the GPU stages (events on the current stream)
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(STAGES, 0.0)
        self._batches = 0
        self._images = self._shared = 0  # images that came, and of them the workers' share of the JPEGs
        self._events: collections.deque = collections.deque()  # (stage, start, end) not yet read

    def batch(self, worker_seconds: Optional[Sequence[float]] = None, handoff: float = 0.0, images: int = 0,
              shared: int = 0) -> None:
        """One batch arrived; ``worker_seconds``: its worker's (read, parse, fallback, collate,
        share); ``handoff``: the seconds unpickling it here; ``images`` in it, ``shared`` of them
        the workers' share of the JPEGs."""
        with self._lock:
            self._batches += 1
            self._images += images
            self._shared += shared
            self._sums["handoff"] += handoff
            for stage, s in zip(WORKER_STAGES, worker_seconds or ()):
                self._sums[stage] += s

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._sums[stage] += seconds

    @contextlib.contextmanager
    def gpu(self, stage: str):
        """Time the device work enqueued inside on the current stream (CUDA only; else nothing)."""
        if not self.cuda:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self._lock:
            self._events.append((stage, start, end))
            while self._events and self._events[0][2].query():  # the ones already done; never wait
                self._read(*self._events.popleft())

    def _read(self, stage: str, start, end) -> None:
        self._sums[stage] += start.elapsed_time(end) / 1000.0

    def take(self) -> dict:
        """``{"batches": n, stage: milliseconds per batch, ..., "decode_share": the fraction of the
        images the workers decoded as their share}`` since the last call; empty before any batch.
        Waits for the GPU events still pending, an epoch's last few."""
        with self._lock:
            while self._events:
                stage, start, end = self._events.popleft()
                end.synchronize()
                self._read(stage, start, end)
            sums, n, images, shared = self._sums, self._batches, self._images, self._shared
            self._sums, self._batches, self._images, self._shared = dict.fromkeys(STAGES, 0.0), 0, 0, 0
        if not n:
            return {}
        return {"batches": n, **{k: round(1000.0 * v / n, 3) for k, v in sums.items()},
                "decode_share": round(shared / images, 4) if images else 0.0}


def worker_ms(stages: dict) -> float:
    """One worker's milliseconds of work per batch, every worker stage."""
    return sum(stages.get(k, 0.0) for k in WORKER_STAGES)


def thread_shares(stages: dict) -> tuple:
    """The decode thread's (busy, waiting for workers, waiting for room) as fractions of its time."""
    starved, busy, ahead = (stages.get(k, 0.0) for k in THREAD_STAGES)
    total = busy + starved + ahead
    return (busy / total, starved / total, ahead / total) if total > 0 else (0.0, 0.0, 0.0)


def limiting_stage(stages: dict) -> str:
    """Which stage an input-bound ``--decode gpu`` epoch waited for:

    * ``"files"`` -- the workers, and most of their time went to reading files;
    * ``"workers"`` -- the workers (header parsing, crop draws, CPU fallbacks, or too few of them);
    * ``"gpu"`` -- the GPU decoding stage: one of its threads was busy while the workers kept up
      (the decode thread, or the finishing thread while the decode thread waited for it);
    * ``"ready"`` -- the batches were ready ahead of the step: the loop's wait was for the
      finishing stream's kernels on the GPU (the ``geometry`` and ``normalise`` stages time them).

    The decode thread meets the workers' pace as ``starved`` time: waiting for them longer than
    working means they were the limit. Waiting for room longer than both, it had the batches
    ahead of the finishing thread: that thread was the limit if it worked longer than it waited
    for room, else the batches were ready.
    """
    starved, busy, ahead = (stages.get(k, 0.0) for k in THREAD_STAGES)
    finish_busy, finish_ahead = (stages.get(k, 0.0) for k in FINISH_STAGES)
    if ahead > busy + starved:
        return "gpu" if finish_busy > finish_ahead else "ready"
    if starved > busy:
        work = worker_ms(stages)
        return "files" if work and stages.get("read", 0.0) > 0.5 * work else "workers"
    return "gpu"


def describe(stages: dict, workers: int) -> str:
    """The epoch's line: the workers' stages in milliseconds per batch, the decode thread's shares
    (and, where timed, the parts of them, the finishing thread's work and wait for room, the GPU's
    stages and the training thread's wait)."""
    g = stages.get
    busy, starved, ahead = thread_shares(stages)

    def part(text: str, key: str) -> str:  # a stage this account timed, as ", text N ms/batch"
        return f", {text} {g(key, 0):.1f} ms/batch" if g(key, 0) else ""
    decode = (f": decoder call {g('decode', 0):.1f} ms, {g('decode_cpu', 0):.1f} of it on the CPU"
              if g("decode", 0) else "")
    handoff = f" (hand-off {g('handoff', 0):.1f} ms/batch)" if g("handoff", 0) else ""
    share = (f", decode their share of the JPEGs ({100 * g('decode_share', 0):.0f}% of the images) "
             f"{g('share', 0):.1f} ms/batch" if g("decode_share", 0) else "")
    finish = (f"; finishing thread busy {g('finish_busy', 0):.1f} ms/batch, waiting for room "
              f"{g('finish_ahead', 0):.1f} ms/batch" if g("finish_busy", 0) else "")
    gpu = (f"; on the GPU: geometry {g('geometry', 0):.2f} ms/batch, normalise {g('normalise', 0):.2f} ms/batch"
           if g("geometry", 0) or g("normalise", 0) else "")
    wait = f"; training thread waited {g('train_wait', 0):.1f} ms/batch" if g("train_wait", 0) else ""
    return (f"workers read {g('read', 0):.1f} ms/batch, parse headers and draw crops {g('parse', 0):.1f} ms/batch, "
            f"decode fallbacks {g('fallback', 0):.1f} ms/batch{part('collate', 'collate')}{share} (one worker's time "
            f"for a batch; {workers} worker{'' if workers == 1 else 's'}); decode thread busy {100 * busy:.0f}% "
            f"({g('busy', 0):.1f} ms/batch{decode}), waiting for workers {100 * starved:.0f}%{handoff}, waiting for "
            f"room {100 * ahead:.0f}%{part('CPU', 'thread_cpu')}{finish}{gpu}{wait} ({stages['batches']} batches)")
