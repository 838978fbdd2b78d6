"""A run's outputs other than checkpoints, written by rank 0 only: ``config.yaml`` (the
resolved recipe, reusable as ``--config``), ``metrics.jsonl`` (one :class:`metrics.EpochRecord`
per epoch), the TensorBoard events (``--tensorboard``), ``skipped_images.txt``, and the lines
that report an epoch's overflow skips, input stages (``--decode gpu``) or input wait, and the
run's end."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import yaml

from ..data.inputaccount import describe as describe_stages
from .engine import Steady, TrainResult
from .tblog import TensorBoardLog

logger = logging.getLogger("imagenet")

INPUT_BOUND = 0.1  # share of the steady training time spent waiting for input that an epoch line reports


class RunLog:
    """Use as a context manager: the TensorBoard writer is closed at the end."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.active = ctx.is_main
        self.metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.skipped_path = os.path.join(cfg.output_dir, "skipped_images.txt")
        self.board = TensorBoardLog(cfg.output_dir) if cfg.tensorboard and self.active else None

    def __enter__(self) -> "RunLog":
        if self.active:
            with open(os.path.join(self.cfg.output_dir, "config.yaml"), "w") as fh:
                # every key but the config file itself
                yaml.safe_dump({k: v for k, v in self.cfg.to_dict().items() if k != "config"}, fh, sort_keys=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.board is not None:
            self.board.close()

    def catch_up(self, record: Optional[dict]) -> None:
        """Write ``record`` (the last finished epoch's row, from the checkpoint resumed) if
        metrics.jsonl lacks it: the run stopped between the checkpoint and the row."""
        if not (self.active and record):
            return
        epochs = set()
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as fh:
                epochs = {json.loads(line).get("epoch") for line in fh if line.strip()}
        if record["epoch"] not in epochs:
            logger.info("=> metrics.jsonl had no row for epoch %d (the run stopped before writing it): added "
                        "from the checkpoint", record["epoch"])
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self.board is not None:
                self.board.write_epoch(record)

    def skipped_images(self, epoch: int, paths: list, count: int) -> None:
        """``count`` unreadable images in ``epoch`` over all ranks; ``paths``: this rank's."""
        if not (count and self.active):
            return
        with open(self.skipped_path, "a") as fh:
            fh.writelines(f"epoch {epoch}\t{p}\n" for p in paths)
        logger.warning("=> epoch %d: skipped %d unreadable image(s), e.g. %s (list: %s)", epoch, count,
                       ", ".join(paths[:3]) or "on other ranks", self.skipped_path)

    def epoch(self, record: dict, train: TrainResult, loss_scale, stages: Optional[dict] = None) -> None:
        """One epoch's metrics row, its TensorBoard scalars, and what its line should tell;
        ``stages``: the ``--decode gpu`` input account of its training batches, this process's
        (:mod:`imagenet.data.inputaccount`)."""
        if not self.active:
            return
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.board is not None:
            self.board.write_epoch(record)
        epoch = record["epoch"]
        if train.skipped_steps:
            logger.info("=> epoch %d: %d of %d steps skipped for gradient overflow (loss scale now %g)",
                        epoch, train.skipped_steps, train.steps, loss_scale)
        if stages:
            logger.info("=> epoch %d input stages: %s; the training loop waited for data %.0f%% of its steady time",
                        epoch, describe_stages(stages, self.cfg.workers), 100 * train.data_wait_frac)
        if train.data_wait_frac > INPUT_BOUND:
            logger.warning("=> epoch %d was input-bound: the training loop waited for data %.0f%% of the time "
                           "(%.0f img/s); %s", epoch, 100 * train.data_wait_frac, train.img_per_s, self.input_hint())

    def summary(self, best_acc1: float, last: dict, epochs_run: int, seconds: float, steady: Steady) -> dict:
        """The run's end: the summary ``run()`` returns, and its line."""
        world = self.ctx.world_size if self.ctx.distributed else 1
        summary = {"best_acc1": best_acc1, "last_acc1": last.get("val_acc1"), "epochs_run": epochs_run,
                   "seconds": seconds, "img_per_s": steady.img_per_s * world,
                   "data_wait_frac": steady.data_wait_frac, "last": last}
        if self.active and last:
            logger.info("=> done: best Acc@1 %.3f, last Acc@1 %.3f, %.1f s; training %.0f img/s steady, %.0f%% of "
                        "it waiting for input; outputs in %s", best_acc1, last["val_acc1"], seconds,
                        summary["img_per_s"], 100 * summary["data_wait_frac"], os.path.abspath(self.cfg.output_dir))
        return summary

    def input_hint(self) -> str:
        """What to try when the loop waits for input."""
        cfg = self.cfg
        cpus = os.cpu_count() or 1
        tips = [f"more data workers (-j, now {cfg.workers}; {cpus} CPUs here)"] if cfg.workers < cpus - 1 else []
        if self.ctx.device.type == "cuda" and not cfg.dummy and cfg.decode == "cpu" and cfg.data_pipeline == "fast" \
                and cfg.auto_augment == "none" and cfg.random_erase == 0:
            tips.append("--decode gpu (JPEG decoding on the GPU)")
        if cfg.data_pipeline == "classic":
            tips.append("--data-pipeline fast")
        if cfg.no_jpeg_draft:
            tips.append("dropping --no-jpeg-draft")
        if not tips:
            return f"the {cfg.workers} data workers already have every CPU here: this machine's input rate is the limit"
        return "try " + ", ".join(tips)
