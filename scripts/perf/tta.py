#!/usr/bin/env python
"""Time to accuracy on this GPU: ResNet-50's step at each training size, the input from JPEG
files, validation and checkpoints, and what FFCV's recipes (configs/resnet50-ffcv-*.yaml,
configs/resnet18-ffcv-*.yaml) would take here, projected from them, in one call.

    python scripts/perf/tta.py --out DIR [--rows ROWS] [--budget SECONDS]
    python scripts/perf/tta.py --project A/rows.json,B/rows.json   # the tables again from calls' rows, no GPU

Each row is one process, run one after another (the GPU to itself), in the order of ``--rows``;
rows that share a shape share its compiled graphs through Inductor's cache (CACHE_DIR/inductor),
so each shape is compiled cold once a call (about 45 s for ResNet-50 on an H200) and read from
the cache after. A ``main.py`` row reads its ``metrics.jsonl``: per epoch the size, the steady
img/s, the input wait, the graphs compiled, validation's and the checkpoint's seconds; the
first-step lines of its log. After each row its line is printed and ``DIR/rows.json`` rewritten,
so a call cut short keeps what it measured; at the end: the table of every epoch, the
progressive run against the typed command at the same size, BlurPool's cost, and the projection
of each recipe (training at each size from files, validation of 50,000 images and a checkpoint
every epoch, each size's compilation once), beside FFCV's published time and hardware. From
files a run's first epoch is left out of the files-against-synthetic table (its files read cold,
its workers starting). The first six default rows took 532 s on an H100 with 16 cores, a fresh
machine (docs/BENCHMARKS.md, QQ1); --budget leaves out the rows that would start too late. DIR
receives every row's checkpoints (hundreds of MB): give a scratch folder and keep DIR/rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
# 1,000 classes of ImageNet-sized JPEGs (scripts/perf/make_benchmark_imagefolder.py): ImageNet's
# classifier, so the JPEG rows run the synthetic rows' graphs, read from Inductor's cache
JPEG = "/tmp/bench_jpeg_tta"
TRAIN_IMAGES, VAL_IMAGES = 1_281_167, 50_000  # ImageNet-1k
RECIPE = "configs/resnet50-ffcv-16.yaml"
# One epoch at 160 px, one at 192 (the recipes' two sizes; a warm-up of one epoch, as two epochs cannot
# hold two, which changes no rate); a synthetic recipe epoch is 15 optimizer steps of 4,096
RAMP = "--epochs 2 --progressive-ramp 0:1 --warmup-epochs 1 -p 1000"
# from files, four epochs at 160 px (78 batches of 512 each): a run's first epoch reads its files from
# disk and starts its workers, and --decode-share auto rises 0.04 every 8 + 2 x workers batches, so
# the last 160 px epoch is the first a share settled over; the projection takes each size's last epoch
RAMP_FILES = "--epochs 5 --progressive-ramp 3:4 --warmup-epochs 1 -p 1000"
# the typed command at each size, the first (128 px) twice for the same reason; sizes 128, 128, 160, 192, 224
SIZES_FILES = "--image-size 224 --progressive-resize 128 --progressive-ramp 1:4 --epochs 5 -p 1000"
SYNTH_VAL = "--dummy-val-size 10240"
# name: (what it measures, command; OUT is the row's folder, JPEG the image folder)
ROWS = {
    "sizes-b256": ("the typed command at 128, 160, 192, 224 px in one run (--progressive-resize, GPU defaults), "
                   "then a second epoch at 224 px, which should compile nothing",
                   "main.py --dummy -a resnet50 -b 256 --fp16 --image-size 224 --progressive-resize 128 "
                   "--progressive-ramp 0:3 --epochs 5 --dummy-train-size 10240 --dummy-val-size 1024 -p 1000"),
    "typed-160": ("the typed command at 160 px, a run of its own (against sizes-b256's 160 px epoch)",
                  "main.py --dummy -a resnet50 -b 256 --fp16 --image-size 160 --val-crop 224 --epochs 1 "
                  "--dummy-train-size 10240 --dummy-val-size 1024 -p 1000"),
    "sizes-b512": ("-b 512 (the recipe's batch a GPU) at 160 and 192 px, CUDA graphs; validation 256 px flipped",
                   f"main.py --dummy -a resnet50 -b 512 --fp16 --image-size 192 --progressive-resize 160 {RAMP} "
                   f"--val-crop 256 --val-resize 293 --val-flip --dummy-train-size 20480 {SYNTH_VAL}"),
    "recipe": (f"{RECIPE} on synthetic data: 8 passes of 512 a step, 160 then 192 px",
               f"main.py --dummy --config {RECIPE} {RAMP} --dummy-train-size 61440 {SYNTH_VAL}"),
    "jpeg-j4": (f"{RECIPE} from JPEG files, -j 4, the default decode: 160 px four times, then 192 px, validation, "
                "checkpoints", f"main.py JPEG --config {RECIPE} {RAMP_FILES} -j 4"),
    "jpeg-j8": ("the same with -j 8", f"main.py JPEG --config {RECIPE} {RAMP_FILES} -j 8"),
    "jpeg-j8-gpu-only": ("the same with every JPEG decoded on the GPU (--decode-share 0: the workers take no share)",
                         f"main.py JPEG --config {RECIPE} {RAMP_FILES} -j 8 --decode-share 0"),
    "jpeg-sizes-j8-gpu-only": ("jpeg-sizes-j8 with every JPEG decoded on the GPU (--decode-share 0)",
                               f"main.py JPEG -a resnet50 -b 256 --fp16 {SIZES_FILES} -j 8 --decode-share 0"),
    "jpeg-sizes-j8": ("the typed command from JPEG files, -j 8, at 128 (twice), 160, 192 and 224 px (against sizes-b256)",
                      f"main.py JPEG -a resnet50 -b 256 --fp16 {SIZES_FILES} -j 8"),
    "jpeg-sizes-j4": ("the same with -j 4", f"main.py JPEG -a resnet50 -b 256 --fp16 {SIZES_FILES} -j 4"),
    "blur": ("BlurPool's step cost: bench.py train, eager on torch's modules (what --blurpool runs on), -b 512 at "
             "192 px, with and without --blurpool",
             "bench.py train --precision fp16 --channels-last --maxpool-kernel torch --bn-kernel torch "
             "--batch-size 512 --image-size 192 --warmup 5 --steps 10 --windows 3"),
    "rn18": ("configs/resnet18-ffcv-16.yaml on synthetic data (1,024 a step), 160 then 192 px",
             f"main.py --dummy --config configs/resnet18-ffcv-16.yaml {RAMP} --dummy-train-size 40960 {SYNTH_VAL}"),
}
# the projection's rows first: a call past --budget leaves out the last
DEFAULT_ROWS = "recipe,jpeg-j8,sizes-b256,jpeg-sizes-j8,jpeg-j4,jpeg-sizes-j4,typed-160,blur,sizes-b512"
# each files row against the synthetic row of its batch and sizes, side by side in the call
FILES_AGAINST = {"jpeg-j4": "recipe", "jpeg-j8": "recipe", "jpeg-j8-gpu-only": "recipe", "jpeg-sizes-j4": "sizes-b256",
                 "jpeg-sizes-j8": "sizes-b256", "jpeg-sizes-j8-gpu-only": "sizes-b256"}
# FFCV's published runs (libffcv/ffcv-imagenet README, assets/agg.csv): epochs -> (top-1 %, minutes)
FFCV_RN50 = {16: (73.8, 14.9), 24: (75.6, 21.7), 32: (76.6, 28.7), 40: (77.2, 35.6), 56: (78.0, 49.4), 88: (78.4, 77.2)}
FFCV_RN18 = {16: (66.9, 35.0), 24: (68.8, 51.6), 32: (70.0, 68.9), 40: (70.6, 85.5), 56: (71.3, 119.4),
             88: (72.4, 187.3)}
FIRST_STEP = re.compile(r"=> first step (?:at (\d+) px )?done ([\d.]+) s")
DECODE = re.compile(r"JPEGs decoded (on the GPU|in the CPU workers)")


# ------------------------------------------------------------------ reading a row


def epochs_of(rows: list) -> list:
    """metrics.jsonl's rows reduced to what the tables use; ``overhead``: the epoch's training time
    beyond its images at the steady rate (compilation, cuDNN's search, the workers' start);
    ``ckpt``: the epoch's time beyond training and validation (its checkpoint, mostly)."""
    out = []
    for r in rows:
        rate = r["img_per_s"] or float("nan")
        stages = r.get("input_stages") or {}
        thread = sum(stages.get(k, 0.0) for k in ("starved", "busy", "ahead"))  # the decode thread's time
        out.append({"size": r["image_size"], "img_per_s": r["img_per_s"], "wait": r["data_wait_frac"],
                    # --decode gpu: the workers' share of the JPEGs, the decode thread's busy fraction
                    "share": stages.get("decode_share"), "busy": stages.get("busy", 0.0) / thread if thread else None,
                    "compiles": r.get("compiles"), "train_s": r["train_seconds"],
                    "overhead": max(r["train_seconds"] - r["train_samples"] / rate, 0.0),
                    "val_s": r.get("val_seconds", 0.0), "val_samples": r["val_samples"],
                    "ckpt": max(r["epoch_seconds"] - r["train_seconds"] - r.get("val_seconds", 0.0), 0.0)})
    return out


