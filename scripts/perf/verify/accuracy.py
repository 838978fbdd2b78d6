"""Accuracy parity on Fashion-MNIST: each precision on one GPU against fp32 (precision), the
DataParallel and DDP commands on two GPUs (multigpu), the fp16 recipe with a weight average,
label smoothing or other kernels over seeds (recipe), images stored larger than they train
through each input pipeline, with the pixels each pipeline makes (shrink), and the recipe at 16x
its batch with SGD and with LARS (largebatch)."""

from __future__ import annotations

import math
import os
import re
import sys

from .common import (G0, G1, PY, REPO, TWO, fail, last_metrics, recipe_cmd, run_group, run_rows, seed_accs, sh,
                     table, tail, visible_gpus)
from .data import ensure_fashion, ensure_fashion_jpeg

# (group, name, command, environment): a group's rows at once, one a GPU; {base}: the recipe in fp32
PRECISION_ROWS = (
    (1, "1-fp32", "{base}", G0),
    (1, "2-fp16-static256", "{base} --fp16 --loss-scale=256", G1),
    (2, "fp16-dynamic", "{base} --fp16", G0),
    (2, "amp-fp16", "{base} --amp", G1),
    (3, "amp-bf16", "{base} --amp --amp-dtype bfloat16", G0),
)
# (name, command) on GPUs 0 and 1; --only picks rows by the number before the first hyphen
MULTIGPU_ROWS = (
    ("3-dp-fp32", "{py} {recipe}"),
    ("4-dp-fp16-static256", "{py} {recipe} --fp16 --loss-scale=256"),
    ("5-ddp-fp16-static256", "{py} -m multiproc --log-dir OUT {recipe} --fp16 --loss-scale=256 --dist-backend nccl"),
    ("6a-ddp-fp16-dynamic", "{py} -m multiproc --log-dir OUT {recipe} --fp16 --dist-backend nccl"),
    ("6b-ddp-amp", "{py} -m multiproc --log-dir OUT {recipe} --amp --dist-backend nccl"),
)
EAGER = " --compile off --bn-kernel torch"  # eager, torch's BatchNorm: the step before the speed defaults
RAMP = " --progressive-resize 32 --progressive-step 8 --progressive-ramp 1:6"
RECIPE_VARIANTS = {"plain": "", "ema-ls": " --model-ema 0.999 --label-smoothing 0.1",
                   "ema": " --model-ema 0.999", "ls": " --label-smoothing 0.1",
                   # with configs/fashion-mnist-stem.yaml (a stem with a max-pool, channels_last):
                   "maxpool-torch": EAGER + " --maxpool-kernel torch",
                   "maxpool-triton": EAGER + " --maxpool-kernel triton",
                   # the same eager step with torch's fused SGD, against maxpool-torch's Triton step
                   "maxpool-torch-fused-sgd": EAGER + " --maxpool-kernel torch --optimizer-impl fused",
                   # both Triton kernels under CUDA graphs, the fastest mode, against maxpool-torch
                   "kernels-ro": " --maxpool-kernel triton --bn-kernel triton --compile reduce-overhead",
                   # the same with the BatchNorm statistics from cuDNN's fused convolutions
                   "cudnn-ro": " --maxpool-kernel triton --bn-kernel cudnn --compile reduce-overhead",
                   "kernels": " --compile off --maxpool-kernel triton --bn-kernel triton",
                   # the command as typed (the speed defaults) against maxpool-torch
                   "default": "",
                   # with configs/fashion-mnist-stem.yaml (56 px): progressive resizing from 32 px (sizes 32, 40,
                   # 48, 56 over 8 or 12 epochs), compiled with CUDA graphs (a graph a size) against eager, and
                   # FFCV's triangular schedule against the config's cosine
                   "ramp": RAMP, "ramp-eager": RAMP + " --compile off",
                   # the ramp rounded to 28 px: two sizes, 32 for four epochs then 56 (FFCV's ramps at their step
                   # of 32 px are two sizes), against ramp's four (32, 40, 48, 56): what --progressive-step costs
                   "ramp-step28": RAMP.replace("--progressive-step 8", "--progressive-step 28"),
                   "ramp-triangular": RAMP + " --lr-schedule triangular --warmup-epochs 2",
                   # the same schedule comparison on the eager step (against ramp-eager): no compilation to wait for
                   "ramp-eager-triangular": RAMP + " --compile off --lr-schedule triangular --warmup-epochs 2"}
SHRINK_PIPELINES = {"classic": "--data-pipeline classic", "cpu": "--decode cpu", "gpu": "--decode gpu"}


