"""Wiring: dist -> data -> training state -> resume -> epochs.

:func:`execute` runs what :func:`imagenet.cli.main` (``main.py``; ``main`` here too) parsed;
:func:`run` trains (or evaluates) one process's share.
A run's state lives in a :class:`imagenet.training.state.TrainState` (model, optimizer, schedule,
precision, weight average) and a :class:`imagenet.training.state.Progress` (epoch, step, best Acc@1);
its outputs are written by a :class:`imagenet.training.runlog.RunLog` and its checkpoints by a
:class:`imagenet.training.savepolicy.CheckpointPolicy`. :func:`_epochs` is the recipe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..base import checkpoint as ckpt_io
from ..base.config import Config
from ..base.errors import UserError, user_error
from ..base.metrics import EpochRecord
from ..base.paths import default_cache_dir
from ..base.processenv import ProcessEnv, set_process_env
from ..base.torch_private import compiled_graphs, set_last_lr
from ..base.wrappers import uncompiled, unwrap
from ..data import dataorder
from ..data.loaders import DataBundle, build_datasets, build_loaders, micro_batch_size, per_process_batch
from ..data.transforms import ValGeometry, image_size_at, progressive_ramp, training_sizes, val_geometry
from ..models.evaluation import Evaluator, nonfinite_statistics
from ..models.registry import (has_blur, has_conv_stats, has_fused_bn, has_stem_kernels, pretrained_state_dict,
                               pretrained_weights)
from ..parallel import distributed
from ..parallel.preemption import Preempted, StopRequest
from ..parallel.spawn import spawn_per_gpu
from ..precision import Precision, configure_tf32, describe
from .cadence import RunClock, not_validated, reached, validates
from .defaults import Machine, SpeedPlan, resolve, usable_cpus, with_environment
from .engine import LoopOptions, Steady, skipped_so_far, train_one_epoch, validate
from .resume import resume_from
from .runlog import RunLog
from .savepolicy import CheckpointPolicy
from .state import Progress, TrainState, build_training, wrap_training
from .tblog import require_tensorboard

logger = logging.getLogger("imagenet")


def execute(cfg: Config, env: Optional[ProcessEnv] = None) -> int:
    """Run a parsed command line (one process, or one per GPU; ``env``: what the command line's
    entry set in the environment before importing torch); user errors become one line and exit
    status 2, a bug its traceback and status 1."""
    try:
        if cfg.multiprocessing_distributed:
            return spawn_per_gpu(cfg, functools.partial(run, env=env))
        run(cfg, env)
        return 0
    except UserError as e:
        return user_error(e)
    except torch.cuda.OutOfMemoryError:
        return user_error(UserError(
            f"the GPU ran out of memory with -b {cfg.batch_size} (--accum-steps {cfg.accum_steps}): give --accum-steps N "
            "to run each optimizer step as N passes of fewer images (the same steps, the same learning rate), or a "
            "smaller -b with its learning rate scaled"))
    except Preempted as e:
        print(f"=> {e}", flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except distributed.PeerFailure as e:
        # A peer that stalled or died is no bug here: one line, and status 1, after which a
        # launcher may restart the group.
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        # A bug, not a user error: show it, and return so the interpreter can end the data
        # workers (an exception escaping main could leave them waiting).
        traceback.print_exc()
        return 1


def _setup_logging(ctx: distributed.DistContext) -> None:
    log = logging.getLogger("imagenet")
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    prefix = "" if ctx.is_main else f"[rank {ctx.rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if ctx.is_main else logging.WARNING)
    log.propagate = False


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def _prepare_output_dir(path: str, ctx: distributed.DistContext) -> None:
    if not ctx.is_main:
        return
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"--output-dir {path} is not writable ({e.strerror or e}); choose another folder")


def _resolve_data_root(cfg: Config) -> Optional[str]:
    if cfg.dummy:
        return None
    if cfg.data:
        return cfg.data
    from ..data.images.prepare import ensure_builtin_mnist
    return str(ensure_builtin_mnist(cfg.cache_dir or default_cache_dir()))


def _banner(cfg: Config, ctx, data: DataBundle, state: TrainState, source: str, val: ValGeometry, weights,
            plan: SpeedPlan) -> None:
    n_params = sum(p.numel() for p in state.model.parameters())
    per_dev = per_process_batch(cfg.batch_size, ctx)
    if ctx.mode == "dp":
        per_dev = f"~{cfg.batch_size // len(ctx.device_ids)} (split by DataParallel over {len(ctx.device_ids)} GPUs)"
    elif ctx.distributed:
        per_dev = f"{per_dev} ({ctx.world_size} processes)"
    logger.info("=> mode: %s", ctx.describe())
    if ctx.mode == "dp":
        logger.info("=> hint: python -m multiproc main.py ... runs one process per GPU (DDP) and is faster")
    what = (f"{data.layout}, {len(data.classes)} classes" if data.layout else
            f"{len(data.train)} train / {len(data.val)} val images, {len(data.classes)} classes")
    logger.info("=> data: %s (%s); train crop %d px, val %d px of %d%s", source, what, cfg.image_size, val.crop,
                val.resize, f" ({val.source}; --val-resize overrides)" if val.source else "")
    logger.info("=> input: %s%s", data.pipeline,
                "" if cfg.dummy else f"; {cfg.workers} worker{'' if cfg.workers == 1 else 's'}")
    cpus = usable_cpus()
    if not cfg.dummy and cfg.workers > cpus:  # what torch warns of at every loader and epoch, said once
        logger.info("=> note: -j %d asks for more data workers than the %d CPU core%s this process may use: all %d "
                    "run, taking turns on %s (-j %d or fewer gives each a core of its own)", cfg.workers, cpus,
                    "" if cpus == 1 else "s", cfg.workers, "it" if cpus == 1 else "them", cpus)
    logger.info("=> model: %s%s, %.1fM parameters, %s%s", cfg.arch, (" (small stem)" if cfg.small_stem else "") +
                (" with BlurPool (a blur before each strided convolution)" if has_blur(state.model) else ""),
                n_params / 1e6, "channels_last" if cfg.channels_last else "contiguous",
                f"; from torchvision's {weights.name} weights ({weights.acc1:.3f}% ImageNet Acc@1 published)"
                if weights is not None else "")
    logger.info("=> precision: %s", describe(state.precision, cfg.tf32, ctx.device))
    kernels = [k for k, on in (("stem max-pool on Triton kernels", has_stem_kernels(state.model)),
                               ("BatchNorm + add + ReLU fused in Triton", has_fused_bn(state.model)),
                               ("BatchNorm statistics made by cuDNN's fused convolutions (nvidia-cudnn-frontend)",
                                has_conv_stats(state.model)),
                               ("Inductor tunes its kernels (--tune-kernels; the first steps take minutes)",
                                cfg.tune_kernels)) if on]
    if kernels:
        logger.info("=> kernels: %s", "; ".join(kernels))
    for choice in plan.choices:
        logger.info("=> default: %s", choice.line())
    for note in plan.notes:
        logger.info("=> note: %s", note)
    if cfg.compile != "off":
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        warm = bool(cache) and os.path.isdir(cache) and any(os.scandir(cache))
        # ResNet-50 -b 256 --fp16 on an H200 (16 cores): first step 45.5 s with empty caches, 13.5 s warm
        logger.info("=> compile: torch.compile %s: the first steps wait for it (ResNet-50 on an H200: about 45 s "
                    "with empty caches, 15 s from them; longer with fewer CPU cores); its cache %s is %s",
                    cfg.compile, cache or "(torch's default)", "filled by an earlier run" if warm else
                    "empty: this run fills it for the next one")
        if cfg.prof > 0:
            logger.info("=> note: --prof %d times a few steps, and most of this run's time is compiling; "
                        "--compile off profiles the eager model", cfg.prof)
    if cfg.progressive_resize:
        sizes, (ramp_first, ramp_last) = training_sizes(cfg), progressive_ramp(cfg)
        logger.info("=> progressive resize: %d training size%s, %s px (from epoch %d to %d, in steps of "
                    "--progressive-step %d px)%s", len(sizes), "" if len(sizes) == 1 else "s",
                    ", ".join(map(str, sizes)), ramp_first, ramp_last, cfg.progressive_step,
                    f"; torch.compile compiles a graph for each, at its first step, and one for validation at "
                    f"{val.crop} px" if cfg.compile != "off" else "")
    if ctx.device.type == "cpu" and cfg.precision_name in ("fp16", "amp-fp16"):
        # Measured on a 2-core x86 CPU, ResNet-18 at 64 px: fp32 0.12 s a step, --fp16 4.5 s,
        # --amp float16 4.5 s, --amp bfloat16 0.10 s.
        logger.warning("=> warning: %s on a CPU runs about 36x slower than fp32 (CPUs have no fast float16 "
                       "arithmetic); --amp --amp-dtype bfloat16 trains in mixed precision at fp32 speed here, "
                       "or drop %s", "--fp16" if cfg.fp16 else "--amp float16", "--fp16" if cfg.fp16 else "--amp")
    logger.info("=> batch: global %d, per device %s; lr %g, %s schedule, %d epochs%s", cfg.batch_size, per_dev,
                cfg.lr, cfg.lr_schedule, cfg.epochs, f"; LARS (trust coefficient {cfg.lars_eta:g}, no scaling or decay "
                "of BatchNorm parameters and biases)" if cfg.optimizer == "lars" else "")
    if cfg.eval_every > 1 or cfg.eval_start > 0 or cfg.target_acc is not None:
        logger.info("=> validation: after epoch %d and every %d from there, and after the last (%d)%s", cfg.eval_start,
                    cfg.eval_every, cfg.epochs - 1, "" if cfg.target_acc is None else
                    f"; the run stops once Acc@1 reaches {cfg.target_acc:g} (--target-acc)")
    if cfg.prof > 0:
        logger.info("=> --prof %d: %d optimizer steps of one epoch and part of its validation, for profiling; no "
                    "checkpoint is written, and the epoch's row goes to prof.jsonl, not metrics.jsonl (its options to "
                    "prof-config.yaml, not config.yaml)", cfg.prof, cfg.prof)
    if cfg.accum_steps > 1:
        logger.info("=> gradient accumulation: %d forward/backward passes of %d images per process make one "
                    "optimizer step", cfg.accum_steps, micro_batch_size(cfg, ctx))


def run(cfg: Config, env: Optional[ProcessEnv] = None) -> dict:
    """Train (or with ``--evaluate`` validate) as configured; returns the final summary. Every
    ``auto`` of the config is decided here, once, for this machine (:mod:`.defaults`). ``env``:
    the environment the command line set before torch was imported; a caller that imported
    torch itself (a test, a benchmark) gets it set here, too late for what torch read on import."""
    started = time.perf_counter()
    if env is None:
        env = set_process_env(os.environ, cache_root=str(cfg.cache_dir or default_cache_dir()))
    ctx = distributed.setup(cfg)
    _setup_logging(ctx)
    machine = Machine.of(ctx, cfg.decode, cfg.data, cfg.bn_kernel, cfg.half_dtype)
    plan = with_environment(resolve(cfg, machine), env, ctx.device.type)
    try:
        with contextlib.ExitStack() as held:  # what the run holds open (the data's files) is released at its end
            return _run(plan.apply(cfg), ctx, plan, started, requested=cfg, held=held)
    except RuntimeError as e:
        failure = distributed.peer_failure(e, ctx, cfg.dist_timeout)
        if failure is None:
            raise
        raise failure from e
    finally:
        distributed.cleanup(ctx)


@dataclass
class _Start:
    """What start-up made: the data, its loaders, the training state and where it begins."""

    data: DataBundle
    train_loader: object
    val_loader: object
    state: TrainState
    progress: Progress
    iters: int  # optimizer steps per epoch
    data_order: Optional[dict] = None  # what decides the training data's order (data.dataorder), for checkpoints


def _run(cfg: Config, ctx: distributed.DistContext, plan: SpeedPlan, started: float, requested: Config,
         held: contextlib.ExitStack) -> dict:
    seed = cfg.seed if cfg.seed is not None else 0
    _seed_everything(seed)  # same model initialisation on every rank
    if ctx.device.type == "cuda":
        configure_tf32(cfg.tf32)
        torch.backends.cudnn.benchmark = not cfg.deterministic
        torch.backends.cudnn.deterministic = cfg.deterministic
    # Start-up errors (a flag, the data, the output dir, a checkpoint) may hit one rank only, e.g.
    # an output dir that only rank 0 writes. Every rank reports before the first collective (DDP's
    # weight broadcast), so all stop with a message instead of waiting on, or losing, a peer.
    failure, start = None, None
    try:
        start = _start(cfg, ctx, seed, plan, held)
    except Exception as e:  # a user error, or any other start-up failure: the other ranks must hear of it
        failure = e
    distributed.agree_started(failure, ctx)
    state, progress = wrap_training(start.state, cfg, ctx), start.progress  # the same objects as start's
    if not cfg.evaluate and progress.epoch >= cfg.epochs:
        logger.info("=> nothing left to train: the run is at epoch %d of --epochs %d (raise --epochs to train "
                    "further, or use -e to evaluate it)", progress.epoch, cfg.epochs)
        return _nothing_trained(progress)
    if not cfg.evaluate and reached(cfg, progress.best_acc1):
        logger.info("=> nothing left to train: the run reached --target-acc %g before epoch %d (best Acc@1 %.3f); "
                    "raise --target-acc, or drop it, to train further", cfg.target_acc, progress.epoch,
                    progress.best_acc1)
        return _nothing_trained(progress)
    # The schedule is a function of the iteration: start it where this epoch begins, also when
    # the batch size or dataset changed since the checkpoint, or --start-epoch moved the start.
    _align_schedule(state.scheduler, progress.steps_done(start.iters, cfg.accum_steps))
    display = cfg.progress if cfg.progress != "auto" else ("bar" if sys.stdout.isatty() else "lines")
    opts = LoopOptions(cfg.print_freq, display, cfg.prof * cfg.accum_steps if cfg.prof > 0 else None,
                       cfg.max_nonfinite_steps, (3, cfg.image_size, cfg.image_size), cfg.accum_steps)
    if cfg.evaluate:
        _check_statistics(state.model, ctx)
        return validate(model=state.model, loader=start.val_loader, criterion=state.criterion,
                        precision=state.precision, ctx=ctx, opts=opts, forward=state.evaluator).to_dict()
    with StopRequest(ctx) as stop, RunLog(cfg, ctx, requested, environment=plan.environment) as log:
        return _epochs(cfg, ctx, start, opts, stop, log, started)


def _start(cfg: Config, ctx, seed: int, plan: SpeedPlan, held: contextlib.ExitStack) -> _Start:
    """Everything before the first collective: output folder, data, loaders, the training state
    (unwrapped) and, with ``--resume``, its checkpoint."""
    _prepare_output_dir(cfg.output_dir, ctx)
    if cfg.tensorboard:
        require_tensorboard()  # every rank, before any collective (rank 0 writes the events)
    weights = pretrained_weights(cfg.arch, cfg.pretrained) if cfg.pretrained else None
    val_geo = val_geometry(cfg, weights)
    if cfg.decode == "gpu" and not cfg.dummy and ctx.device.type != "cuda":  # before looking for a GPU decoder
        raise UserError(f"--decode gpu needs a CUDA GPU; this run is on {ctx.device}: drop --decode gpu")
    root = _resolve_data_root(cfg)
    data = held.enter_context(build_datasets(cfg, root, val_geo, ctx.device))
    if cfg.dummy:
        source = "synthetic data (--dummy)"
    else:
        source = root if cfg.data else f"built-in MNIST-5k ({root})"
    train_loader, val_loader = build_loaders(cfg, data, ctx, seed)
    for loader in (train_loader, val_loader):
        held.callback(loader.close)  # its workers end with the run, also one that fails
    iters = len(train_loader) // cfg.accum_steps  # optimizer steps per epoch
    iters = iters if cfg.prof < 0 else min(iters, cfg.prof)
    state = build_training(cfg, ctx, len(data.classes), iters, start=_starting_weights(cfg, weights))
    if ctx.is_main:
        _banner(cfg, ctx, data, state, source, val_geo, weights, plan)
    # Augmentations are seeded per sample (data.SeededSampler); any other randomness drawn
    # from here on (none in a plain ResNet) gets a stream of its own on each rank.
    torch.manual_seed(seed + ctx.rank)
    progress = Progress()
    # a process an elastic launcher restarted after a failure continues from the newest checkpoint
    resume_path = ckpt_io.resolve_resume(cfg.resume, cfg.output_dir, restarted=ctx.restart_count > 0)
    if cfg.evaluate and not (resume_path or cfg.weights or cfg.pretrained):
        raise UserError("-e/--evaluate needs weights to evaluate: give --resume CHECKPOINT, --weights PATH "
                        "or --pretrained" + (" (--resume auto found no checkpoint)" if cfg.resume else ""))
    order = None if cfg.evaluate else dataorder.fingerprint(data.train, train_loader.sampler)
    if resume_path:
        progress = resume_from(resume_path, cfg, ctx, state, len(data.classes), order)
    if cfg.start_epoch is not None:
        progress = Progress(cfg.start_epoch, 0, progress.best_acc1, run_seconds=progress.run_seconds)
    return _Start(data, train_loader, val_loader, state, progress, iters, order)


def _nothing_trained(progress: Progress) -> dict:
    """The summary of a run that had nothing left to train."""
    return {"best_acc1": progress.best_acc1, "last_acc1": None, "epochs_run": 0, "seconds": 0.0, "img_per_s": 0.0,
            "last": {}}


def _starting_weights(cfg: Config, weights) -> Optional[tuple]:
    if weights is not None:
        return pretrained_state_dict(weights), f"torchvision {cfg.arch} {weights.name} weights"
    if cfg.weights:
        state = ckpt_io.read_checkpoint(cfg.weights)
        state = state.get("state_dict", state)
        if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UserError(f"--weights {cfg.weights} holds no state dict of tensors; give a model "
                            "state dict or a checkpoint written by this trainer")
        return state, cfg.weights
    return None


def _scheduled_lrs(scheduler, iteration: int) -> list:
    """The rates of the optimizer's parameter groups at ``iteration`` of the schedule."""
    return [base * fn(iteration) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]


