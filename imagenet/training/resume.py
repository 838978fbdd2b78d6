"""``--resume``: check that a checkpoint belongs to this run, load it into the training state,
and say where the run continues. What a checkpoint holds is :mod:`imagenet.training.savepolicy`'s."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..base import checkpoint as ckpt_io
from ..base.errors import UserError
from ..base.wrappers import strip_prefix, unwrap
from ..data import dataorder
from ..models.registry import fit_state_dict
from .state import Progress, TrainState

logger = logging.getLogger("imagenet")

# Optimisation settings a resumed run takes from its command line, not from the checkpoint.
RESUME_OVERRIDES = ("lr", "momentum", "weight_decay", "epochs", "lr_schedule", "lr_step", "lr_gamma", "warmup_epochs",
                    "lr_end", "lr_decay_epochs", "lr_poly_power", "lars_eta", "lars_eps",
                    "batch_size", "accum_steps", "scale_window")


def resume_from(path: str, cfg, ctx, state: TrainState, num_classes: int,
                data_order: Optional[dict] = None) -> Progress:
    """Load ``path`` into ``state`` (with ``-e``: the weights only) and this rank's RNG states;
    returns the run's progress from it. ``data_order``: this run's training data fingerprint
    (:func:`imagenet.data.dataorder.fingerprint`), checked against the checkpoint's before a
    mid-epoch resume (``--on-data-change``)."""
    ckpt = ckpt_io.read_checkpoint(path)
    ckpt_io.require_keys(ckpt, path, ("state_dict", "optimizer", "epoch"))
    weights = strip_prefix(ckpt["state_dict"])
    _check_same_run(ckpt, weights, path, cfg, num_classes)
    weights = fit_state_dict(unwrap(state.model), weights, path)
    progress = Progress()
    progress.load_state_dict(ckpt)
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(cfg.output_dir):
        progress.record = None  # another folder's checkpoint: its last metrics row is not this run's
    if cfg.evaluate:  # evaluation needs the weights only
        state.load_weights(weights)
        return Progress(progress.epoch, 0, progress.best_acc1)
    _check_same_optimizer(ckpt, path, cfg)
    try:
        state.load_state_dict({**ckpt, "state_dict": weights})
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"optimizer state in {path} does not fit this run ({e}); resume with the same "
                        "--no-bn-weight-decay setting it was saved with, or start from it with --weights")
    _restore_rng(ckpt, ctx)
    saved = ckpt.get("config") or {}
    for key in RESUME_OVERRIDES:
        if key in saved and saved[key] != getattr(cfg, key):
            logger.info("=> resume: --%s %s replaces the checkpoint's %s", key.replace("_", "-"), getattr(cfg, key),
                        saved[key])
    saved_batch, saved_accum = saved.get("batch_size", cfg.batch_size), saved.get("accum_steps", 1)
    if progress.step and not progress.trained and (saved_batch, saved_accum) != (cfg.batch_size, cfg.accum_steps):
        logger.warning("=> %s stopped mid-epoch at batch size %s with %s accumulation step(s); with -b %d and "
                       "--accum-steps %d the epoch restarts from its beginning", path, saved_batch, saved_accum,
                       cfg.batch_size, cfg.accum_steps)
        progress = progress.at_step(0, None)
    if cfg.start_epoch is None:  # --start-epoch starts an epoch from its beginning anyway
        progress = _check_data_order(ckpt, progress, path, cfg, data_order)
    where = f", step {progress.step}" if progress.step else ""
    if progress.trained:
        where += f" (its last: its validation, then epoch {progress.epoch + 1} from its start)"
    logger.info("=> resumed %s: continuing at epoch %d%s (best Acc@1 so far %.3f)", path, progress.epoch, where,
                progress.best_acc1)
    return progress


def _check_same_run(ckpt: dict, weights: dict, path: str, cfg, num_classes: int) -> None:
    arch = ckpt.get("arch", cfg.arch)
    if arch != cfg.arch:
        raise UserError(f"{path} was trained as {arch}, not -a {cfg.arch}; pass -a {arch} to resume it")
    blurred = (ckpt.get("config") or {}).get("blurpool", False)
    if bool(blurred) != cfg.blurpool:
        fix = f"{'add' if blurred else 'drop'} --blurpool to {'evaluate' if cfg.evaluate else 'resume'} it"
        raise UserError(f"{path} was trained {'with' if blurred else 'without'} --blurpool, which its weights do not "
                        f"show; {fix} (the blur is part of the model)")
    saved_classes = ckpt.get("num_classes")
    if saved_classes is not None and int(saved_classes) != num_classes:
        raise UserError(f"{path} was trained on {saved_classes} classes, this dataset has {num_classes}; "
                        "--resume continues the same run: to fine-tune from it use --weights")
    fc = weights.get("fc.weight")
    if fc is not None and fc.shape[0] != num_classes:
        raise UserError(f"{path} has a {fc.shape[0]}-class classifier, this dataset {num_classes} classes; "
                        "--resume continues the same run: to fine-tune from it use --weights")


def _check_same_optimizer(ckpt: dict, path: str, cfg) -> None:
    """SGD's and LARS's momentum buffers hold different steps (LARS's are scaled by each layer's
    trust ratio), so a run continues with the optimizer its checkpoint was written with."""
    saved = (ckpt.get("config") or {}).get("optimizer", "sgd")  # checkpoints older than --optimizer: SGD
    if saved != cfg.optimizer:
        raise UserError(f"{path} was trained with --optimizer {saved}, and this run asks for --optimizer "
                        f"{cfg.optimizer}: its momentum does not carry over; resume with --optimizer {saved}, or "
                        f"start a new run from its weights with --weights {path}")


def _check_data_order(ckpt: dict, progress: Progress, path: str, cfg, now: Optional[dict]) -> Progress:
    """Where the run continues, given what decides the data's order then and now: a checkpoint
    taken mid-epoch continues after its step only with the order it was taken in (the images of
    the epoch's first steps are the ones done); otherwise ``--on-data-change`` says what to do.
    One taken after the epoch's last step is at an epoch's end: the next epoch starts afresh."""
    if now is None:  # synthetic data: no order to keep
        return progress
    if "data_order" not in ckpt:
        if progress.step:
            logger.info("=> note: %s holds no record of the data's order (an older checkpoint): continuing epoch "
                        "%d after step %d takes the data, --seed and --shuffle-window to be the ones it was "
                        "written with", path, progress.epoch, progress.step)
        return progress
    saved = ckpt["data_order"]
    changed = "; ".join(dataorder.changes(saved, now)) if saved is not None else ""
    if not changed:
        return progress
    if not progress.step or progress.trained:
        logger.info("=> note: the training data's order changed since %s was written (%s); epoch %d is trained "
                    "from its start, every image of it once", path, changed, progress.epoch + (1 if progress.trained else 0))
        return progress
    where = f"{path} was written in the middle of epoch {progress.epoch} (after step {progress.step})"
    if cfg.on_data_change == "stop":
        raise UserError(f"{where}, and the training data's order changed since ({changed}): continuing there would "
                        "train some of the epoch's images twice and others not at all; resume with the data and "
                        f"flags it was written with, or pass --on-data-change restart-epoch to train epoch "
                        f"{progress.epoch} again from its start")
    logger.warning("=> %s, and the training data's order changed since (%s): epoch %d restarts from its start "
                   "(--on-data-change restart-epoch)", where, changed, progress.epoch)
    return progress.at_step(0, None)


def _restore_rng(ckpt: dict, ctx) -> None:
    per_rank = ckpt.get("rng_per_rank") or []
    if len(per_rank) == ctx.world_size:
        ckpt_io.restore_rng(per_rank[ctx.rank])
    else:
        # Another world size than the saved run's: rank 0's state, and distinct streams per rank.
        ckpt_io.restore_rng(ckpt.get("rng"))
        if ctx.rank:
            torch.manual_seed(torch.initial_seed() + ctx.rank)