def phase_precision(args) -> None:
    """The recipe in fp32, fp16 with a static and a dynamic loss scale, amp fp16 and amp bf16, on one GPU each."""
    data = ensure_fashion(args)
    table(run_rows(PRECISION_ROWS, {"base": f"{PY} {recipe_cmd(args, data)}"}, args), "1-fp32")


def phase_multigpu(args) -> None:
    """The recipe under DataParallel and DDP on two GPUs, each against the precision phase's fp32
    run (--ref-acc); one run at a time, or all at once with --concurrent (accuracy only)."""
    data = ensure_fashion(args)
    fill = {"py": PY, "recipe": recipe_cmd(args, data)}
    runs = [(name, cmd.format(**fill)) for name, cmd in MULTIGPU_ROWS]
    if args.only:
        runs = [r for r in runs if r[0].split("-")[0] in args.only.split(",")]
    results = []
    if args.concurrent:  # accuracy only: runs share the GPUs, so their img/s figures mean little
        results = run_group([{"name": name, "cmd": cmd, "env": TWO} for name, cmd in runs], args)
    for name, cmd in ([] if args.concurrent else runs):
        results += run_group([{"name": name, "cmd": cmd, "env": TWO}], args)
    ref = args.ref_acc
    if ref is not None:
        results.insert(0, {"name": "1-fp32", "acc1": ref, "best": ref, "val_samples": 10000, "img_per_s": 0,
                           "skipped_steps": 0, "loss_scale": None, "seconds": 0, "rc": 0, "cmd": "(precision phase)",
                           "env": {}})
    table(results, "1-fp32")