def _align_schedule(scheduler, iteration: int) -> None:
    scheduler.last_epoch = iteration
    lrs = _scheduled_lrs(scheduler, iteration)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(scheduler, lrs)


def _epochs(cfg: Config, ctx, start: _Start, opts: LoopOptions, stop: StopRequest, log: RunLog,
            started: float) -> dict:
    """The recipe: per epoch, train (saving every --save-every-steps; a stop signal saves and
    ends the run), validate (and the weight average), save, report."""
    state, progress = start.state, start.progress
    clock = RunClock(progress.run_seconds)
    saver = CheckpointPolicy(cfg, ctx, start.data.classes, start.data_order, clock=clock.seconds)
    log.catch_up(progress.record)  # the last epoch's row, where the run died before writing it
    run_start = time.perf_counter()
    first = _FirstStep(started, ctx, cfg.compile, clock)
    steady, epochs_run, last, target = Steady(), 0, {}, None
    for epoch in range(progress.epoch, cfg.epochs):  # progress.epoch == epoch inside
        epoch_start = time.perf_counter()
        # the rate of the epoch's first step (state.lr's group); one resumed in its middle took
        # that step in an earlier process, at the rate the schedule gives there
        lr_start = state.lr if progress.step == 0 else _scheduled_lrs(state.scheduler, epoch * start.iters)[0]
        size = _begin_epoch(cfg, ctx, start.train_loader, progress, first=epochs_run == 0)
        first.begin(size)
        train = train_one_epoch(state=state, progress=progress, loader=start.train_loader, ctx=ctx, opts=opts,
                                stop=stop.should_stop,
                                on_step=first.hook(saver.step_hook(state, progress, start.iters * cfg.accum_steps)))
        if not train.completed:
            skipped = skipped_so_far(progress.skipped, train.skipped_paths, ctx)
            raise saver.stopped(state, progress.at_step(train.steps_done, train.sums, skipped), stop)
        clock.start()  # where no step ran (a resume after the epoch's last step), from here, before its validation
        first.trained()
        # --decode gpu: where the epoch's training batches spent their time, this process's
        stages = start.train_loader.stage_account() if cfg.decode == "gpu" and not cfg.dummy else {}
        val_start = time.perf_counter()
        if validates(cfg, epoch):
            val, averaged, decoded = _validate(cfg, ctx, start, state, opts)
        else:
            val, averaged, decoded = not_validated(), {}, _decode_counts(cfg, ctx, start.train_loader, start.val_loader)
        val_seconds = time.perf_counter() - val_start
        seconds = clock.seconds()  # the clock at the end of the validation (MLPerf's stops there)
        target = (epoch, seconds) if reached(cfg, val.acc1) else None
        skipped = _count_skipped(cfg, ctx, log, train.skipped_paths + val.skipped_paths, epoch,
                                 len(start.data.train) + len(start.data.val), before=progress)
        is_best = saver.is_best(val.acc1, progress)
        compiles = first.compiles(epoch, validated=val.acc1 is not None)
        record = EpochRecord(
            epoch=epoch, lr=lr_start, lr_end=state.lr, train_loss=train.loss, train_acc1=train.acc1,
            train_acc5=train.acc5, train_samples=train.samples, steps=train.steps, skipped_steps=train.skipped_steps,
            img_per_s=train.img_per_s, data_wait_frac=train.data_wait_frac, train_seconds=train.seconds,
            val_loss=val.loss, val_acc1=val.acc1, val_acc5=val.acc5, val_samples=val.samples, val_seconds=val_seconds,
            epoch_seconds=time.perf_counter() - epoch_start, skipped_images=skipped,
            loss_scale=state.precision.loss_scale, skipped_steps_total=state.precision.skipped_steps,
            best_acc1=progress.best_after(val.acc1), precision=state.precision.name, mode=ctx.mode,
            image_size=size, world_size=ctx.world_size, restarts=ctx.restart_count, run_seconds=seconds,
            seconds_to_target=seconds if target else None, input_stages=stages or None, compiles=compiles,
            **averaged, **decoded).to_dict()
        progress = progress.next_epoch(val.acc1, record)
        steady, epochs_run, last = steady + train.steady, epochs_run + 1, record
        saver.save(state, progress, is_best)  # first: a metrics line never describes an epoch the checkpoint lacks
        log.epoch(record, train, state.precision.loss_scale, stages)
        if cfg.prof > 0 or target:
            break
    summary = log.summary(progress.best_acc1, last, epochs_run, time.perf_counter() - run_start, steady, target)
    return dict(summary, first_step_seconds=first.seconds)


