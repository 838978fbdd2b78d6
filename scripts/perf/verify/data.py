"""The data sets the phases train on, each made once (in /tmp or --data) and reused by later calls:
the ImageNet-shaped benchmark JPEGs, Fashion-MNIST as a folder and as larger JPEGs, a folder's tar
shards, and a short cut of the benchmark folder. A failed preparation ends the phase (exit 2)."""

from __future__ import annotations

import os
import shutil
import time

from .common import PY, fail, sh, tail

JPEG_DIR = "/tmp/bench_jpeg"


def ensure_jpeg(args) -> str:
    """The ImageNet-shaped JPEG folder (100 classes, --jpeg-per-class training images each)."""
    if os.path.isdir(os.path.join(JPEG_DIR, "train")):
        return JPEG_DIR
    cmd = (f"{PY} scripts/perf/make_benchmark_imagefolder.py {JPEG_DIR} --classes 100 --train-per-class "
           f"{args.jpeg_per_class} --val-per-class 4 --jobs {os.cpu_count()}")
    print("$", cmd, flush=True)
    if sh(cmd, os.path.join(args.out, "make_jpeg.log")).returncode:
        fail("making the JPEG folder failed:\n" + tail(os.path.join(args.out, "make_jpeg.log"), 20))
    return JPEG_DIR


def ensure_fashion(args) -> str:
    """Fashion-MNIST as an image folder in --data, prepared from the IDX files in --idx-dir."""
    if os.path.isdir(os.path.join(args.data, "train")):
        return args.data
    cmd = f"{PY} scripts/prepare_dataset.py fashion-mnist --src {args.idx_dir} --out {args.data}"
    print("$", cmd, flush=True)
    t0 = time.time()
    if sh(cmd, os.path.join(args.out, "prepare.log")).returncode:
        fail("preparing Fashion-MNIST failed:\n" + tail(os.path.join(args.out, "prepare.log"), 20))
    print(f"  prepared in {time.time() - t0:.0f} s", flush=True)
    return args.data


def ensure_fashion_jpeg(args) -> str:
    """Fashion-MNIST stored as --shrink-store px RGB JPEGs (a real set stored larger than it trains)."""
    root = f"/tmp/fashion-mnist-jpeg{args.shrink_store}"
    if os.path.isdir(os.path.join(root, "train")):
        return root
    cmd = (f"{PY} scripts/prepare_dataset.py fashion-mnist --src {args.idx_dir} --out {root} --format jpeg "
           f"--size {args.shrink_store} -q")
    print("$", cmd, flush=True)
    t0 = time.time()
    if sh(cmd, os.path.join(args.out, "prepare-jpeg.log")).returncode:
        fail("exporting Fashion-MNIST as JPEGs failed:\n" + tail(os.path.join(args.out, "prepare-jpeg.log"), 20))
    print(f"  exported in {time.time() - t0:.0f} s", flush=True)
    return root


def ensure_shards(args, src: str, out: str, shard_size: str) -> str:
    """``src`` converted by scripts/make_shards.py into ``out`` (reused when already finished)."""
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    cmd = f"{PY} scripts/make_shards.py {src} {out} --shard-size {shard_size} --workers {os.cpu_count()} -q"
    print("$", cmd, flush=True)
    t0 = time.time()
    log = os.path.join(args.out, f"make_shards-{os.path.basename(out)}.log")
    if sh(cmd, log).returncode:
        fail(f"converting {src} into shards failed:\n" + tail(log, 20))
    print(f"  converted in {time.time() - t0:.0f} s: {tail(log, 1).strip()}", flush=True)
    return out


def decode_subset(args) -> str:
    """The benchmark folder cut to --decode-per-class training images and one validation image a
    class (links, made in a second): short epochs, so that every row of the decode phase fits one call."""
    root = f"{JPEG_DIR}_decode{args.decode_per_class}"
    if os.path.isdir(os.path.join(root, "val")):
        return root
    src = ensure_jpeg(args)
    shutil.rmtree(root + ".tmp", ignore_errors=True)
    for split, keep in (("train", args.decode_per_class), ("val", 1)):
        for cls in sorted(os.listdir(os.path.join(src, split))):
            os.makedirs(os.path.join(root + ".tmp", split, cls), exist_ok=True)
            for name in sorted(os.listdir(os.path.join(src, split, cls)))[:keep]:
                os.symlink(os.path.join(src, split, cls, name), os.path.join(root + ".tmp", split, cls, name))
    os.rename(root + ".tmp", root)
    return root