def phase_recipe(args) -> None:
    """The plain fp16 recipe vs the same with a weight average and/or label smoothing
    (--variants), for each of --seeds (runs alternate between the GPUs, all at once: accuracy
    only), then the mean of each."""
    names = args.variants.split(",")
    unknown = set(names) - set(RECIPE_VARIANTS)
    if unknown:
        fail(f"unknown recipe variant(s) {sorted(unknown)}; choose from {','.join(RECIPE_VARIANTS)}")
    data = ensure_fashion(args)
    base = f"{PY} {recipe_cmd(args, data)} --fp16"
    variants = [(v, RECIPE_VARIANTS[v]) for v in names]
    seeds = [int(x) for x in args.seeds.split(",")]
    gpus = max(visible_gpus(), 1)
    runs = [{"name": f"r-fp16-{v}-s{seed}", "cmd": f"{base}{extra} --seed {seed}",
             "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}}
            for k, (seed, (v, extra)) in enumerate((s_, v_) for s_ in seeds for v_ in variants)]
    results = run_group(runs, args)
    for r in results:
        rows = last_metrics(os.path.join(args.out, r["name"]))
        if rows and "val_acc1_ema" in rows[-1]:
            print(f"{r['name']}: weight average final Acc@1 {rows[-1]['val_acc1_ema']:.2f}, "
                  f"best {max(x['val_acc1_ema'] for x in rows):.2f}")
    for r in results:  # compiled progressive runs: the graphs each epoch compiled (0 once a size is compiled)
        rows = last_metrics(os.path.join(args.out, r["name"]))
        if rows and rows[0].get("compiles") is not None and rows[0]["image_size"] != rows[-1]["image_size"]:
            print(f"{r['name']}: sizes {[x['image_size'] for x in rows]}, graphs compiled {[x['compiles'] for x in rows]}")
    table(results, f"r-fp16-{names[0]}-s{seeds[0]}")
    for v, _ in variants:
        accs = seed_accs(results, f"r-fp16-{v}")
        if accs:
            print(f"{v}: final Acc@1 mean {sum(accs) / len(accs):.2f} over {len(accs)} seed(s), "
                  f"min {min(accs):.2f}, max {max(accs):.2f}")
    png = os.path.join(args.out, "recipe-fp16-ema-ls.png")
    dirs = " ".join(os.path.join(args.out, f"r-fp16-{v}-s{seeds[0]}") for v, _ in variants)
    sh(f"{PY} scripts/plot_metrics.py {dirs} --out {png} --title '{args.recipe_arch} fp16 on Fashion-MNIST, 1 GPU: "
       f"{' vs '.join(names)}'", os.path.join(args.out, "plot.log"))
    print(f"plot: {png}" if os.path.exists(png) else f"plot failed: {tail(os.path.join(args.out, 'plot.log'))}")


def pixel_comparison(root: str, size: int, min_scale: float, n: int = 1024) -> None:
    """The same seeded crops and flips of ``n`` training images through each pipeline, against
    torchvision's classic transforms (PIL decode, PIL resize): how far each departs, whether it
    is brighter or darker, and how sharp it is (mean absolute difference of neighbouring pixels,
    relative to classic's). The decoders alone too: nvJPEG's full image vs PIL's."""
    import numpy as np
    import torch
    from PIL import Image
    from torchvision import datasets, transforms

    sys.path.insert(0, REPO)
    from imagenet.data.images.cropbatch import CropBatch, TrainCropReader
    from imagenet.data.decode import TrainDecoder
    from imagenet.data.gpu.decode import JpegBatch, TrainJpegReader, decode_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU: TRITON_INTERPRET=1
    paths = [p for p, _ in datasets.ImageFolder(os.path.join(root, "train")).samples[::50][:n]]
    classic = transforms.Compose([transforms.RandomResizedCrop(size, scale=(min_scale, 1.0)),
                                  transforms.RandomHorizontalFlip(0.5)])
    make = lambda: TrainDecoder(size, min_scale, 0.5)  # noqa: E731

    def seeded(fn):
        out = []
        for k, path in enumerate(paths):
            torch.default_generator.manual_seed(1000 + k)
            out.append(fn(path))
        return out

    ref = torch.stack(seeded(lambda p: torch.from_numpy(np.asarray(classic(Image.open(p).convert("RGB"))).copy())))
    worker = torch.stack(seeded(make()))
    crops = CropBatch.collate(seeded(TrainCropReader(make()))).to_device(device).cpu()
    gpu_items = seeded(TrainJpegReader(make()))
    gpu = decode_batch(JpegBatch.collate(gpu_items), device)[0].cpu()
    full_pil = [torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()) for p in paths[:256]]
    from imagenet.data.gpu import jpeg as gpujpeg
    full_nv = [img.permute(1, 2, 0).cpu() for img in gpujpeg.require().decode(
        [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths[:256]], device)]

    def sharp(x):
        x = x.float()
        return float((x[:, 1:] - x[:, :-1]).abs().mean() + (x[:, :, 1:] - x[:, :, :-1]).abs().mean())

    print(f"\npixels: {len(paths)} training images of {root}, {size} px crops (scale {min_scale}..1), "
          "the same seeds in every pipeline, against torchvision's classic transforms")
    print("| pipeline | mean abs diff | mean diff (brightness) | pixels > 1 level off | sharpness vs classic |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = sharp(ref)
    for name, x in (("classic (PIL decode, PIL resize)", ref), ("fast, worker resize (CPU-only machines)", worker),
                    ("--decode cpu (PIL decode, GPU kernel resize)", crops), ("--decode gpu (nvJPEG, GPU kernel)", gpu)):
        d = x.int() - ref.int()
        print(f"| {name} | {d.abs().float().mean():.3f} | {d.float().mean():+.3f} | "
              f"{(d.abs() > 1).float().mean():.4f} | {sharp(x) / base:.4f} |")
    d = torch.cat([(a.int() - b.int()).reshape(-1) for a, b in zip(full_nv, full_pil)])
    print(f"| decoders alone, nvJPEG vs PIL, {len(full_pil)} whole images | {d.abs().float().mean():.3f} | "
          f"{d.float().mean():+.3f} | {(d.abs() > 1).float().mean():.4f} | |", flush=True)


def phase_shrink(args) -> None:
    """Accuracy when images are shrunk: Fashion-MNIST stored as --shrink-store px JPEGs, the
    Fashion recipe trained at --shrink-size px for --shrink-epochs, --fp16 --channels-last, each input pipeline x
    --seeds, --shrink-concurrent runs at once on the GPU (accuracy only); first, the pixels each
    pipeline makes from the same seeds."""
    names = args.shrink_pipelines.split(",")
    unknown = set(names) - set(SHRINK_PIPELINES)
    if unknown:  # before the export and the pixel comparison: a typo costs no device time
        fail(f"--shrink-pipelines: unknown {sorted(unknown)}; choose from {','.join(SHRINK_PIPELINES)}")
    root = ensure_fashion_jpeg(args)
    size = args.shrink_size
    pixel_comparison(root, size, 0.6)
    base = (f"{PY} main.py {root} --config configs/fashion-mnist.yaml --image-size {size} --val-resize {size} "
            f"--epochs {args.shrink_epochs} --fp16 --channels-last -j {args.workers} --output-dir OUT")
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = [{"name": f"shrink-{name}-s{seed}", "cmd": f"timeout {args.shrink_timeout} {base} "
             f"{SHRINK_PIPELINES[name]} --seed {seed}", "env": G0}
            for seed in seeds for name in names]
    results = []
    for i in range(0, len(runs), args.shrink_concurrent):
        results += run_group(runs[i:i + args.shrink_concurrent], args)
    table(results, runs[0]["name"])
    print("\n| pipeline | final Acc@1 per seed | mean | spread |\n| --- | --- | ---: | ---: |")
    for name in names:
        accs = seed_accs(results, f"shrink-{name}")
        if accs:
            print(f"| {name} | {' / '.join(f'{a:.2f}' for a in accs)} | {sum(accs) / len(accs):.2f} | "
                  f"{max(accs) - min(accs):.2f} |")


LARGE_BATCH_BASE = 128  # the recipe's batch (recipe_cmd's -b), which --lr is the rate of


def largebatch_flags(name: str, base_lr: float) -> str:
    """main.py flags of a large-batch variant ``OPTIMIZER-bBATCH[-RATE][-poly][-wdX][-wN]``: OPTIMIZER
    sgd or lars; RATE linear (--lr x batch / 128), sqrt (x its square root) or lr<X> (X itself;
    default: the recipe's rate); poly: MLPerf's decay (power 2 to 1e-4) instead of the recipe's
    cosine; wd<X>: weight decay X, a plain decimal (MLPerf's LARS: wd0.00005) instead of the recipe's; w<N>: N warm-up
    epochs. A batch above the recipe's warms up over 2 epochs by default (the recipe: 1). A bad
    name ends the phase (exit 2)."""
    parts = name.split("-")
    m = re.fullmatch(r"b(\d+)", parts[1]) if len(parts) > 1 else None
    if parts[0] not in ("sgd", "lars") or m is None:
        fail(f"--largebatch-variants: {name!r} is not OPTIMIZER-bBATCH[-linear|-sqrt|-lrX][-poly][-wdX][-wN] with "
             "OPTIMIZER sgd or lars, e.g. lars-b2048-lr10-poly")
    batch, lr, flags = int(m.group(1)), base_lr, [f"-b {m.group(1)}"]
    warmup = 2 if batch > LARGE_BATCH_BASE else None
    for part in parts[2:]:
        if part == "linear":
            lr = base_lr * batch / LARGE_BATCH_BASE
        elif part == "sqrt":
            lr = base_lr * math.sqrt(batch / LARGE_BATCH_BASE)
        elif re.fullmatch(r"lr[0-9.]+", part):
            lr = float(part[2:])
        elif part == "poly":
            flags.append("--lr-schedule poly --lr-poly-power 2 --lr-end 0.0001")
        elif re.fullmatch(r"wd[0-9.]+", part):  # a plain decimal: '-' separates the parts
            flags.append(f"--wd {float(part[2:]):g}")
        elif re.fullmatch(r"w[0-9]+", part):
            warmup = int(part[1:])
        else:
            fail(f"--largebatch-variants: {name!r} has {part!r}, not linear, sqrt, lr<X>, poly, wd<X> or w<N>")
    flags.append(f"--lr={lr:g}")
    if warmup is not None:
        flags.append(f"--warmup-epochs {warmup}")
    if parts[0] == "lars":
        flags.append("--optimizer lars")
    return " ".join(flags)


def phase_largebatch(args) -> None:
    """The recipe (--recipe-config, --lr its rate at batch 128) as each of --largebatch-variants,
    for each of --seeds, all at once on the visible GPUs (accuracy only; eager fp16, so that no run
    waits for a compilation), then each variant's mean and whether LARS at the large batch comes
    within 0.5 points of SGD at the recipe's batch where SGD at the large batch falls short."""
    names = args.largebatch_variants.split(",")
    flags = {v: largebatch_flags(v, float(args.lr)) for v in names}  # every name checked before any work
    data = ensure_fashion(args)
    base = f"{PY} {recipe_cmd(args, data)} --fp16{EAGER}"
    seeds = [int(x) for x in args.seeds.split(",")]
    gpus = max(visible_gpus(), 1)
    runs = [{"name": f"lb-{v}-s{seed}", "cmd": f"{base} {flags[v]} --seed {seed}",
             "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}}
            for k, (seed, v) in enumerate((s_, v_) for s_ in seeds for v_ in names)]
    results = run_group(runs, args)
    table(results, f"lb-{names[0]}-s{seeds[0]}")
    means = {}
    for v in names:
        accs = seed_accs(results, f"lb-{v}")
        if accs:
            means[v] = sum(accs) / len(accs)
            print(f"{v} ({flags[v]}): final Acc@1 mean {means[v]:.2f} over {len(accs)} seed(s), "
                  f"min {min(accs):.2f}, max {max(accs):.2f}")
    small = next((v for v in names if v.startswith("sgd-b") and int(v.split("-")[1][1:]) == LARGE_BATCH_BASE), None)
    if small in means:
        for v in names:
            if v != small and v in means:
                gap = means[v] - means[small]
                print(f"{v}: {gap:+.2f} points against {small} ({'within' if gap >= -0.5 else 'short of'} 0.5)")
