"""Tar shards (scripts/make_shards.py) against the image folder they were made from: the speed
of ResNet-50 trained from each (with CPU and GPU decode, beside the synthetic step) and the
Fashion-MNIST recipe's accuracy from each over seeds. Shard runs use a shuffle window scaled to
the set as main.py's default is to ImageNet's."""

from __future__ import annotations

import json
import os

from .common import (G0, PY, epoch_rates, fail, print_commands, recipe_cmd, run_group, run_one, table, tail,
                     visible_gpus)
from .data import JPEG_DIR, ensure_fashion, ensure_jpeg, ensure_shards

IMAGENET_TRAIN = 1_281_167
SHARD_WINDOW = 65_536  # main.py's default --shuffle-window: ImageNet's order mixes 1/20 of the set at a time
SOURCES = ("folder", "shards")


def scaled_window(train_images: int, args) -> int:
    """--shards-window, or the default window scaled to the set: the share of it ImageNet's default mixes."""
    return args.shards_window or max(1, round(train_images * SHARD_WINDOW / IMAGENET_TRAIN))


def _train_images(shards: str) -> int:
    return json.load(open(os.path.join(shards, "index.json")))["splits"]["train"]["samples"]


def phase_shards(args) -> None:
    """Tar shards against the image folder they were made from, --shards-parts:
    speed: ResNet-50 --fp16 --channels-last end to end from the benchmark folder (ensure_jpeg) and
    from its shards, --shards-decode (CPU and/or --decode gpu), --shards-workers workers, each mode's synthetic
    step (main.py --dummy) for reference, one run at a time; accuracy: Fashion-MNIST as shards vs
    the same folder, the fp16 recipe, --shards-seeds. The shard runs use a window scaled to the set
    as main.py's default is to ImageNet's (--shards-window)."""
    parts = args.shards_parts.split(",")
    if set(parts) - {"speed", "accuracy"}:
        fail(f"--shards-parts: {args.shards_parts!r}; choose from speed,accuracy")
    modes = args.shards_modes.split(",")
    if set(modes) - {"eager", "cuda-graphs"}:
        fail(f"--shards-modes: {args.shards_modes!r}; choose from eager,cuda-graphs")
    if not args.shards_decode or set(args.shards_decode.split(",")) - {"cpu", "gpu"}:
        fail(f"--shards-decode: {args.shards_decode!r}; choose from cpu,gpu")
    if "speed" in parts:
        _shards_speed(args, modes)
    if "accuracy" in parts:
        _shards_accuracy(args)


def _shards_speed(args, modes: list) -> None:
    ensure_jpeg(args)
    shards = ensure_shards(args, JPEG_DIR, JPEG_DIR + "-shards", args.shards_size)
    window = scaled_window(_train_images(shards), args)
    model = "-a resnet50 -b 256 --fp16 --channels-last"
    runs = []  # (name, mode, cmd)
    for mode in modes:
        compiled = "" if mode == "cuda-graphs" else " --compile off"  # the speed defaults compile on a GPU
        runs.append((f"synthetic-main-{mode}", mode, f"timeout {args.e2e_timeout} {PY} main.py --dummy {model} "
                     f"--epochs 3 --dummy-train-size {256 * 60} --dummy-val-size 2560 -p 100 --output-dir OUT{compiled}"))
        for decode in args.shards_decode.split(","):
            for source, data, extra in (("folder", JPEG_DIR, ""), ("shards", shards, f" --shuffle-window {window}")):
                runs.append((f"{source}-{decode}-decode-{mode}", mode,
                             f"timeout {args.e2e_timeout} {PY} main.py {data} {model} -j {args.shards_workers} "
                             f"--epochs {args.e2e_epochs} -p 50 --decode {decode} --output-dir OUT{compiled}{extra}"))
    rows, results = {}, []
    for name, mode, cmd in runs:
        res = run_one(name, cmd, G0, args)
        results.append(res)
        print(tail(os.path.join(args.out, name, "log.txt"), 3), flush=True)
        rows[name] = (mode, epoch_rates(os.path.join(args.out, name), 1), res)
    print(f"\nshards: {shards} (window {window} images); median epoch after the first")
    print("| row | img/s (median) | spread | data wait | vs synthetic step, same mode | shards vs folder | wall s |\n"
          "| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, (mode, rates, res) in rows.items():
        if rates is None:
            print(f"| {name} | FAILED (exit {res['rc']}) | | | | | {res['seconds']:.0f} |")
            continue
        med, lo, hi, wait = rates
        synthetic = rows.get(f"synthetic-main-{mode}", (None, None))[1]
        folder = rows.get(name.replace("shards-", "folder-"), (None, None))[1] if name.startswith("shards-") else None
        vs_syn = f"{100 * med / synthetic[0]:.1f}%" if synthetic and not name.startswith("synthetic") else ""
        vs_folder = f"{100 * med / folder[0]:.1f}%" if folder else ""
        print(f"| {name} | {med:.0f} | {lo:.0f}..{hi:.0f} | {wait:.3f} | {vs_syn} | {vs_folder} | {res['seconds']:.0f} |")
    print_commands(results)


def _folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) + 1536 for d, _, files in os.walk(root) for f in files)


def _shards_accuracy(args) -> None:
    """Fashion-MNIST: the fp16 recipe from the folder and from its shards, three seeds (all at once,
    alternating over the GPUs); shards as many as ImageNet's 1 GB ones are to its set (about 140)."""
    data = ensure_fashion(args)
    size = max(_folder_bytes(os.path.join(data, "train")) // 140, 1 << 16)
    shards = ensure_shards(args, data, args.data.rstrip("/") + "-shards", str(size))
    window = scaled_window(_train_images(shards), args)
    seeds = [int(x) for x in args.shards_seeds.split(",")]
    gpus = max(visible_gpus(), 1)
    runs = []
    for k, (seed, source) in enumerate((s, src) for s in seeds for src in SOURCES):
        root, extra = (data, "") if source == "folder" else (shards, f" --shuffle-window {window}")
        runs.append({"name": f"acc-{source}-s{seed}", "cmd": f"{PY} {recipe_cmd(args, root)} --fp16 --seed {seed}{extra}",
                     "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}})
    results = run_group(runs, args)
    table(results, f"acc-folder-s{seeds[0]}")
    means = {}
    for source in SOURCES:
        accs = [r["acc1"] for r in results if r["name"].startswith(f"acc-{source}-") and r["acc1"] is not None
                and not r.get("cut")]
        if accs:
            means[source] = sum(accs) / len(accs)
            print(f"{source}: final Acc@1 mean {means[source]:.2f} over {len(accs)} seed(s), min {min(accs):.2f}, "
                  f"max {max(accs):.2f}")
    if len(means) == 2:
        diff = means["shards"] - means["folder"]
        print(f"shards - folder: {diff:+.2f} points ({'within' if abs(diff) <= 0.2 else 'NOT within'} 0.2); "
              f"{_train_images(shards)} training images in {size / 1e6:.1f} MB shards, window {window}")