def first_steps(log: str) -> dict:
    """{size or 0 (the run's first): seconds} from the log's first-step lines."""
    return {int(size or 0): float(sec) for size, sec in FIRST_STEP.findall(log)}


def files_against(results: dict) -> list:
    """Each files row's steady rate at each size (the last epoch at that size, never the run's
    first) against its synthetic row's (FILES_AGAINST) at that size, as rows of a table."""
    out = []
    for files, synthetic in FILES_AGAINST.items():
        got, ref = results.get(files, {}).get("epochs"), results.get(synthetic, {}).get("epochs")
        if not got or not ref:
            continue
        steady = {e["size"]: e for e in got[1:]}
        ref_rate = {e["size"]: e["img_per_s"] for e in ref}
        for size, e in sorted(steady.items()):
            base = ref_rate.get(size)
            out.append({"files": files, "synthetic": synthetic, "size": size, "img_per_s": e["img_per_s"],
                        "wait": e["wait"], "synthetic_img_per_s": base,
                        "ratio": e["img_per_s"] / base if base and e["img_per_s"] else None})
    return out


# ------------------------------------------------------------------ the projection


@dataclass(frozen=True)
class Recipe:
    name: str
    arch: str
    epochs: int
    sizes: tuple  # the training size of each epoch
    batch: int  # global
    ffcv: tuple  # (top-1 %, minutes, GPUs)


