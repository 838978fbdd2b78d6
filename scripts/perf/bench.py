#!/usr/bin/env python
"""Training-step throughput on synthetic on-device data, through the trainer's own pieces.

    python scripts/perf/bench.py train --arch resnet50 --precision amp --channels-last --batch-size 256
    python scripts/perf/bench.py train --matrix                     # every precision x layout, one table
    CUDA_VISIBLE_DEVICES=0,1 python scripts/perf/bench.py train ... # DataParallel (the trainer's choice)
    python -m multiproc scripts/perf/bench.py train ...             # DDP, one process per GPU
    python scripts/perf/bench.py data DIR --workers 2                # input pipeline: classic vs fast

Batch size is global (as in main.py). The data is generated once on the device, so the figure
is the model step alone: forward, loss, backward, (all-reduce,) optimizer step, through the
same precision object and parallel wrapper main.py uses. img/s is the median over timed
windows after warm-up, with the spread (min..max) of the windows; MFU is model FLOPs (counted
by torch's FlopCounterMode on one step) per second over a measured dense bf16 matmul ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from imagenet.base.config import ARCHS, BN_KERNELS, COMPILE_MODES, MAXPOOL_KERNELS, Config, validate  # noqa: E402
from imagenet.base.errors import UserError  # noqa: E402
from imagenet.models.registry import create_model  # noqa: E402
from imagenet.parallel import distributed  # noqa: E402
from imagenet.precision import MasterWeightPrecision, build_precision, configure_tf32  # noqa: E402
from imagenet.precision.optim import IMPLS  # noqa: E402
from imagenet.training.state import build_training, wrap_training  # noqa: E402

PRECISIONS = ("fp32", "tf32", "amp", "amp-bf16", "fp16", "fp16-loop")
LAYOUTS = {"contiguous": False, "channels_last": True}  # --layouts name: channels_last
# classic: the reference script's input exactly (torchvision's ImageFolder and transforms, a plain
# DataLoader, .to(device)); trainer-classic: main.py --data-pipeline classic; fast: main.py's
# default (on a GPU the workers crop and the GPU resizes); fast-worker-resize: the fast pipeline
# with the resize left in the workers, as main.py runs it without a GPU; gpu: --decode gpu
PIPELINES = ("classic", "trainer-classic", "fast", "fast-worker-resize", "gpu")


def precision_config(name: str, base: Config) -> Config:
    """The trainer's config for a bench precision name."""
    flags = {"fp32": dict(tf32=False), "tf32": dict(tf32=True), "amp": dict(amp=True),
             "amp-bf16": dict(amp=True, amp_dtype="bfloat16"), "fp16": dict(fp16=True),
             "fp16-loop": dict(fp16=True)}[name]
    cfg = dataclasses.replace(base, **flags)
    validate(cfg)
    return cfg