class _FirstStep:
    """Says how long the run waited for its first optimizer step (start-up, the loaders' first
    batch, cuDNN's search and, under --compile, the compilation, which a second run of the same
    command reads from its cache), and for the first step at each later training size
    (--progressive-resize: that size's compilation and cuDNN search); counts the graphs
    torch.compile compiled in each epoch (training and validation)."""

    def __init__(self, started: float, ctx, compile_mode: str, clock: Optional[RunClock] = None):
        self.started, self.ctx, self.compile_mode, self.clock = started, ctx, compile_mode, clock
        self.seconds: Optional[float] = None
        self.size, self.epoch_started, self.sizes_done, self.new_size = 0, started, set(), True
        self.graphs = compiled_graphs() if compile_mode != "off" else None
        self.trained_at, self.validated_before = self.graphs, False

    def begin(self, size: int) -> None:
        """An epoch at ``size`` px starts."""
        self.size, self.epoch_started, self.new_size = size, time.perf_counter(), size not in self.sizes_done

    def trained(self) -> None:
        """The epoch's training is done: the graphs compiled since :meth:`begin` are training's."""
        if self.graphs is not None:
            self.trained_at = compiled_graphs()

    def compiles(self, epoch: int, validated: bool) -> Optional[int]:
        """Graphs torch.compile compiled since the last call, the epoch's (None: not compiled);
        a line where training compiled at a size an earlier epoch had compiled for, or validation
        (one size, compiled at the first validated epoch) compiled again."""
        if self.graphs is None:
            return None
        now = compiled_graphs()
        count, training, self.graphs = now - self.graphs, self.trained_at - self.graphs, now
        again = (training if not self.new_size else 0) + (count - training if self.validated_before else 0)
        if again:
            logger.warning("=> note: epoch %d compiled %d graph%s again at %d px, a size already compiled "
                           "(TORCH_LOGS=recompiles says which guard failed)", epoch, again, "" if again == 1 else "s",
                           self.size)
        self.validated_before = self.validated_before or validated
        return count

    def hook(self, inner: Optional[Callable]) -> Callable:
        """The training loop's ``on_step``: ``inner``'s, timing the first step at each size first."""
        def on_step(done: int, so_far: Callable) -> None:
            if self.size not in self.sizes_done:
                self.sizes_done.add(self.size)
                if self.ctx.device.type == "cuda":
                    torch.cuda.synchronize(self.ctx.device)  # once a size: the step's work done, not queued
                now = time.perf_counter()
                compiled = f" (torch.compile {self.compile_mode} included)" if self.compile_mode != "off" else ""
                if self.seconds is None:
                    self.seconds = now - self.started
                    logger.info("=> first step done %.1f s after start%s", self.seconds, compiled)
                    if self.clock is not None:
                        self.clock.start()
                else:
                    logger.info("=> first step at %d px done %.1f s after the epoch's start%s", self.size,
                                now - self.epoch_started, compiled)
            if inner is not None:
                inner(done, so_far)
        return on_step