def recipes(root: str = REPO) -> list:
    """Every FFCV config of configs/, as the trainer reads it (its sizes per epoch, its batch)."""
    sys.path.insert(0, root)
    from imagenet.base.config import parse_config
    from imagenet.data.transforms import image_size_at
    out = []
    for arch, published, gpus in (("resnet50", FFCV_RN50, 8), ("resnet18", FFCV_RN18, 1)):
        for epochs, (acc, minutes) in published.items():
            path = os.path.join(root, "configs", f"{arch}-ffcv-{epochs}.yaml")
            if not os.path.exists(path):
                continue
            cfg = parse_config(["DIR", "--config", path])
            out.append(Recipe(os.path.basename(path), arch, epochs, tuple(image_size_at(e, cfg) for e in range(epochs)),
                              cfg.batch_size, (acc, minutes, gpus)))
    return out


def project(recipe: Recipe, *, rates: dict, val_rate: float, ckpt_s: float, overhead: dict) -> dict:
    """Seconds ``recipe`` takes on one GPU: every epoch's training images (ImageNet's, less the
    last partial batch) at ``rates[size]`` img/s, a validation of 50,000 images at ``val_rate``
    img/s and a checkpoint of ``ckpt_s`` s after every epoch, and ``overhead[size]`` s once per
    size (its compilation and the first steps). None where a size has no rate."""
    if any(size not in rates or not rates[size] for size in recipe.sizes):
        return None
    per_epoch = TRAIN_IMAGES // recipe.batch * recipe.batch
    train = sum(per_epoch / rates[size] for size in recipe.sizes)
    val = recipe.epochs * VAL_IMAGES / val_rate
    ckpt = recipe.epochs * ckpt_s
    compile_s = sum(overhead.get(size, 0.0) for size in set(recipe.sizes))
    total = train + val + ckpt + compile_s
    acc, minutes, gpus = recipe.ffcv
    return {"recipe": recipe.name, "epochs": recipe.epochs, "train_min": train / 60, "val_min": val / 60,
            "ckpt_min": ckpt / 60, "compile_min": compile_s / 60, "total_min": total / 60, "gpu_hours": total / 3600,
            "ffcv_min": minutes, "ffcv_gpus": gpus, "ffcv_gpu_min": minutes * gpus, "ffcv_acc": acc,
            "gpu_time_ratio": minutes * gpus / (total / 60)}


