"""What a run carries from step to step, and the one place that builds it.

* :class:`TrainState` -- the model and everything that changes with it: optimizer, schedule,
  precision (the fp32 masters and the loss scale), the weight average, the losses, the batch
  mixer. Its ``state_dict()`` is the training half of a checkpoint.
* :class:`Progress` -- where the run is: the epoch, the batches of it done, the best Acc@1, and
  the metric sums of the part of the epoch done. Its ``state_dict()`` is the other half.
* :func:`build_training` -- model, precision, optimizer and schedule in the order they depend
  on each other (the precision converts the model before the optimizer sees its parameters;
  DP/DDP and torch.compile wrap the model after, :func:`wrap_training`). ``main.py`` and
  ``scripts/perf/bench.py`` both build through it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..base.config import CUDA_GRAPH_MODES
from ..base.errors import UserError
from ..base.metrics import means
from ..base.wrappers import ddp_of
from ..data.loaders import micro_batch_size
from ..data.mixing import BatchMixer
from ..data.transforms import training_sizes
from ..models.evaluation import Evaluator, FixedBatch
from ..models.registry import (compile_model, create_model, load_weights_into, use_bn_kernels, use_conv_stats,
                               use_stem_kernels)
from ..parallel import distributed
from ..precision import optim
from ..precision import Precision, build_precision
from .defaults import resolved
from .ema import ModelEma
from .schedule import schedule_of

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The model being trained and what changes with it. ``model`` is the training model: after
    :func:`wrap_training`, inside its DP/DDP/compile wrappers; ``precision`` reads and writes
    its float32 weights through them. ``criterion`` is the validation loss (with the label
    smoothing); ``train_criterion`` the training loss (plain cross entropy when ``mixer`` makes
    soft labels, which carry the smoothing). ``evaluator`` computes validation's logits from the
    same network (``--val-flip``'s mean over a mirror), made by :func:`wrap_training` (compiled
    apart from the training model where that one is): what :func:`engine.validate` runs; None
    before (validation then runs the model itself)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    precision: Precision
    criterion: nn.Module
    train_criterion: nn.Module
    ema: Optional[ModelEma] = None
    mixer: Optional[BatchMixer] = None
    evaluator: Optional[Callable] = None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        """The checkpoint keys of the training state (the reference script's names where it has them)."""
        out = {"state_dict": self.precision.model_state_dict(self.model), "optimizer": self.optimizer.state_dict(),
               "scheduler": self.scheduler.state_dict(), "precision": self.precision.state_dict()}
        if self.ema is not None:
            out.update(state_dict_ema=self.ema.state_dict(), ema_updates=self.ema.updates)
        return out

    def load_weights(self, weights: dict) -> None:
        """The model's float32 weights (exact masters where the mode keeps them), keys unprefixed."""
        self.precision.load_model_state_dict(self.model, weights)

    def load_state_dict(self, state: dict) -> None:
        """Everything :meth:`state_dict` wrote. The optimizer keeps this run's settings (lr,
        momentum, weight decay: only its buffers come from ``state``) and the schedule this
        run's base lrs, so a resumed run follows its own command line. Raises ValueError,
        KeyError or RuntimeError when the optimizer state does not fit these parameter groups."""
        self.load_weights(state["state_dict"])
        optim.load_optimizer_state(self.optimizer, state["optimizer"])
        if "scheduler" in state:
            base_lrs = self.scheduler.base_lrs
            self.scheduler.load_state_dict(state["scheduler"])
            self.scheduler.base_lrs = base_lrs
        self.precision.load_state_dict(state.get("precision") or {})
        if self.ema is not None:
            if "state_dict_ema" in state:
                self.ema.load_state_dict(state["state_dict_ema"], int(state.get("ema_updates", 0)))
            else:
                logger.info("=> the checkpoint holds no weight average; --model-ema starts averaging from its weights")
                self.ema.load_state_dict(self.precision.model_state_dict(self.model), 0)


@dataclass
class Progress:
    """Where a run is: ``epoch`` is the epoch to run next (or to finish), ``step`` the loader
    batches of it already trained (mid-epoch checkpoints), ``sums`` the metric sums over all
    ranks of those batches (``metrics.DeviceSums.raw``, the unreadable images among them too), so
    a resumed epoch reports all of it.
    ``record`` is the metrics row of the epoch before ``epoch``: saved with the checkpoint, so a
    run that died after the checkpoint but before writing the row still gets it on resume.
    ``trained``: the epoch's training is done, its validation is not (a checkpoint after its last
    step: ``--save-every-steps``, what an elastic restart resumes from); a resume trains none of
    it, whatever the data now holds, and the next epoch starts at its beginning. ``skipped``: the
    paths of the unreadable images of the part done, all ranks (the first ``engine.CARRIED_PATHS``;
    :attr:`unreadable` counts them all), so the resumed epoch lists them too.
    ``run_seconds``: the run's clock (:class:`imagenet.training.cadence.RunClock`) when the
    checkpoint was written (the checkpoint policy sets it), where a resumed run's clock continues."""

    epoch: int = 0
    step: int = 0
    best_acc1: float = 0.0
    sums: Optional[list] = None
    record: Optional[dict] = None
    trained: bool = False
    skipped: Optional[list] = None
    run_seconds: float = 0.0

    @property
    def unreadable(self) -> int:
        """Unreadable training images of the part of the epoch done, all ranks (they ride in ``sums``)."""
        return means(self.sums)["unreadable"] if self.sums else 0

    def at_step(self, step: int, sums: Optional[list], skipped: Optional[list] = None,
                trained: bool = False) -> "Progress":
        """This epoch, ``step`` batches in (``trained``: its last), the unreadable images' paths met ``skipped``."""
        return dataclasses.replace(self, step=step, sums=sums, skipped=skipped or None, trained=trained and step > 0)

    def steps_done(self, iters: int, accum: int) -> int:
        """The run's optimizer steps before this point, at ``iters`` an epoch (a trained epoch's all)."""
        return (self.epoch + 1) * iters if self.trained else self.epoch * iters + self.step // accum

    def best_after(self, acc1: Optional[float]) -> float:
        """The best Acc@1 after an epoch that validated at ``acc1`` (None: it did not validate)."""
        return self.best_acc1 if acc1 is None else max(self.best_acc1, acc1)

    def next_epoch(self, acc1: Optional[float], record: Optional[dict] = None) -> "Progress":
        """The start of the next epoch, after one that validated at ``acc1`` (None: it did not;
        its metrics row: ``record``)."""
        return Progress(self.epoch + 1, 0, self.best_after(acc1), None, record, run_seconds=self.run_seconds)

    def state_dict(self) -> dict:
        out = {"epoch": self.epoch, "step_in_epoch": self.step, "best_acc1": self.best_acc1,
               "run_seconds": self.run_seconds}
        if self.step and self.sums is not None:
            out["train_partial"] = self.sums
        if self.step and self.trained:
            out["epoch_trained"] = True
        if self.step and self.skipped:
            out["skipped_partial"] = list(self.skipped)
        if self.record is not None:
            out["epoch_record"] = self.record
        return out

    def load_state_dict(self, state: dict) -> None:
        # Older checkpoints hold no sums: a resumed epoch's metrics then cover its steps after the resume.
        self.epoch = int(state["epoch"])
        self.best_acc1 = float(state.get("best_acc1", 0.0))
        self.step = int(state.get("step_in_epoch", 0))
        self.sums = state.get("train_partial") if self.step else None
        self.record = state.get("epoch_record")
        self.trained = bool(self.step and state.get("epoch_trained"))
        self.skipped = ([str(p) for p in state.get("skipped_partial") or []] or None) if self.step else None
        self.run_seconds = float(state.get("run_seconds", 0.0))


def build_training(cfg, ctx, num_classes: int, iters_per_epoch: int, start: Optional[tuple] = None,
                   precision: Optional[Precision] = None) -> TrainState:
    """The unwrapped training state for ``cfg`` on ``ctx.device``. ``start``: (state dict,
    where it came from) to begin from (``--pretrained``, ``--weights``); ``precision``: a
    precision object to use instead of ``cfg``'s (benchmarks of a variant). The caller seeds
    the RNGs first: the model's initialisation draws from them."""
    cfg = resolved(cfg, ctx)
    model = create_model(cfg.arch, num_classes, cfg.small_stem,
                         use_stem_kernels(cfg.maxpool_kernel, ctx.device, cfg.channels_last, cfg.small_stem),
                         use_bn_kernels(cfg.bn_kernel, ctx.device),
                         use_conv_stats(cfg.bn_kernel, ctx.device, cfg.half_dtype), blurpool=cfg.blurpool)
    if start is not None:
        load_weights_into(model, *start)
    if cfg.sync_bn:
        if not ctx.distributed:
            logger.warning("=> --sync-bn applies to DDP only; ignored in %s mode", ctx.mode)
        elif ctx.device.type != "cuda":
            raise UserError("--sync-bn needs CUDA GPUs (SyncBatchNorm has no CPU kernels); drop it for "
                            "gloo runs on CPUs")
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(ctx.device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    precision = precision or build_precision(cfg, ctx.device)
    model = precision.prepare_model(model)  # before the optimizer: it may swap parameters for masters
    lars = optim.LarsSettings(cfg.lars_eta, cfg.lars_eps) if cfg.optimizer == "lars" else None
    groups = precision.param_groups(optim.param_groups(model, cfg.weight_decay, cfg.no_bn_weight_decay,
                                                       lars=lars is not None))
    optimizer = optim.build_optimizer(groups, cfg.lr, cfg.momentum, cfg.weight_decay, cfg.optimizer_impl,
                                      ctx.device, lars=lars)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(cfg, iters_per_epoch))
    ema = ModelEma(model, precision, cfg.model_ema) if cfg.model_ema else None
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing).to(ctx.device)
    mixer, train_criterion = None, criterion
    if cfg.mixup > 0 or cfg.cutmix > 0:  # soft labels carry the smoothing; the training loss adds none
        mixer = BatchMixer(num_classes, cfg.mixup, cfg.cutmix, cfg.label_smoothing,
                           seed=cfg.seed if cfg.seed is not None else 0, rank=ctx.rank)
        train_criterion = nn.CrossEntropyLoss().to(ctx.device)
    return TrainState(model, optimizer, scheduler, precision, criterion, train_criterion, ema, mixer)