def _begin_epoch(cfg: Config, ctx, loader, progress: Progress, first: bool) -> int:
    """Point the loader at ``progress.epoch`` (its shuffle, the batches already done, the crop
    size); returns the epoch's training crop size. ``first``: the run's first epoch."""
    epoch = progress.epoch
    loader.sampler.set_epoch(epoch)
    # a trained epoch (resumed after its last step) takes no batch, also where the data has more now
    done = max(progress.step, len(loader)) if progress.trained else progress.step
    loader.sampler.set_start(done * micro_batch_size(cfg, ctx))
    size = image_size_at(epoch, cfg)
    if cfg.progressive_resize:
        loader.sampler.set_image_size(size)
        if ctx.is_main and (first or size != image_size_at(epoch - 1, cfg)):
            logger.info("=> epoch %d: training crops of %d px (--progressive-resize %d -> %d)", epoch, size,
                        cfg.progressive_resize, cfg.image_size)
    return size


def _validate(cfg: Config, ctx, start: _Start, state: TrainState, opts: LoopOptions) -> tuple:
    """The epoch's validation: its result, the weight average's metrics (``*_ema`` columns) and
    the images decoded on and off the GPU (``--decode gpu``)."""
    # Under DDP the ranks' BatchNorm statistics were averaged after the epoch's last step
    # (engine._average_statistics): every rank scores the model rank 0 saves. The evaluator is
    # compiled where the training model is, with graphs of its own (state.wrap_training).
    _check_statistics(state.model, ctx)
    val = validate(model=uncompiled(state.model), loader=start.val_loader, criterion=state.criterion,
                   precision=state.precision, ctx=ctx, opts=opts, forward=state.evaluator)
    decoded = _decode_counts(cfg, ctx, start.train_loader, start.val_loader)  # before the average's pass
    if state.ema is None:
        return val, {}, decoded
    # the average is an fp32 model: evaluate it in fp32 (uncompiled: a graph of its own would be one more wait)
    ema = validate(model=state.ema.model, loader=start.val_loader, criterion=state.criterion, precision=Precision(),
                   ctx=ctx, opts=opts, name="weight average", forward=Evaluator(state.ema.model, cfg.val_flip))
    # The same images again: their decodes and unreadable files were counted once, above.
    start.val_loader.decode_counts()
    return val, {"val_loss_ema": ema.loss, "val_acc1_ema": ema.acc1, "val_acc5_ema": ema.acc5}, decoded