def inputs_for(results: dict, arch: str):
    """(rates by size, validation img/s, checkpoint s, overhead by size, the rows used) of
    ``arch``'s projection, or None: rates, validation and checkpoint from the faster of the JPEG
    rows (from files), else the synthetic recipe row; the overhead of each size (its compilation,
    cold, and first steps; validation's first compilation added to the first size) from the
    synthetic recipe row, the first to compile those shapes in a call, else the same row."""
    files, synthetic = (["jpeg-j4", "jpeg-j8"], "recipe") if arch == "resnet50" else ([], "rn18")
    measured = {n: results[n]["epochs"] for n in files + [synthetic] if results.get(n, {}).get("epochs")}
    if not measured:
        return None
    from_files = [n for n in files if n in measured]
    name = max(from_files, key=lambda n: sum(e["img_per_s"] for e in measured[n])) if from_files else synthetic
    epochs = measured[name]
    rates = {e["size"]: e["img_per_s"] for e in epochs}
    last = epochs[-1]
    val_rate = last["val_samples"] / last["val_s"] if last["val_s"] else float("nan")
    ckpt = min(e["ckpt"] for e in epochs)
    cold = measured.get(synthetic, epochs)
    overhead = {}
    for e in cold:  # the first epoch at each size
        overhead.setdefault(e["size"], e["overhead"])
    first, steady = cold[0], cold[-1]
    steady_val = steady["val_s"] * first["val_samples"] / max(steady["val_samples"], 1)
    overhead[first["size"]] += max(first["val_s"] - steady_val, 0.0)
    return rates, val_rate, ckpt, overhead, f"{name}" + (f", compiling from {synthetic}" if cold is not epochs else "")


# ------------------------------------------------------------------ the tables


def fmt(x, spec=",.0f"):
    return "-" if x is None or x != x else format(x, spec)