def wrap_training(state: TrainState, cfg, ctx, **ddp_options) -> TrainState:
    """The state with its model wrapped for the launch mode (DataParallel, DDP) and compiled as
    ``--compile`` says, after any weights are loaded (DDP broadcasts rank 0's at wrapping): one
    graph per training size (``--progressive-resize``). Its evaluator, validation's forward
    (``--val-flip``), runs DDP's inner module (DDP's forward may talk to the other ranks, whose
    validation shards differ in length) and DataParallel's wrapper (which splits the batch over its
    GPUs); where the model is compiled it is compiled apart, fed batches of one size
    (:class:`FixedBatch`), so validation compiles once too."""
    cfg = resolved(cfg, ctx)
    wrapped = distributed.wrap(state.model, ctx, **ddp_options)
    ddp = ddp_of(wrapped)
    state.evaluator = Evaluator(ddp.module if ddp is not None else wrapped, cfg.val_flip)
    state.model = compile_model(wrapped, cfg.compile, ctx.mode, tune=cfg.tune_kernels,
                                shapes=len(training_sizes(cfg)))
    if cfg.accum_steps > 1 and cfg.compile in CUDA_GRAPH_MODES:  # the passes add into buffers of the run's
        state.precision.hold_gradients(wrapped)
    if cfg.compile != "off":
        state.evaluator = FixedBatch(compile_model(state.evaluator, cfg.compile, ctx.mode, tune=cfg.tune_kernels),
                                     micro_batch_size(cfg, ctx))
    return state
