"""A run's outputs other than checkpoints, written by rank 0 only: ``config.yaml`` (the
resolved recipe, reusable as ``--config``), ``metrics.jsonl`` (one :class:`metrics.EpochRecord`
per epoch), the TensorBoard events (``--tensorboard``), ``skipped_images.txt``, and the lines
that report an epoch's overflow skips, input stages (``--decode gpu``) or input wait, and the
run's end. :func:`input_hint` says which stage an input-bound epoch waited for.

A ``--prof`` run's row goes to ``prof.jsonl`` instead, its options to ``prof-config.yaml``, and it
adds no TensorBoard scalars and no ``skipped_images.txt`` lines: those are the folder's history of
finished epochs, and a later run there would find in them an epoch 0 that a few batches stood
for (and in ``config.yaml`` the options of a profile, not of the run that trained them)."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import yaml

from ..data.gpu.choice import CPU_DECODE_CORES
from ..data.gpu.account import describe as describe_stages
from ..data.gpu.account import limiting_stage, worker_ms
from .defaults import local_processes, usable_cpus
from .engine import Steady, TrainResult
from .tblog import TensorBoardLog

logger = logging.getLogger("imagenet")

INPUT_BOUND = 0.1  # share of the steady training time spent waiting for input that an epoch line reports


class RunLog:
    """Use as a context manager: the TensorBoard writer is closed at the end."""

    def __init__(self, cfg, ctx, requested=None, environment=()):
        """``cfg``: the run's config with every ``auto`` decided; ``requested``: the config as the
        user gave it, which ``config.yaml`` keeps (so that ``--config`` decides again on the machine
        that reads it), with the decisions in a comment above it; ``environment``: (name, value)
        of the variables the trainer set in its environment, in a comment too."""
        self.cfg, self.ctx = cfg, ctx
        self.requested = requested if requested is not None else cfg
        self.environment = tuple(environment)
        self.active = ctx.is_main
        self.history = self.active and cfg.prof < 0  # what this run writes joins the folder's epochs
        self.metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl" if cfg.prof < 0 else "prof.jsonl")
        self.config_path = os.path.join(cfg.output_dir, "config.yaml" if cfg.prof < 0 else "prof-config.yaml")
        self.skipped_path = os.path.join(cfg.output_dir, "skipped_images.txt")
        self.board = TensorBoardLog(cfg.output_dir) if cfg.tensorboard and self.history else None

    def __enter__(self) -> "RunLog":
        if self.active:
            asked, ran = self.requested.to_dict(), self.cfg.to_dict()
            decided = {k: v for k, v in ran.items() if asked.get(k) != v and k != "config"}
            with open(self.config_path, "w") as fh:
                if decided:
                    fh.write("# decided for this machine (the keys below say auto; --config decides again where it "
                             "runs):\n# " + yaml.safe_dump(decided, default_flow_style=True, width=10**6).strip() + "\n")
                if self.environment:
                    fh.write("# environment the trainer set for itself (a value set before the command is kept): "
                             + ", ".join(f"{k}={v}" for k, v in self.environment) + "\n")
                # every key but the config file itself
                yaml.safe_dump({k: v for k, v in asked.items() if k != "config"}, fh, sort_keys=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.board is not None:
            self.board.close()

    def catch_up(self, record: Optional[dict]) -> None:
        """Write ``record`` (the last finished epoch's row, from the checkpoint resumed) if
        metrics.jsonl lacks it: the run stopped between the checkpoint and the row."""
        if not (self.history and record):
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

    def skipped_images(self, epoch: int, paths: list, count: int, unlisted: int = 0) -> None:
        """``count`` unreadable images in ``epoch`` over all ranks; ``paths``: theirs, all ranks';
        ``unlisted``: of ``count``, those met before the epoch's mid-epoch resume whose paths its
        checkpoint did not keep (not in ``paths``; the list says how many)."""
        if not (count and self.active):
            return
        before = f"{unlisted} of them, met before the run resumed in this epoch, not listed" if unlisted else ""
        if self.history:
            with open(self.skipped_path, "a") as fh:
                fh.writelines(f"epoch {epoch}\t{p}\n" for p in paths)
                if unlisted:
                    fh.write(f"# epoch {epoch}: {before} (the checkpoint resumed did not keep their paths)\n")
        logger.warning("=> epoch %d: skipped %d unreadable image(s), e.g. %s (list: %s%s)", epoch, count,
                       ", ".join(paths[:3]) or "before the resume", self.skipped_path if self.history
                       else "none under --prof", f"; {before}" if before else "")

    def epoch(self, record: dict, train: TrainResult, loss_scale, stages: Optional[dict] = None) -> None:
        """One epoch's metrics row (``--prof``: in prof.jsonl), its TensorBoard scalars, and what its
        line should tell; ``stages``: the ``--decode gpu`` input account of its training batches, this process's
        (:mod:`imagenet.data.gpu.account`), which names the stage an input-bound epoch waited for."""
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
                           "(%.0f img/s); %s", epoch, 100 * train.data_wait_frac, train.img_per_s,
                           self.input_hint(stages))

    def summary(self, best_acc1: float, last: dict, epochs_run: int, seconds: float, steady: Steady,
                target: Optional[tuple] = None) -> dict:
        """The run's end: the summary ``run()`` returns, and its line. ``target``: (epoch, seconds
        on the run's clock) where validation reached ``--target-acc``, None if it did not."""
        world = self.ctx.world_size if self.ctx.distributed else 1
        summary = {"best_acc1": best_acc1, "last_acc1": last.get("val_acc1"), "epochs_run": epochs_run,
                   "seconds": seconds, "img_per_s": steady.img_per_s * world,
                   "data_wait_frac": steady.data_wait_frac, "last": last,
                   "target_epoch": target[0] if target else None, "seconds_to_target": target[1] if target else None}
        if self.active and last:
            last_acc1 = "-" if last["val_acc1"] is None else f"{last['val_acc1']:.3f}"
            logger.info("=> done: best Acc@1 %.3f, last Acc@1 %s, %.1f s; training %.0f img/s steady, %.0f%% of "
                        "it waiting for input%s; outputs in %s", best_acc1, last_acc1, seconds,
                        summary["img_per_s"], 100 * summary["data_wait_frac"], self._target_words(target),
                        os.path.abspath(self.cfg.output_dir))
        return summary

    def _target_words(self, target: Optional[tuple]) -> str:
        """The done line's words on ``--target-acc``."""
        if self.cfg.target_acc is None:
            return ""
        if target is None:
            return f"; --target-acc {self.cfg.target_acc:g} not reached"
        epoch, seconds = target
        return (f"; --target-acc {self.cfg.target_acc:g} reached after epoch {epoch} ({epoch + 1} counted from 1), "
                f"{seconds:.1f} s ({seconds / 60:.2f} min) after the first step")

    def input_hint(self, stages: Optional[dict] = None) -> str:
        """What limited the input, and what to try (:func:`input_hint` for this run)."""
        processes = local_processes(self.ctx)
        return input_hint(self.cfg, cuda=self.ctx.device.type == "cuda", cpus=max(usable_cpus() // processes, 1),
                          processes=processes, stages=stages)


def input_hint(cfg, *, cuda: bool, cpus: int, processes: int = 1, stages: Optional[dict] = None) -> str:
    """The input-bound line's diagnosis: the stage the training loop waited for and what to try.
    With ``--decode gpu`` (``cfg.decode`` is resolved) ``stages``, the epoch's input account in
    milliseconds per batch, tells the CPU workers, reading files and the GPU decoding stage apart;
    with ``--decode cpu`` the workers decode, and they were the limit. ``cpus``: the CPU cores of
    this process's workers, ``processes``: the training processes sharing this machine."""
    workers = f"{cfg.workers} data worker{'' if cfg.workers == 1 else 's'}"
    here = "here" if processes == 1 else f"a process here ({processes} processes)"
    if cfg.workers == 0:
        every_cpu = f"the training process, loading its own batches (-j 0), already has every CPU {here}"
    else:
        every_cpu = f"the {workers} already {'has' if cfg.workers == 1 else 'have'} every CPU {here}"
    more = f"more data workers (-j, now {cfg.workers}; {cpus} CPUs {here})" if cfg.workers < cpus - 1 else ""
    if cfg.decode == "gpu" and stages:
        g = stages.get
        stage = limiting_stage(stages)
        if stage == "ready":
            kernels = g("geometry", 0) + g("normalise", 0)
            timed = f" ({kernels:.1f} ms a batch of GPU time)" if kernels else ""
            return (f"the GPU decoding stage was the limit: its thread had the batches ready ahead (it waited "
                    f"{g('ahead', 0):.0f} ms a batch for room), so the loop waited for the decode's kernels on the "
                    f"GPU{timed}")
        if stage == "gpu":
            if cpus - 1 >= CPU_DECODE_CORES:
                tip = f"try --decode cpu -j {cpus - 1}, which decodes in the workers"
            else:
                tip = (f"with {cpus} CPUs {here}, --decode cpu is unlikely to do better (on an H200, 12 decoding "
                       f"workers fed 75% of the step, 15 fed 91-99%)")
            if g("finish_busy", 0) > g("busy", 0):
                return (f"the GPU decoding stage was the limit: its finishing thread was busy "
                        f"{g('finish_busy', 0):.0f} ms a batch (the geometry kernel's table and launches, the "
                        f"normalisation) while the decode thread waited {g('ahead', 0):.0f} ms a batch for it and the "
                        f"{workers} kept up; {tip}")
            doing = f"the decoder call {g('decode', 0):.0f} ms of it" if g("decode", 0) else "nvJPEG's decode"
            return (f"the GPU decoding stage was the limit: its thread was busy {g('busy', 0):.0f} ms a batch "
                    f"({doing}) while the {workers} kept up (it waited "
                    f"{g('starved', 0):.0f} ms a batch for them); {tip}")
        work = worker_ms(stages)
        if stage == "files":
            return (f"reading files was the limit: the GPU decoding stage waited {g('starved', 0):.0f} ms a batch for "
                    f"the {workers}, which spent {g('read', 0):.0f} of their {work:.0f} ms a batch reading files (the "
                    "storage, or a dataset larger than the page cache); "
                    + (f"try {more}, or" if more else "try") + " the dataset on faster or local storage")
        share = (f", their share of the JPEGs {g('share', 0):.0f} (--decode-share {cfg.decode_share})"
                 if g("share", 0) else "")
        return (f"the CPU workers were the limit: the GPU decoding stage waited {g('starved', 0):.0f} ms a batch for "
                f"the {workers} ({work:.0f} ms of work a batch each: reading {g('read', 0):.0f}, headers and crop "
                f"draws {g('parse', 0):.0f}, CPU fallbacks {g('fallback', 0):.0f}{share}); "
                + (f"try {more}" if more else every_cpu))
    tips = [more] if more else []
    if cuda and not cfg.dummy and cfg.decode == "cpu" and cfg.data_pipeline == "fast" \
            and cfg.auto_augment == "none" and cfg.random_erase == 0:
        tips.append("--decode gpu (JPEG decoding on the GPU)")
    if cfg.data_pipeline == "classic":
        tips.append("--data-pipeline fast")
    if cfg.no_jpeg_draft:
        tips.append("dropping --no-jpeg-draft")
    limit = "" if cfg.dummy else "the CPU workers (decoding) were the limit: "
    if not tips:
        return f"{limit}{every_cpu}: this machine's input rate is the limit"
    return limit + "try " + ", ".join(tips)