def print_tables(results: dict, root: str = REPO) -> list:
    """Every table of the call's ``results`` (rows.json); returns the projection's rows."""
    print("\n| row | size px | img/s | input wait | compiles | first step s | val img/s | checkpoint s | workers' share "
          "| decode thread busy |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        for i, e in enumerate(r.get("epochs", [])):
            first = r.get("first_steps", {})
            step = first.get(str(e["size"]), first.get(e["size"])) if i else first.get("0", first.get(0))
            val = e["val_samples"] / e["val_s"] if e["val_s"] else None
            print(f"| {name} | {e['size']} | {fmt(e['img_per_s'])} | {fmt(e['wait'], '.3f')} | {fmt(e['compiles'], 'd')}"
                  f" | {fmt(step, '.1f')} | {fmt(val)} | {fmt(e['ckpt'], '.1f')} | {fmt(e.get('share'), '.3f')} "
                  f"| {fmt(e.get('busy'), '.3f')} |")
    files_rows = files_against(results)
    if files_rows:
        print("\nfrom files against synthetic data, each size's last epoch (the first epoch of a run is left out)")
        print("| files row | synthetic row | size px | files img/s | input wait | synthetic img/s | ratio |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for f in files_rows:
            print(f"| {f['files']} | {f['synthetic']} | {f['size']} | {fmt(f['img_per_s'])} | {fmt(f['wait'], '.3f')} "
                  f"| {fmt(f['synthetic_img_per_s'])} | {fmt(f['ratio'], '.3f')}x |")
    prog, typed = results.get("sizes-b256", {}).get("epochs"), results.get("typed-160", {}).get("epochs")
    if prog and typed:
        p = next((e["img_per_s"] for e in prog if e["size"] == 160), None)
        alone = typed[-1]["img_per_s"]
        print(f"\n--progressive-resize at 160 px {fmt(p)} img/s, the typed command at 160 px {fmt(alone)}: "
              f"{fmt(p / alone if p else None, '.3f')}x; graphs compiled per epoch "
              f"{[e['compiles'] for e in prog]} (sizes {[e['size'] for e in prog]})")
    blur = results.get("blur", {}).get("bench")
    if blur and len(blur) == 2:
        plain, blurred = blur
        print(f"\nBlurPool, eager -b 512 at 192 px: {fmt(blurred['img_per_s'])} against {fmt(plain['img_per_s'])} "
              f"img/s ({fmt(blurred['img_per_s'] / plain['img_per_s'], '.3f')}x); peak memory "
              f"{blurred['peak_gib']:.1f} against {plain['peak_gib']:.1f} GiB")
    projected = []
    for arch in ("resnet50", "resnet18"):
        got = inputs_for(results, arch)
        if got is None:
            continue
        rates, val_rate, ckpt, overhead, source = got
        trained = ", ".join(f"{size} px {fmt(rate)} img/s" for size, rate in rates.items())
        compiled = ", ".join(f"{size} px {seconds:.0f} s" for size, seconds in overhead.items())
        print(f"\n{arch}: projected from row {source}: training {trained}; validation {fmt(val_rate)} img/s "
              f"({VAL_IMAGES:,} images: {fmt(VAL_IMAGES / val_rate, '.1f')} s); checkpoint {ckpt:.1f} s; "
              f"compilation and first steps {compiled}")
        print("| recipe | epochs | training min | validation min | checkpoints min | compiling min | total min | "
              "GPU-hours | FFCV min (GPUs) | FFCV GPU-min | FFCV's GPU time / ours | FFCV top-1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for recipe in recipes(root):
            if recipe.arch != arch:
                continue
            p = project(recipe, rates=rates, val_rate=val_rate, ckpt_s=ckpt, overhead=overhead)
            if p is None:
                continue
            projected.append(p)
            print(f"| {p['recipe']} | {p['epochs']} | {p['train_min']:.1f} | {p['val_min']:.1f} | {p['ckpt_min']:.1f} | "
                  f"{p['compile_min']:.1f} | {p['total_min']:.1f} | {p['gpu_hours']:.2f} | {p['ffcv_min']} "
                  f"({p['ffcv_gpus']}x A100) | {p['ffcv_gpu_min']:.0f} | {p['gpu_time_ratio']:.2f}x | "
                  f"{p['ffcv_acc']} |")
    return projected


# ------------------------------------------------------------------ running the rows


def ensure_jpeg(per_class: int, val_per_class: int) -> str:
    if os.path.isdir(os.path.join(JPEG, "val")):
        return JPEG
    cmd = [PY, "scripts/perf/make_benchmark_imagefolder.py", JPEG, "--classes", "1000", "--train-per-class",
           str(per_class), "--val-per-class", str(val_per_class), "--jobs", str(os.cpu_count())]
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return JPEG


def run_row(name: str, out: str, args) -> dict:
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    what, template = ROWS[name]
    if "JPEG" in template.split():
        template = template.replace("JPEG", ensure_jpeg(args.jpeg_per_class, args.val_per_class), 1)
    variants = [""] if name != "blur" else ["", " --blurpool"]
    result = {"what": what, "commands": []}
    t0 = time.time()
    for k, extra in enumerate(variants):
        if template.startswith("bench.py"):
            cmd = f"{PY} scripts/perf/{template}{extra} --json {folder}/bench{k}.json"
        else:
            cmd = f"{PY} {template}{extra} --output-dir {folder}"
        print(f"$ {cmd}", flush=True)
        result["commands"].append(cmd)
        with open(os.path.join(folder, f"log{k}.txt"), "w") as log:
            try:
                rc = subprocess.run(shlex.split(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=args.row_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        result["rc"] = rc
    result["seconds"] = time.time() - t0
    if name == "blur":
        result["bench"] = [json.load(open(os.path.join(folder, f"bench{k}.json")))[0]
                           for k in range(2) if os.path.exists(os.path.join(folder, f"bench{k}.json"))]
        return result
    metrics = os.path.join(folder, "metrics.jsonl")
    result["epochs"] = epochs_of([json.loads(line) for line in open(metrics)]) if os.path.exists(metrics) else []
    log = open(os.path.join(folder, "log0.txt")).read()
    result["first_steps"] = first_steps(log)
    decode = DECODE.search(log)
    result["decode"] = decode.group(1) if decode else None
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/tta", help="where each row's folder and rows.json go")
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list, in order, of {', '.join(ROWS)}")
    p.add_argument("--budget", type=float, default=420,
                   help="seconds; a row that would start later is not run (the longest row takes about 3 minutes)")
    p.add_argument("--row-timeout", type=float, default=240, help="seconds one process may take")
    p.add_argument("--jpeg-per-class", type=int, default=40, help="training JPEGs a class (1,000 classes)")
    p.add_argument("--val-per-class", type=int, default=5, help="validation JPEGs a class")
    p.add_argument("--project", metavar="ROWS_JSON", help="print the tables of earlier calls' rows.json (a comma list: "
                                                          "the rows of all, a later file's row replacing an earlier's) and stop")
    args = p.parse_args()
    if args.project:
        merged = {}
        for path in args.project.split(","):
            merged.update(json.load(open(path)))
        print_tables(merged)
        return 0
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    os.makedirs(args.out, exist_ok=True)
    results, start = {}, time.time()
    for name in names:
        if time.time() - start > args.budget:
            print(f"-- {name}: not run, past --budget {args.budget:.0f} s", flush=True)
            continue
        results[name] = run_row(name, args.out, args)
        r = results[name]
        print(f"   {name}: exit {r['rc']} in {r['seconds']:.0f} s ({time.time() - start:.0f} s so far); "
              + "; ".join(f"{e['size']} px {fmt(e['img_per_s'])} img/s" for e in r.get("epochs", [])), flush=True)
        with open(os.path.join(args.out, "rows.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print_tables(results)
    print(f"\nrows: {os.path.join(args.out, 'rows.json')} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
