"""Where a ``--decode gpu`` training batch's time goes, per stage, summed over an epoch.

======================  =============================================================================
workers                 (one worker's seconds for the whole batch; ``-j`` of them work side by side)
``read``                reading the files (a tar shard's sample: its ``pread``): a slow disk shows here
``parse``               the JPEG header, the crop and flip draw
``fallback``            decoding the files the GPU does not take (PNG, CMYK) on the worker's CPU
decode thread           (:class:`imagenet.data.prefetch.DeviceLoader`'s background thread)
``starved``             waiting for the workers' next batch (the hand-off to this process included)
``busy``                preparing the batch: the nvJPEG call, which waits on the host for its decode,
                        and launching the geometry kernel and the normalisation
``ahead``               waiting for room in the queue: batches ready before the training step wants them
======================  =============================================================================

Only host clocks, read around calls that return anyway: nothing here waits for the GPU, and the
work the GPU runs is not changed. The wait for an epoch's first batch (the workers starting on
it) is left out, as the training rate leaves out the first steps. The training loop's own wait
is the epoch's ``data_wait_frac``. :meth:`InputAccount.take` reports milliseconds per batch and
resets; :func:`limiting_stage` reads which stage an input-bound epoch waited for.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

WORKER_STAGES = ("read", "parse", "fallback")
THREAD_STAGES = ("starved", "busy", "ahead")
STAGES = WORKER_STAGES + THREAD_STAGES


class InputAccount:
    """Seconds per stage, summed over the batches since the last :meth:`take`; thread-safe (the
    decode thread adds, the training thread takes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(STAGES, 0.0)
        self._batches = 0

    def batch(self, worker_seconds: Optional[Sequence[float]] = None) -> None:
        """One batch arrived; ``worker_seconds``: its worker's (read, parse, fallback)."""
        with self._lock:
            self._batches += 1
            for stage, s in zip(WORKER_STAGES, worker_seconds or ()):
                self._sums[stage] += s

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._sums[stage] += seconds

    def take(self) -> dict:
        """``{"batches": n, stage: milliseconds per batch, ...}`` since the last call; empty
        before any batch."""
        with self._lock:
            sums, n = self._sums, self._batches
            self._sums, self._batches = dict.fromkeys(STAGES, 0.0), 0
        if not n:
            return {}
        return {"batches": n, **{k: round(1000.0 * v / n, 3) for k, v in sums.items()}}


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
    * ``"gpu"`` -- the GPU decoding stage: its thread was busy while the workers kept up;
    * ``"ready"`` -- the batches were ready ahead of the step: the loop's wait was for the decode
      stream's kernels on the GPU, which no host clock here sees.

    The decode thread meets the workers' pace as ``starved`` time: waiting for them longer than
    working means they were the limit.
    """
    starved, busy, ahead = (stages.get(k, 0.0) for k in THREAD_STAGES)
    if ahead > busy + starved:
        return "ready"
    if starved > busy:
        work = worker_ms(stages)
        return "files" if work and stages.get("read", 0.0) > 0.5 * work else "workers"
    return "gpu"


def describe(stages: dict, workers: int) -> str:
    """The epoch's line: the workers' stages in milliseconds per batch, the decode thread's shares."""
    g = stages.get
    busy, starved, ahead = thread_shares(stages)
    return (f"workers read {g('read', 0):.1f} ms/batch, parse headers and draw crops {g('parse', 0):.1f} ms/batch, "
            f"decode fallbacks {g('fallback', 0):.1f} ms/batch (one worker's time for a batch; {workers} "
            f"worker{'' if workers == 1 else 's'}); decode thread busy {100 * busy:.0f}% ({g('busy', 0):.1f} "
            f"ms/batch), waiting for workers {100 * starved:.0f}%, waiting for room {100 * ahead:.0f}% "
            f"({stages['batches']} batches)")