def matmul_ceiling(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """Measured dense bf16 matmul TFLOP/s on random data (the MFU denominator)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def train_flops_per_image(arch: str, image_size: int, num_classes: int) -> float:
    """Forward + backward FLOPs of one image, counted on the CPU with a batch of 2."""
    from torch.utils.flop_counter import FlopCounterMode
    model = create_model(arch, num_classes)
    x = torch.randn(2, 3, image_size, image_size)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2


def set_inductor_options(pairs: list) -> None:
    """``KEY=VALUE`` pairs into ``torch._inductor.config`` (dotted keys reach its sub-configs)."""
    import ast
    if not pairs:
        return
    import torch._inductor.config as inductor
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value  # a bare string, e.g. max_autotune_gemm_backends=ATEN
        *owners, name = key.split(".")
        target = inductor
        for part in owners:
            target = getattr(target, part, None)
        if target is None or not hasattr(target, name):
            raise ValueError(f"torch._inductor.config has no option {key!r}")
        setattr(target, name, parsed)


def build_step(args, name: str, channels_last: bool, ctx):
    """The trainer's model, precision and SGD for ``name``, built as main.py builds them
    (``state.build_training``); returns ``step(images, targets)`` (forward, loss, backward,
    optimizer step); the training state lives as long as it does."""
    base = Config(arch=args.arch, batch_size=args.batch_size, channels_last=channels_last, image_size=args.image_size,
                  lr=0.01, optimizer=args.optimizer, optimizer_impl=args.optimizer_impl, compile=args.compile,
                  tune_kernels=args.tune_kernels, maxpool_kernel=args.maxpool_kernel, bn_kernel=args.bn_kernel,
                  blurpool=args.blurpool)
    cfg = precision_config(name, base)
    if ctx.device.type == "cuda":
        configure_tf32(cfg.tf32)
        torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    torch.manual_seed(0)
    variant = None
    if name == "fp16-loop":  # the master copies one tensor at a time (what the multi-tensor copies gain)
        variant = MasterWeightPrecision(build_precision(cfg, ctx.device).scaler, foreach=False)
    state = build_training(cfg, ctx, args.num_classes, iters_per_epoch=1, precision=variant)
    ddp = {"bucket_cap_mb": args.ddp_bucket_mb} if args.ddp_bucket_mb else {}
    if args.ddp_bucket_view:
        ddp["gradient_as_bucket_view"] = True
    if ctx.mode == "dp" and args.dp_impl == "torch":  # torch's own, new threads every forward
        if args.compile != "off":
            raise UserError("--compile does not work with DataParallel (--dp-impl torch); drop one of them")
        state.model = nn.DataParallel(state.model, device_ids=ctx.device_ids)
    else:
        wrap_training(state, cfg, ctx, **ddp)
    model, precision, optimizer, criterion = state.model, state.precision, state.optimizer, state.train_criterion
    model.train()

    def step(images, targets):
        loss = criterion(precision.forward(model, images), targets)
        precision.backward(loss)
        precision.step(optimizer)

    return step


def bench_one(args, name: str, channels_last: bool, ctx) -> dict:
    train_step = build_step(args, name, channels_last, ctx)
    per_proc = args.batch_size // ctx.world_size if ctx.distributed else args.batch_size
    images = torch.randn(per_proc, 3, args.image_size, args.image_size, device=ctx.device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, args.num_classes, (per_proc,), device=ctx.device)
    step = functools.partial(train_step, images, targets)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for _ in range(args.warmup):
        step()
    sync()
    rates = []
    for _ in range(args.windows):
        distributed.barrier(ctx)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        rates.append(args.batch_size * args.steps / (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30 if ctx.device.type == "cuda" else 0.0
    if args.profile:
        # Where a step's time goes (host ops, kernels, copies). Under DDP every rank runs the
        # steps (each all-reduce needs all ranks); rank 0 profiles and prints.
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        with profile(activities=acts) if ctx.is_main else contextlib.nullcontext() as prof:
            for _ in range(args.profile):
                step()
            sync()
    if args.profile and ctx.is_main:
        key = "self_cuda_time_total" if ctx.device.type == "cuda" else "self_cpu_time_total"
        print(f"profile of {args.profile} steps ({name}, {ctx.mode}), by {key}:")
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))
        if args.profile_json:  # every op, to compare two modes op by op offline
            ops = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                    "self_device_us": getattr(e, "self_device_time_total", None) or
                    getattr(e, "self_cuda_time_total", 0),
                    "kernel": "CPU" not in str(getattr(e, "device_type", "CPU"))} for e in prof.key_averages()]
            with open(args.profile_json, "w") as fh:
                json.dump({"precision": name, "steps": args.profile, "ops": ops}, fh)
    del train_step, step  # frees the model and optimizer before the next row
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"precision": name, "channels_last": channels_last, "img_per_s": statistics.median(rates),
            "min": min(rates), "max": max(rates), "peak_gib": peak, "mode": ctx.mode,
            "devices": ctx.n_devices, "batch": args.batch_size, "compile": args.compile,
            "tune_kernels": args.tune_kernels, "maxpool_kernel": args.maxpool_kernel, "bn_kernel": args.bn_kernel,
            "optimizer": args.optimizer_impl, "lars": args.optimizer == "lars", "blurpool": args.blurpool,
            "image_size": args.image_size}


PREFETCH = 4  # batches each data worker keeps ready


class RepeatedShuffle(torch.utils.data.Sampler):
    """``total`` indices from successive seeded permutations of ``range(n)``: epochs back to back."""

    def __init__(self, n: int, total: int, seed: int = 0):
        self.n, self.total, self.seed = n, total, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        left = self.total
        while left > 0:
            chunk = torch.randperm(self.n, generator=g)[:left].tolist()
            left -= len(chunk)
            yield from chunk

    def __len__(self) -> int:
        return self.total


def profile_batches(it, train_step, n: int, device: torch.device, pipeline: str) -> None:
    """``n`` more batches (and steps) under the profiler: the ops of every thread, the background
    batch thread's included, by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            images, targets, _ = next(it)
            if train_step is not None:
                train_step(images, targets)
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(f"profile of {n} batches ({pipeline}):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50))


def plain_torchvision_loader(args, device: torch.device, batches: int):
    """The reference script's input, nothing of ours in it: ImageFolder, torchvision's transforms,
    a DataLoader over torch's RandomSampler (``batches`` batches, epochs back to back), and each
    batch ``.to(device, non_blocking=True)`` as the loop does."""
    from torch.utils.data import DataLoader, RandomSampler
    from torchvision import datasets, transforms

    from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    train = datasets.ImageFolder(os.path.join(args.dir, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    loader = DataLoader(train, batch_size=args.batch_size,
                        sampler=RandomSampler(train, num_samples=batches * args.batch_size),
                        num_workers=args.workers, pin_memory=device.type == "cuda", drop_last=True,
                        prefetch_factor=PREFETCH if args.workers else None)
    return ((images.to(device, non_blocking=True), targets.to(device, non_blocking=True), [])
            for images, targets in loader)


def trainer_loader(args, device: torch.device, batches: int, pipeline: str):
    """The trainer's own loader for ``pipeline`` (as main.py builds it), over ``batches`` batches."""
    from torch.utils.data import DataLoader

    from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from imagenet.data.loaders import build_datasets, collate_for
    from imagenet.data.prefetch import DeviceLoader
    cfg = Config(data=args.dir, data_pipeline="classic" if pipeline == "trainer-classic" else "fast",
                 decode="gpu" if pipeline == "gpu" else "cpu", image_size=args.image_size,
                 workers=args.workers, batch_size=args.batch_size)
    validate(cfg)
    data = build_datasets(cfg, args.dir, device=None if pipeline == "fast-worker-resize" else device)
    return iter(DeviceLoader(DataLoader(data.train, batch_size=args.batch_size,
                                        sampler=RepeatedShuffle(len(data.train), batches * args.batch_size),
                                        num_workers=args.workers, collate_fn=collate_for(device), drop_last=True,
                                        pin_memory=device.type == "cuda", persistent_workers=False,
                                        prefetch_factor=PREFETCH if args.workers else None),
                             device, True, IMAGENET_MEAN, IMAGENET_STD, background=pipeline == "gpu",
                             share=data.decode_share))


def bench_data(args, train_defaults: argparse.Namespace) -> int:
    """Iterate the training loader of DIR with each pipeline; img/s side by side. With --train,
    ``train_defaults`` (the ``train`` command's options) set up the model step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "gpu" in args.pipelines.split(",") and device.type != "cuda":
        print("error: the gpu pipeline (--decode gpu) needs a CUDA GPU; drop it from --pipelines", file=sys.stderr)
        return 2
    train_step = None
    if args.train:  # every batch also trains the model: the loader measured under a busy GPU
        step_args = argparse.Namespace(**{**vars(train_defaults), "arch": args.train_arch,
                                          "batch_size": args.batch_size, "image_size": args.image_size,
                                          "compile": args.train_compile})
        try:
            train_step = build_step(step_args, args.train, True, distributed.setup(Config(batch_size=args.batch_size)))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from imagenet.data.images.folder import check_layout
    try:  # one clear line for a wrong folder, whichever pipeline reads it first
        check_layout(args.dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for pipeline in args.pipelines.split(","):
        # Every worker holds up to PREFETCH batches, so the first workers x PREFETCH batches after
        # start-up come out of a full queue: the warm-up drains it twice over and each window is at
        # least that long, or a window times the queue, not the decoding (16-core machine: windows
        # of 4 batches read 675..80,591 img/s). One long shuffled stream, so no window holds an
        # epoch restart either.
        queued = args.workers * PREFETCH
        warmup, per_window = max(args.warmup, 2 * queued), max(args.batches, queued)
        need = warmup + args.windows * per_window + args.profile
        try:
            loader = (plain_torchvision_loader(args, device, need) if pipeline == "classic" else
                      trainer_loader(args, device, need, pipeline))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rates, seen, t0, count = [], 0, None, 0
        it = loader
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        while len(rates) < args.windows:
            images, targets, _ = next(it)
            if train_step is not None:
                train_step(images, targets)  # runs ahead of the GPU as in main.py: synced per window
            else:
                sync()  # the loader alone: each batch finished before the next, so the rate is the loader's
            seen += 1
            if seen == warmup:
                sync()
                t0, count = time.perf_counter(), 0
            elif seen > warmup:
                count += targets.numel()
                if (seen - warmup) % per_window == 0:
                    sync()
                    now = time.perf_counter()
                    rates.append(count / (now - t0))
                    t0, count = now, 0
        if args.profile:
            profile_batches(it, train_step, args.profile, device, pipeline)
        del it
        results[pipeline] = rates
        what = f", each batch trains {args.train_arch} {args.train}" if train_step is not None else ""
        print(f"bench data: {pipeline:8s} median {statistics.median(rates):8.0f} img/s "
              f"(windows {min(rates):.0f}..{max(rates):.0f}; {args.workers} workers, {warmup} warm-up + "
              f"{args.windows} x {per_window} batches of {args.batch_size}{what})", flush=True)
    if len(results) > 1 and "classic" in results:
        base = statistics.median(results["classic"])
        for name, rates in results.items():
            print(f"  {name}: {statistics.median(rates) / base:.2f}x classic (plain torchvision)")
    last = list(results)[-1]
    print(f"{last} pipeline, {args.workers} workers: {statistics.median(results[last]):.0f} img/s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="model-step throughput on synthetic on-device data")
    t.add_argument("--arch", choices=ARCHS, default="resnet50")
    t.add_argument("--precision", choices=PRECISIONS, default="amp")
    t.add_argument("--channels-last", action="store_true")
    t.add_argument("--compile", choices=COMPILE_MODES, default="off",
                   help="torch.compile the model as main.py's --compile does (compiles during warm-up)")
    t.add_argument("--tune-kernels", action="store_true", help="as main.py's: Inductor tunes its kernels (--compile)")
    t.add_argument("--maxpool-kernel", choices=MAXPOOL_KERNELS, default="auto",
                   help="as main.py's: the stem max-pool's kernels (auto: Triton on a GPU with channels_last)")
    t.add_argument("--bn-kernel", choices=BN_KERNELS, default="torch",
                   help="as main.py's: BatchNorm + add + ReLU fused in Triton (channels_last)")
    t.add_argument("--matrix", action="store_true", help="every precision, with and without channels_last")
    t.add_argument("--precisions", default=",".join(PRECISIONS), help="with --matrix: which precisions")
    t.add_argument("--layouts", default="contiguous,channels_last", help="with --matrix: which memory layouts")
    t.add_argument("--dp-impl", choices=("persistent", "torch"), default="persistent",
                   help="DataParallel: the trainer's (replica threads kept) or torch's own")
    t.add_argument("--no-cudnn-benchmark", action="store_true", help="cuDNN heuristics instead of timing algorithms")
    t.add_argument("--ddp-bucket-mb", type=float, default=0, help="DDP gradient bucket size (0: torch's 25 MB)")
    t.add_argument("--ddp-bucket-view", action="store_true",
                   help="DDP gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy)")
    t.add_argument("--blurpool", action="store_true", help="as main.py's: a blur before each strided convolution")
    t.add_argument("--batch-size", type=int, default=256, help="global batch")
    t.add_argument("--optimizer", choices=("sgd", "lars"), default="sgd", help="as main.py's --optimizer")
    t.add_argument("--optimizer-impl", choices=IMPLS, default="auto",
                   help="SGD kernel, as main.py's flag: auto = fused on CUDA (skip decided on the device)")
    t.add_argument("--image-size", type=int, default=224)
    t.add_argument("--num-classes", type=int, default=1000)
    t.add_argument("--warmup", type=int, default=15, help="untimed steps first (cudnn autotuning)")
    t.add_argument("--steps", type=int, default=20, help="steps per timed window")
    t.add_argument("--windows", type=int, default=5, help="timed windows; the median is reported")
    t.add_argument("--json", help="also write the rows to this file")
    t.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps, print top ops")
    t.add_argument("--profile-json", help="with --profile: write every op's times to this file")
    t.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="set torch._inductor.config.KEY (a Python literal) before compiling; repeatable "
                        "(exploring Inductor's options with --compile)")
    d = sub.add_parser("data", help="input-pipeline throughput (decode, crop, collate, to device)")
    d.add_argument("dir", help="an ImageFolder root with train/ (scripts/perf/make_benchmark_imagefolder.py)")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--pipelines", default="classic,fast",
                   help="comma list of classic (the reference script's: plain torchvision), trainer-classic "
                        "(--data-pipeline classic), fast (the default), fast-worker-resize (fast with the resize in "
                        "the workers, as without a GPU), gpu (--decode gpu; needs CUDA)")
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--image-size", type=int, default=224)
    d.add_argument("--warmup", type=int, default=4,
                   help="untimed batches (worker start-up); at least twice what the workers hold queued")
    d.add_argument("--batches", type=int, default=8,
                   help="batches per timed window; at least what the workers hold queued")
    d.add_argument("--windows", type=int, default=5)
    d.add_argument("--train", choices=PRECISIONS,
                   help="also train --train-arch on every batch in this precision (channels_last): "
                        "end to end, the loader measured while the model keeps the device busy")
    d.add_argument("--train-arch", choices=ARCHS, default="resnet50")
    d.add_argument("--train-compile", choices=COMPILE_MODES, default="off")
    d.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more batches of each pipeline (every thread's ops), print top ops")
    args = p.parse_args(argv)
    lists = ([("--precisions", args.precisions, PRECISIONS), ("--layouts", args.layouts, tuple(LAYOUTS))]
             if args.what == "train" else [("--pipelines", args.pipelines, PIPELINES)])
    for option, names, known in lists:
        unknown = sorted(set(names.split(",")) - set(known))
        if unknown:
            p.error(f"{option}: unknown {', '.join(unknown)}; choose from {','.join(known)}")
    if args.what == "data":
        return bench_data(args, t.parse_args([]))
    try:
        set_inductor_options(args.inductor)
    except ValueError as e:
        p.error(f"--inductor: {e}")
    try:
        ctx = distributed.setup(Config(batch_size=args.batch_size))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ctx.distributed and args.batch_size % ctx.world_size:
        print(f"error: --batch-size {args.batch_size} does not divide over {ctx.world_size} processes",
              file=sys.stderr)
        return 2
    layouts = [LAYOUTS[x] for x in args.layouts.split(",")]
    combos = ([(n, cl) for n in args.precisions.split(",") for cl in layouts] if args.matrix
              else [(args.precision, args.channels_last)])
    flops = train_flops_per_image(args.arch, args.image_size, args.num_classes)
    ceiling = matmul_ceiling(ctx.device)
    rows = []
    for name, cl in combos:
        try:
            row = bench_one(args, name, cl, ctx)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        row["mfu"] = row["img_per_s"] * flops / 1e12 / (ceiling * row["devices"]) if ceiling == ceiling else None
        rows.append(row)
        if ctx.is_main:
            print(f"bench: {name:9s} {'channels_last' if cl else 'contiguous':13s} compile={args.compile} "
                  f"{row['img_per_s']:9.0f} img/s", flush=True)
    if ctx.is_main:
        print(f"\n{args.arch}, global batch {args.batch_size}, {ctx.describe()}; "
              f"{flops / 1e9:.1f} GFLOP/img (fwd+bwd); bf16 matmul ceiling {ceiling:.0f} TFLOP/s per GPU; "
              f"compile {args.compile}, optimizer {args.optimizer} ({args.optimizer_impl})")
        print("| precision | layout | img/s (median) | spread (min..max) | peak GiB | MFU |")
        print("| --- | --- | ---: | --- | ---: | ---: |")
        for r in rows:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            print(f"| {r['precision']} | {'channels_last' if r['channels_last'] else 'contiguous'} | "
                  f"{r['img_per_s']:.0f} | {r['min']:.0f}..{r['max']:.0f} | {r['peak_gib']:.1f} | {mfu} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    distributed.cleanup(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
