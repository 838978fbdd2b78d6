#!/usr/bin/env python
"""Time to MLPerf's 75.9% on 8 GPUs, projected from one GPU's measured rates (no figure of its own).

    python scripts/perf/mlperf_projection.py --rate R --eval-rate E [--gpus 8 --scaling 1.0]
    python scripts/perf/mlperf_projection.py --from-run DIR     # a main.py --dummy run's metrics.jsonl

The arithmetic of configs/resnet50-mlperf.yaml's run: MLPerf's clock covers training and the
validations (every 4 epochs from the 3rd, counted from 1), and stops after the validation that
reaches the target, the 35th epoch's in each of NVIDIA's v4.0 H200 runs. With global batch B and
the last partial batch dropped, an epoch trains floor(1,281,167 / B) * B images; over G GPUs at R
img/s each, times a scaling efficiency S (8-GPU DDP rate over 8x one GPU's, 1 until measured), it
takes that / (G R S) seconds. A validation of 50,000 images is split over the G GPUs, each at E
img/s. Per epoch, ``--overhead`` seconds more (a checkpoint write, the loaders' epoch start):

    minutes = (epochs * floor(N / B) * B / (G R S) + evaluations * 50,000 / (G E) + epochs * overhead) / 60

``--from-run DIR`` reads R (``img_per_s``) and E from a one-GPU ``main.py --dummy`` run that
validated: E is ``val_samples`` over ``val_seconds`` (in rows written before that key, over the
epoch's time beyond training, which also holds the checkpoint's write). The output gives the projection beside MLPerf's 12.03 minutes and the 11-minute goal, and
the one-GPU training rate that reaches the goal at the same E, S and overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TRAIN_IMAGES = 1281167  # ImageNet-1k's training set
VAL_IMAGES = 50000
MLPERF_MINUTES = 12.03  # NVIDIA, 8x H200, MLPerf Training v4.0 (olympic mean of 5 runs)
GOAL_MINUTES = 11.0


def evaluations(epochs: int, every: int = 4, start: int = 2) -> int:
    """Validations within ``epochs`` epochs: after 0-based epochs start, start + every, ... (MLPerf's
    epochs 3, 7, ..., 35 counted from 1: 9 of them in 35 epochs)."""
    return len(range(start, epochs, every))


def project(*, rate: float, eval_rate: float, gpus: int = 8, scaling: float = 1.0, epochs: int = 35,
            batch: int = 3200, overhead: float = 0.0) -> dict:
    """The projection's parts in seconds, and its total in minutes."""
    images = (TRAIN_IMAGES // batch) * batch
    train = epochs * images / (gpus * rate * scaling)
    evals = evaluations(epochs)
    validate = evals * VAL_IMAGES / (gpus * eval_rate)
    total = train + validate + epochs * overhead
    return {"train_s": train, "validate_s": validate, "overhead_s": epochs * overhead, "evaluations": evals,
            "minutes": total / 60, "images_per_epoch": images}


def rate_for(minutes: float, *, eval_rate: float, gpus: int = 8, scaling: float = 1.0, epochs: int = 35,
             batch: int = 3200, overhead: float = 0.0) -> float:
    """The one-GPU training rate (img/s) whose projection is ``minutes``, or inf if validation and
    overhead alone take longer."""
    fixed = project(rate=1.0, eval_rate=eval_rate, gpus=gpus, epochs=epochs, batch=batch, overhead=overhead)
    left = minutes * 60 - fixed["validate_s"] - fixed["overhead_s"]
    return float("inf") if left <= 0 else epochs * fixed["images_per_epoch"] / (gpus * scaling * left)


def rates_of_run(folder: str) -> tuple:
    """(training img/s, validation img/s) of a one-GPU run's last validated metrics.jsonl row."""
    path = os.path.join(folder, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    row = next((r for r in reversed(rows) if r.get("val_samples")), None)
    if row is None:
        raise SystemExit(f"error: {path} has no validated epoch; run main.py --dummy with --dummy-val-size 50000")
    # val_seconds: the validation alone; rows written before it existed: all beyond training (a checkpoint too)
    seconds = row.get("val_seconds") or row["epoch_seconds"] - row["train_seconds"]
    return row["img_per_s"], row["val_samples"] / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, help="one GPU's training rate, img/s (the typed command, -b 400, LARS)")
    p.add_argument("--eval-rate", type=float, help="one GPU's validation rate, img/s")
    p.add_argument("--from-run", help="take both rates from this one-GPU main.py --dummy run's metrics.jsonl")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--scaling", type=float, default=1.0, help="8-GPU DDP rate / (8 x one GPU's); 1 until measured")
    p.add_argument("--epochs", type=int, default=35, help="epochs to the target (NVIDIA's v4.0 runs: 35)")
    p.add_argument("--batch", type=int, default=3200, help="global batch")
    p.add_argument("--overhead", type=float, default=0.0, help="seconds per epoch beyond training and validation")
    args = p.parse_args(argv)
    if args.from_run:
        args.rate, args.eval_rate = rates_of_run(args.from_run)
    if not (args.rate and args.eval_rate):
        p.error("give --rate and --eval-rate, or --from-run DIR")
    kw = dict(eval_rate=args.eval_rate, gpus=args.gpus, scaling=args.scaling, epochs=args.epochs, batch=args.batch,
              overhead=args.overhead)
    r = project(rate=args.rate, **kw)
    print(f"one GPU: {args.rate:,.0f} img/s training, {args.eval_rate:,.0f} img/s validation; {args.gpus} GPUs at "
          f"scaling {args.scaling:g}; {args.epochs} epochs of {r['images_per_epoch']:,} images, {r['evaluations']} "
          f"validations of {VAL_IMAGES:,}")
    print(f"training {r['train_s']:.1f} s + validation {r['validate_s']:.1f} s + overhead {r['overhead_s']:.1f} s "
          f"= {r['minutes']:.2f} min (MLPerf v4.0, NVIDIA 8x H200: {MLPERF_MINUTES} min; goal {GOAL_MINUTES:g} min)")
    print(f"one-GPU training rate for {GOAL_MINUTES:g} min at this validation rate, scaling and overhead: "
          f"{rate_for(GOAL_MINUTES, **kw):,.0f} img/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
