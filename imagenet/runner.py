"""Wiring: dist -> data -> model -> precision -> optimizer -> resume -> epochs.

:func:`main` is what ``main.py`` calls; :func:`run` trains (or evaluates) one process's share.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
import traceback
from typing import Optional

import numpy as np
import torch
import yaml
import torch.nn as nn

from . import checkpoint as ckpt_io
from . import distributed, optim
from .config import Config, parse_config
from .data import (DataBundle, ValGeometry, build_datasets, build_loaders, image_size_at, micro_batch_size,
                   per_process_batch, val_geometry)
from .engine import LoopOptions, Steady, lr_lambda, train_one_epoch, validate
from .errors import EXIT_USER_ERROR, UserError
from .models import (compile_model, create_model, fit_state_dict, load_weights_into, pretrained_state_dict,
                     pretrained_weights)
from .ema import ModelEma
from .metrics import EpochRecord
from .mixing import BatchMixer
from .precision import Precision, build_precision, configure_tf32, describe
from .preemption import Preempted, StopRequest
from .tblog import TensorBoardLog, require_tensorboard
from .wrappers import strip_prefix, unwrap

logger = logging.getLogger("imagenet")


def main(argv: Optional[list] = None) -> int:
    """Command-line entry: parse, run, and turn user errors into one line and exit status 2."""
    try:
        cfg = parse_config(argv)
        if cfg.multiprocessing_distributed:
            return spawn_per_gpu(cfg)
        run(cfg)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Preempted as e:
        print(f"=> {e}", flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
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
    from .prepare import default_cache_dir, ensure_builtin_mnist
    return str(ensure_builtin_mnist(cfg.cache_dir or default_cache_dir()))


def _banner(cfg: Config, ctx, data: DataBundle, model: nn.Module, precision, source: str, val: ValGeometry,
            weights) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    per_dev = per_process_batch(cfg.batch_size, ctx)
    if ctx.mode == "dp":
        per_dev = f"~{cfg.batch_size // len(ctx.device_ids)} (split by DataParallel over {len(ctx.device_ids)} GPUs)"
    elif ctx.distributed:
        per_dev = f"{per_dev} ({ctx.world_size} processes)"
    logger.info("=> mode: %s", ctx.describe())
    if ctx.mode == "dp":
        logger.info("=> hint: python -m multiproc main.py ... runs one process per GPU (DDP) and is faster")
    logger.info("=> data: %s (%d train / %d val images, %d classes); train crop %d px, val %d px of %d%s",
                source, len(data.train), len(data.val), len(data.classes), cfg.image_size, val.crop, val.resize,
                f" ({val.source}; --val-resize overrides)" if val.source else "")
    logger.info("=> input: %s%s", data.pipeline,
                "" if cfg.dummy else f"; {cfg.workers} worker{'' if cfg.workers == 1 else 's'}")
    logger.info("=> model: %s%s, %.1fM parameters, %s%s", cfg.arch, " (small stem)" if cfg.small_stem else "",
                n_params / 1e6, "channels_last" if cfg.channels_last else "contiguous",
                f"; from torchvision's {weights.name} weights ({weights.acc1:.3f}% ImageNet Acc@1 published)"
                if weights is not None else "")
    logger.info("=> precision: %s", describe(precision, cfg.tf32, ctx.device))
    if ctx.device.type == "cpu" and cfg.precision_name in ("fp16", "amp-fp16"):
        # Measured on a 2-core x86 CPU, ResNet-18 at 64 px: fp32 0.12 s a step, --fp16 4.5 s,
        # --amp float16 4.5 s, --amp bfloat16 0.10 s.
        logger.warning("=> warning: %s on a CPU runs about 36x slower than fp32 (CPUs have no fast float16 "
                       "arithmetic); --amp --amp-dtype bfloat16 trains in mixed precision at fp32 speed here, "
                       "or drop %s", "--fp16" if cfg.fp16 else "--amp float16", "--fp16" if cfg.fp16 else "--amp")
    logger.info("=> batch: global %d, per device %s; lr %g, %s schedule, %d epochs", cfg.batch_size, per_dev,
                cfg.lr, cfg.lr_schedule, cfg.epochs)
    if cfg.accum_steps > 1:
        logger.info("=> gradient accumulation: %d forward/backward passes of %d images per process make one "
                    "optimizer step", cfg.accum_steps, micro_batch_size(cfg, ctx))


def run(cfg: Config) -> dict:
    """Train (or with ``--evaluate`` validate) as configured; returns the final summary."""
    ctx = distributed.setup(cfg)
    _setup_logging(ctx)
    try:
        return _run(cfg, ctx)
    finally:
        distributed.cleanup(ctx)


def _run(cfg: Config, ctx: distributed.DistContext) -> dict:
    seed = cfg.seed if cfg.seed is not None else 0
    _seed_everything(seed)  # same model initialisation on every rank
    if ctx.device.type == "cuda":
        configure_tf32(cfg.tf32)
        torch.backends.cudnn.benchmark = not cfg.deterministic
        torch.backends.cudnn.deterministic = cfg.deterministic
    # Start-up errors (a flag, the data, the output dir, a checkpoint) may hit one rank only, e.g.
    # an output dir that only rank 0 writes. Every rank reports before the first collective (DDP's
    # weight broadcast), so all stop with a message instead of waiting on, or losing, a peer.
    failure = None
    try:
        _prepare_output_dir(cfg.output_dir, ctx)
        if cfg.tensorboard:
            require_tensorboard()  # every rank, before any collective (rank 0 writes the events)

        weights = pretrained_weights(cfg.arch, cfg.pretrained) if cfg.pretrained else None
        val_geo = val_geometry(cfg, weights)
        root = _resolve_data_root(cfg)
        data = build_datasets(cfg, root, val_geo, ctx.device)
        if cfg.dummy:
            source = "synthetic data (--dummy)"
        else:
            source = root if cfg.data else f"built-in MNIST-5k ({root})"
        if cfg.decode == "gpu" and not cfg.dummy and ctx.device.type != "cuda":
            raise UserError(f"--decode gpu needs a CUDA GPU; this run is on {ctx.device}: drop --decode gpu")
        train_loader, val_loader = build_loaders(cfg, data, ctx, seed)

        model = create_model(cfg.arch, len(data.classes), cfg.small_stem)
        start = _starting_weights(cfg, weights)
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
        precision = build_precision(cfg, ctx.device)
        model = precision.prepare_model(model)
        groups = precision.param_groups(optim.param_groups(model, cfg.weight_decay, cfg.no_bn_weight_decay))
        optimizer = optim.build_optimizer(groups, cfg.lr, cfg.momentum, cfg.weight_decay, cfg.optimizer_impl,
                                          ctx.device)
        iters = len(train_loader) // cfg.accum_steps  # optimizer steps per epoch
        iters = iters if cfg.prof < 0 else min(iters, cfg.prof)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.lr_schedule, cfg.epochs, iters, cfg.warmup_epochs, cfg.lr_step, cfg.lr_gamma))
        if ctx.is_main:
            _banner(cfg, ctx, data, model, precision, source, val_geo, weights)
        ema = ModelEma(model, precision, cfg.model_ema) if cfg.model_ema else None
        criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing).to(ctx.device)
        mixer = None
        if cfg.mixup > 0 or cfg.cutmix > 0:  # soft labels carry the smoothing; the training loss adds none
            mixer = BatchMixer(len(data.classes), cfg.mixup, cfg.cutmix, cfg.label_smoothing)
        # Augmentations are seeded per sample (data.SeededSampler); any other randomness drawn
        # from here on (none in a plain ResNet) gets a stream of its own on each rank.
        torch.manual_seed(seed + ctx.rank)

        start_epoch, best_acc1, start_step, start_sums = 0, 0.0, 0, None
        resume_path = ckpt_io.resolve_resume(cfg.resume, cfg.output_dir)
        if cfg.evaluate and not (resume_path or cfg.weights or cfg.pretrained):
            raise UserError("-e/--evaluate needs weights to evaluate: give --resume CHECKPOINT, --weights PATH "
                            "or --pretrained" + (" (--resume auto found no checkpoint)" if cfg.resume else ""))
        if resume_path:
            start_epoch, best_acc1, start_step, start_sums = _resume(resume_path, cfg, len(data.classes), model,
                                                                     optimizer, scheduler, precision, ctx, ema)
        if cfg.start_epoch is not None:
            start_epoch, start_step, start_sums = cfg.start_epoch, 0, None
    except Exception as e:  # a user error, or any other start-up failure: the other ranks must hear of it
        failure = e
    distributed.agree_started(failure, ctx)
    model = compile_model(distributed.wrap(model, ctx), cfg.compile, ctx.mode)
    if not cfg.evaluate and start_epoch >= cfg.epochs:
        logger.info("=> nothing left to train: the run is at epoch %d of --epochs %d (raise --epochs to train "
                    "further, or use -e to evaluate it)", start_epoch, cfg.epochs)
        return {"best_acc1": best_acc1, "last_acc1": None, "epochs_run": 0, "seconds": 0.0, "img_per_s": 0.0,
                "last": {}}
    # The schedule is a function of the iteration: start it where this epoch begins, also when
    # the batch size or dataset changed since the checkpoint, or --start-epoch moved the start.
    _align_schedule(scheduler, start_epoch * iters + start_step // cfg.accum_steps)

    progress = cfg.progress if cfg.progress != "auto" else ("bar" if sys.stdout.isatty() else "lines")
    opts = LoopOptions(cfg.print_freq, progress, cfg.prof * cfg.accum_steps if cfg.prof > 0 else None,
                       cfg.max_nonfinite_steps, (3, cfg.image_size, cfg.image_size), cfg.accum_steps)
    if cfg.evaluate:
        result = validate(model, val_loader, criterion, precision, ctx, opts)
        result.pop("skipped_paths")
        return result
    return _train(cfg, ctx, data, model, precision, optimizer, scheduler, criterion, train_loader, val_loader,
                  opts, start_epoch, best_acc1, start_step, ema, mixer, start_sums)


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


def _align_schedule(scheduler, iteration: int) -> None:
    scheduler.last_epoch = iteration
    lrs = [base * fn(iteration) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


# Optimisation settings a resumed run takes from its command line, not from the checkpoint.
RESUME_OVERRIDES = ("lr", "momentum", "weight_decay", "epochs", "lr_schedule", "lr_step", "lr_gamma", "warmup_epochs",
                    "batch_size", "accum_steps")


def _resume(path: str, cfg: Config, num_classes: int, model, optimizer, scheduler, precision, ctx, ema) -> tuple:
    ckpt = ckpt_io.read_checkpoint(path)
    ckpt_io.require_keys(ckpt, path, ("state_dict", "optimizer", "epoch"))
    arch = ckpt.get("arch", cfg.arch)
    if arch != cfg.arch:
        raise UserError(f"{path} was trained as {arch}, not -a {cfg.arch}; pass -a {arch} to resume it")
    saved_classes = ckpt.get("num_classes")
    if saved_classes is not None and int(saved_classes) != num_classes:
        raise UserError(f"{path} was trained on {saved_classes} classes, this dataset has {num_classes}; "
                        "--resume continues the same run: to fine-tune from it use --weights")
    state = strip_prefix(ckpt["state_dict"])
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[0] != num_classes:
        raise UserError(f"{path} has a {fc.shape[0]}-class classifier, this dataset {num_classes} classes; "
                        "--resume continues the same run: to fine-tune from it use --weights")
    state = fit_state_dict(unwrap(model), state, path)
    precision.load_model_state_dict(model, state)  # exact fp32 masters where the mode keeps them
    if cfg.evaluate:  # evaluation needs the weights only
        return int(ckpt["epoch"]), float(ckpt.get("best_acc1", 0.0)), 0, None
    try:
        optim.load_optimizer_state(optimizer, ckpt["optimizer"])
        if "scheduler" in ckpt:
            # The schedule is this run's (its lr, --epochs, --lr-schedule), placed at the checkpoint's
            # iteration by _align_schedule: the saved base lrs would bring the old --lr back.
            base_lrs = scheduler.base_lrs
            scheduler.load_state_dict(ckpt["scheduler"])
            scheduler.base_lrs = base_lrs
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"optimizer state in {path} does not fit this run ({e}); resume with the same "
                        "--no-bn-weight-decay setting it was saved with, or start from it with --weights")
    precision.load_state_dict(ckpt.get("precision") or {})
    if ema is not None:
        if "state_dict_ema" in ckpt:
            ema.load_state_dict(ckpt["state_dict_ema"], int(ckpt.get("ema_updates", 0)))
        else:
            logger.info("=> %s holds no weight average; --model-ema starts averaging from its weights", path)
            ema.load_state_dict(precision.model_state_dict(model), 0)
    per_rank = ckpt.get("rng_per_rank") or []
    if len(per_rank) == ctx.world_size:
        ckpt_io.restore_rng(per_rank[ctx.rank])
    else:
        # Another world size than the saved run's: rank 0's state, and distinct streams per rank.
        ckpt_io.restore_rng(ckpt.get("rng"))
        if ctx.rank:
            torch.manual_seed(torch.initial_seed() + ctx.rank)
    epoch, best, step = int(ckpt["epoch"]), float(ckpt.get("best_acc1", 0.0)), int(ckpt.get("step_in_epoch", 0))
    saved = ckpt.get("config") or {}
    for key in RESUME_OVERRIDES:
        if key in saved and saved[key] != getattr(cfg, key):
            logger.info("=> resume: --%s %s replaces the checkpoint's %s", key.replace("_", "-"), getattr(cfg, key),
                        saved[key])
    saved_batch, saved_accum = saved.get("batch_size", cfg.batch_size), saved.get("accum_steps", 1)
    if step and (saved_batch, saved_accum) != (cfg.batch_size, cfg.accum_steps):
        logger.warning("=> %s stopped mid-epoch at batch size %s with %s accumulation step(s); with -b %d and "
                       "--accum-steps %d the epoch restarts from its beginning", path, saved_batch, saved_accum,
                       cfg.batch_size, cfg.accum_steps)
        step = 0
    logger.info("=> resumed %s: continuing at epoch %d%s (best Acc@1 so far %.3f)", path, epoch,
                f", step {step}" if step else "", best)
    # metric sums of the part of the epoch done before (older checkpoints: none, the epoch's
    # metrics then cover the steps after the resume only)
    partial = ckpt.get("train_partial") if step else None
    return epoch, best, step, partial


def _train(cfg, ctx, data, model, precision, optimizer, scheduler, criterion, train_loader, val_loader, opts,
           start_epoch: int, best_acc1: float, start_step: int, ema, mixer, start_sums) -> dict:
    board = TensorBoardLog(cfg.output_dir) if cfg.tensorboard and ctx.is_main else None
    try:
        with StopRequest(ctx) as stop:
            return _epochs(cfg, ctx, data, model, precision, optimizer, scheduler, criterion, train_loader,
                           val_loader, opts, start_epoch, best_acc1, start_step, stop, ema, mixer, board,
                           start_sums)
    finally:
        if board is not None:
            board.close()


def _epochs(cfg, ctx, data, model, precision, optimizer, scheduler, criterion, train_loader, val_loader, opts,
            start_epoch: int, best_acc1: float, start_step: int, stop: StopRequest, ema, mixer, board,
            start_sums) -> dict:
    per_process = micro_batch_size(cfg, ctx)  # images per loader batch in this process
    train_criterion = nn.CrossEntropyLoss().to(ctx.device) if mixer is not None else criterion

    def save(epoch: int, step: int, is_best: bool = False, partial: Optional[list] = None) -> None:
        # Every rank takes part (RNG gather); rank 0 writes. step > 0: in the middle of `epoch`,
        # whose metric sums so far (all ranks) are `partial`.
        rng = distributed.gather_objects(ckpt_io.capture_rng(), ctx)
        if ctx.is_main:
            state = _checkpoint_state(cfg, epoch, step, best_acc1, model, optimizer, scheduler, precision, data,
                                      rng, ema)
            if partial is not None:
                state["train_partial"] = partial
            ckpt_io.save_checkpoint(state, cfg.output_dir, is_best)

    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if ctx.is_main:
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as fh:  # the resolved recipe
            # reusable as --config: every key but the config file itself
            yaml.safe_dump({k: v for k, v in cfg.to_dict().items() if k != "config"}, fh, sort_keys=False)
    run_start = time.perf_counter()
    last: dict = {}
    steady, epochs_run = Steady(), 0
    for epoch in range(start_epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        epoch_lr = optimizer.param_groups[0]["lr"]
        train_loader.sampler.set_epoch(epoch)
        train_loader.sampler.set_start(start_step * per_process)
        size = image_size_at(epoch, cfg)
        if cfg.progressive_resize:
            train_loader.sampler.set_image_size(size)
            if ctx.is_main and (epoch == start_epoch or size != image_size_at(epoch - 1, cfg)):
                logger.info("=> epoch %d: training crops of %d px (--progressive-resize %d -> %d)", epoch, size,
                            cfg.progressive_resize, cfg.image_size)
        every = cfg.save_every_steps
        on_step = ((lambda done, sums, e=epoch: save(e, done, partial=sums())
                    if (done // cfg.accum_steps) % every == 0 else None) if every else None)
        train = train_one_epoch(model, train_loader, train_criterion, optimizer, scheduler, precision, ctx, epoch,
                                opts, start_step=start_step, stop=stop.should_stop, on_step=on_step, ema=ema,
                                mixer=mixer, start_sums=start_sums)
        start_step, start_sums = 0, None
        if not train["completed"]:
            save(epoch, train["steps_done"], partial=train["partial_sums"])
            where = os.path.join(cfg.output_dir, ckpt_io.CHECKPOINT)
            raise Preempted(stop.signum, f"stopped by {stop.name} in epoch {epoch} after step {train['steps_done']}; "
                            f"checkpoint written to {where}: run the same command with --resume auto to continue")
        val = validate(model, val_loader, criterion, precision, ctx, opts)
        decoded = _decode_counts(cfg, ctx, train_loader, val_loader)  # before the weight average's pass
        averaged = {}
        if ema is not None:  # the average is an fp32 model: evaluate it in fp32
            val_ema = validate(ema.model, val_loader, criterion, Precision(), ctx, opts, name="weight average")
            val_loader.decode_counts()  # the same images again: counted once, above
            val["skipped_paths"] += val_ema["skipped_paths"]
            averaged = {f"{k}_ema": val_ema[k] for k in ("val_loss", "val_acc1", "val_acc5")}
        skipped = _report_skipped(cfg, ctx, train["skipped_paths"] + val["skipped_paths"], epoch,
                                  len(data.train) + len(data.val))
        best_path = os.path.join(cfg.output_dir, ckpt_io.BEST)
        is_best = val["val_acc1"] > best_acc1 or (ctx.is_main and not os.path.exists(best_path))
        best_acc1 = max(best_acc1, val["val_acc1"])
        record = EpochRecord(
            epoch=epoch, lr=epoch_lr, lr_end=optimizer.param_groups[0]["lr"],
            **{k: train[k] for k in ("train_loss", "train_acc1", "train_acc5", "train_samples", "steps",
                                     "skipped_steps", "img_per_s", "data_wait_frac", "train_seconds")},
            **{k: val[k] for k in ("val_loss", "val_acc1", "val_acc5", "val_samples")},
            epoch_seconds=time.perf_counter() - epoch_start, skipped_images=skipped,
            loss_scale=precision.loss_scale, skipped_steps_total=precision.skipped_steps, best_acc1=best_acc1,
            precision=precision.name, mode=ctx.mode, image_size=size, world_size=ctx.world_size,
            **averaged, **decoded).to_dict()
        steady = steady.plus(train["steady"])
        epochs_run += 1
        # Checkpoint first: a metrics line never describes an epoch the checkpoint lacks.
        save(epoch + 1, 0, is_best)
        if ctx.is_main:
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if board is not None:
                board.write_epoch(record)
            if train["skipped_steps"]:
                logger.info("=> epoch %d: %d of %d steps skipped for gradient overflow (loss scale now %g)",
                            epoch, train["skipped_steps"], train["steps"], precision.loss_scale)
            if train["data_wait_frac"] > INPUT_BOUND:
                logger.warning("=> epoch %d was input-bound: the training loop waited for data %.0f%% of the time "
                               "(%.0f img/s); %s", epoch, 100 * train["data_wait_frac"], train["img_per_s"],
                               _input_hint(cfg, ctx))
        last = record
        if cfg.prof > 0:
            break
    total = time.perf_counter() - run_start
    world = ctx.world_size if ctx.distributed else 1
    summary = {"best_acc1": best_acc1, "last_acc1": last.get("val_acc1"), "epochs_run": epochs_run,
               "seconds": total, "img_per_s": steady.img_per_s * world, "data_wait_frac": steady.data_wait_frac,
               "last": last}
    if ctx.is_main and last:
        logger.info("=> done: best Acc@1 %.3f, last Acc@1 %.3f, %.1f s; training %.0f img/s steady, %.0f%% of it "
                    "waiting for input; outputs in %s", best_acc1, last["val_acc1"], total, summary["img_per_s"],
                    100 * summary["data_wait_frac"], os.path.abspath(cfg.output_dir))
    return summary


INPUT_BOUND = 0.1  # share of the steady training time spent waiting for input that an epoch line reports


def _input_hint(cfg: Config, ctx) -> str:
    """What to try when the loop waits for input."""
    cpus = os.cpu_count() or 1
    tips = [f"more data workers (-j, now {cfg.workers}; {cpus} CPUs here)"] if cfg.workers < cpus - 1 else []
    if ctx.device.type == "cuda" and not cfg.dummy and cfg.decode == "cpu" and cfg.data_pipeline == "fast" \
            and cfg.auto_augment == "none" and cfg.random_erase == 0:
        tips.append("--decode gpu (JPEG decoding on the GPU)")
    if cfg.data_pipeline == "classic":
        tips.append("--data-pipeline fast")
    if cfg.no_jpeg_draft:
        tips.append("dropping --no-jpeg-draft")
    if not tips:
        return f"the {cfg.workers} data workers already have every CPU here: this machine's input rate is the limit"
    return "try " + ", ".join(tips)


def _decode_counts(cfg, ctx, train_loader, val_loader) -> dict:
    """--decode gpu: this epoch's images decoded on the GPUs / on CPUs instead, train and val, all
    ranks (every rank calls this)."""
    if cfg.decode != "gpu":
        return {}
    counts = [loader.decode_counts() for loader in (train_loader, val_loader)]
    both = torch.tensor([float(sum(c["gpu"] for c in counts)), float(sum(c["cpu"] for c in counts))],
                        device=ctx.device)
    gpu, cpu = distributed.all_reduce_sum(both, ctx).tolist()
    return {"decoded_on_gpu": int(gpu), "decode_fallbacks": int(cpu)}


def _report_skipped(cfg, ctx, paths: list, epoch: int, total_images: int) -> int:
    count = torch.tensor([float(len(paths))], device=ctx.device)
    count = int(distributed.all_reduce_sum(count, ctx).item())
    if count and ctx.is_main:
        with open(os.path.join(cfg.output_dir, "skipped_images.txt"), "a") as fh:
            fh.writelines(f"epoch {epoch}\t{p}\n" for p in paths)
        logger.warning("=> epoch %d: skipped %d unreadable image(s), e.g. %s (list: %s)", epoch, count,
                       ", ".join(paths[:3]) or "on other ranks", os.path.join(cfg.output_dir, "skipped_images.txt"))
    if total_images and count / total_images > cfg.max_bad_fraction:
        raise UserError(f"{count} of {total_images} images could not be read in epoch {epoch}, more than "
                        f"--max-bad-fraction {cfg.max_bad_fraction}; check the dataset (see skipped_images.txt)")
    return count


def _checkpoint_state(cfg, epoch: int, step: int, best_acc1: float, model, optimizer, scheduler, precision,
                      data: DataBundle, rng: list, ema) -> dict:
    extra = {"state_dict_ema": ema.state_dict(), "ema_updates": ema.updates} if ema is not None else {}
    return {
        **extra,
        "format_version": ckpt_io.FORMAT_VERSION,
        "epoch": epoch,  # the epoch to run next (or to finish), as the reference script stores it
        "step_in_epoch": step,  # batches of that epoch already trained (mid-epoch checkpoints)
        "arch": cfg.arch,
        "num_classes": len(data.classes),
        "classes": list(data.classes),
        "state_dict": precision.model_state_dict(model),
        "best_acc1": best_acc1,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "rng": rng[0],
        "rng_per_rank": rng,
        "config": cfg.to_dict(),
    }


def spawn_per_gpu(cfg: Config, nprocs: Optional[int] = None) -> int:
    """``--multiprocessing-distributed``: one process per visible GPU (or ``nprocs``), started
    from here; returns the exit status, as every other launch mode does (2 for a user error,
    128 + the signal number after a preemption)."""
    n = nprocs
    if n is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise UserError("--multiprocessing-distributed starts one process per GPU and none is visible; "
                        "for CPU processes use python -m multiproc --nproc-per-node N main.py ... "
                        "--dist-backend gloo")
    nodes = max(cfg.world_size, 1)
    node = max(cfg.rank, 0)
    if node >= nodes:
        raise UserError(f"--rank {cfg.rank} (the node rank with --multiprocessing-distributed) must be "
                        f"below --world-size {cfg.world_size} (the number of nodes)")
    if cfg.dist_url.startswith("env://"):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if nodes > 1:
                raise UserError("several nodes need a shared rendezvous: set MASTER_ADDR/MASTER_PORT "
                                "or pass --dist-url tcp://HOST:PORT")
            os.environ["MASTER_PORT"] = str(distributed.free_port())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.multiprocessing as mp
    context = mp.start_processes(_spawned_worker, args=(cfg, n, node, nodes), nprocs=n, join=False,
                                 start_method="spawn")
    # The workers leave the terminal's process group (see _spawned_worker): a Ctrl-C reaches this
    # process alone and is passed on once, so it is not a second, immediate stop for them.
    forwarded = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: _signal_workers(context, signum))
                for sig in forwarded}
    try:
        while not context.join(timeout=1):
            pass
    except mp.ProcessExitedException as e:
        # A preempted or failed rank; torch has stopped the others (SIGTERM: they checkpoint).
        code = e.exit_code or 1
        return code if code > 0 else 128 - code  # a death by signal, as a shell reports it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _signal_workers(context, signum: int) -> None:
    for process in context.processes:
        if process.is_alive():
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass


def _spawned_worker(local_rank: int, cfg: Config, n: int, node: int, nodes: int) -> None:
    os.setpgrp()  # out of the terminal's process group: the launching process forwards signals
    os.environ.update({"RANK": str(node * n + local_rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(nodes * n), "LOCAL_WORLD_SIZE": str(n)})
    child = dataclasses.replace(cfg, multiprocessing_distributed=False, world_size=-1, rank=-1, gpu=None)
    try:
        run(child)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except Preempted as e:  # every rank stops at the same step; one line says how to resume
        if node * n + local_rank == 0:
            print(f"=> {e}", flush=True)
        sys.exit(e.exit_code)
