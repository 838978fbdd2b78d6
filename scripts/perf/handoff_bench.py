#!/usr/bin/env python
"""The CPU side of ``--decode gpu``, timed on any machine: what a worker spends per image, what
collating a batch costs, and what the training process spends receiving a batch from a worker.

    python scripts/perf/handoff_bench.py DIR [--batch-size 256] [--batches 12] [--repeats 3]

DIR is an ImageFolder (``train/`` is read), e.g. one made by make_benchmark_imagefolder.py.
Three figures, each the median of ``--repeats``:

* reader: the worker's transform per image (open, read, header, crop draw), in this process;
* hand-off: a DataLoader with one worker process feeds ``--batches`` batches; the training
  process's CPU time (``time.thread_time``) per ``next()``: receiving and unpickling the batch,
  which holds the GIL the training step needs. Its wall time per batch is the worker's pace.
  Also the pickled size of a batch: what travels through the pipe rather than shared memory,
  and the worker's collate time per batch where the batch reports it (``worker_seconds``).

No GPU is used: the batches are not decoded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _median_of(repeats: int, fn) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)
    from torch.utils.data import DataLoader

    from imagenet.base.config import Config, validate
    from imagenet.data.loaders import build_datasets, collate_skipping

    torch.set_num_threads(1)
    cfg = Config(data=args.dir, decode="gpu", batch_size=args.batch_size)
    validate(cfg)
    train = build_datasets(cfg, args.dir).train
    n = min(len(train), args.batch_size)
    keys = [(i, 1000 + i) for i in range(n)]

    def reader() -> float:
        t0 = time.perf_counter()
        for k in keys:
            train[k]
        return (time.perf_counter() - t0) / n

    batch = collate_skipping([train[k] for k in keys])
    pickled = len(ForkingPickler.dumps(batch))

    def handoff() -> tuple:
        sampler = [(i % len(train), 2000 + i) for i in range(args.batches * args.batch_size)]
        loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=1,
                            collate_fn=collate_skipping, prefetch_factor=2)
        it = iter(loader)
        next(it)  # the worker's start
        cpu, wall, collate = [], [], []
        for _ in range(args.batches - 1):
            c0, w0 = time.thread_time(), time.perf_counter()
            images, _, _ = next(it)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            seconds = getattr(images, "worker_seconds", ())
            if len(seconds) >= 4:  # (read, parse, fallback, collate, share)
                collate.append(seconds[3])
        del it
        return statistics.median(cpu), statistics.median(wall), statistics.median(collate) if collate else None

    r = _median_of(args.repeats, reader)
    runs = [handoff() for _ in range(args.repeats)]
    h_cpu = statistics.median(x[0] for x in runs)
    h_wall = statistics.median(x[1] for x in runs)
    collates = [x[2] for x in runs if x[2] is not None]
    print(f"reader: {1e3 * r:.3f} ms an image ({n} images of {args.dir}/train)")
    print("collate in the worker: " + (f"{1e3 * statistics.median(collates):.2f} ms a batch of {args.batch_size}"
                                        if collates else "not reported by these batches"))
    print(f"hand-off: training process CPU {1e3 * h_cpu:.2f} ms a batch (wall {1e3 * h_wall:.1f} ms, one worker); "
          f"pickled batch {pickled / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