def _check_statistics(model, ctx) -> None:
    """Before a validation: one warning naming the BatchNorm layers whose running statistics went
    NaN/inf (an overflowed forward on torch's BatchNorm), which make it NaN."""
    broken = nonfinite_statistics(unwrap(model))
    if broken and ctx.is_main:
        logger.warning("=> warning: the running statistics of %d BatchNorm layer%s (%s) are NaN/inf (a forward pass "
                       "overflowed), so validation is NaN from now on: resume from a checkpoint saved before it "
                       "(model_best.pth.tar) with a lower --lr", len(broken), "s" if len(broken) > 1 else "",
                       ", ".join(broken[:3]) + (", ..." if len(broken) > 3 else ""))


def _decode_counts(cfg, ctx, train_loader, val_loader) -> dict:
    """--decode gpu: this epoch's images decoded on the GPUs / on CPUs instead / by the workers as
    their share of the JPEGs, train and val, all ranks (every rank calls this)."""
    if cfg.decode != "gpu":
        return {}
    counts = [loader.decode_counts() for loader in (train_loader, val_loader)]
    sums = torch.tensor([float(sum(c[k] for c in counts)) for k in ("gpu", "cpu", "share")], device=ctx.device)
    gpu, cpu, share = distributed.all_reduce_sum(sums, ctx).tolist()
    return {"decoded_on_gpu": int(gpu), "decode_fallbacks": int(cpu), "decoded_by_workers": int(share)}


def exceeds_bad_fraction(count: int, total: int, limit: float) -> bool:
    """Whether ``count`` unreadable images of ``total`` are more than ``--max-bad-fraction limit``
    tolerates. The limit is the largest share allowed: exactly at it the run goes on (0 allows
    none, 1 never stops). ``count / total`` rounds to the same float as a decimal limit of the
    same value (7 of 100 at 0.07), where ``count > limit * total`` would not (0.29 * 100 is
    28.999999999999996, so 29 of 100 would stop at 0.29)."""
    return total > 0 and count / total > limit


def _count_skipped(cfg: Config, ctx, log: RunLog, paths: list, epoch: int, total_images: int,
                   before: Optional[Progress] = None) -> int:
    """Unreadable images of the epoch over all ranks (every rank calls this), listed with every
    rank's paths; too many stop the run. ``paths``: this process's; ``before``: where a mid-epoch
    resume started the epoch (the training images counted before it, and the paths it carried)."""
    earlier, listed = (before.unreadable, list(before.skipped or [])) if before is not None else (0, [])
    count = torch.tensor([float(len(paths))], device=ctx.device)
    count = int(distributed.all_reduce_sum(count, ctx).item()) + earlier
    if count > earlier:  # every rank knows: the paths of all of them, for the list rank 0 writes
        listed += [path for mine in distributed.gather_objects(paths, ctx) for path in mine]
    log.skipped_images(epoch, listed, count, unlisted=count - len(listed))
    if exceeds_bad_fraction(count, total_images, cfg.max_bad_fraction):
        raise UserError(f"{count} of {total_images} images could not be read in epoch {epoch}, more than "
                        f"--max-bad-fraction {cfg.max_bad_fraction}; check the dataset (see skipped_images.txt)")
    return count
