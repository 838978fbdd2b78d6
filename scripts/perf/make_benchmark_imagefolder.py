#!/usr/bin/env python
"""Write an ImageNet-shaped JPEG ImageFolder cut from scikit-image's real photographs.

    python scripts/perf/make_benchmark_imagefolder.py OUT [--classes 100] [--train-per-class 20] [--val-per-class 4] [--jobs N]

Each image is a random crop (random position, scale and aspect) of one of the sample photos,
resized to about ImageNet's typical 500x375 (landscape or portrait), saved as JPEG quality 90:
real photographic content and real JPEG statistics, so decode and crop costs match ImageNet's.
Labels carry no meaning (a benchmark set, not a learning task). Each class folder is drawn from
its own seed, so the files are the same for any --jobs (processes writing class folders at once).
Needs scikit-image.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys

import numpy as np
from PIL import Image

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "cat", "colorwheel", "camera", "brick", "grass", "gravel", "moon", "clock", "horse", "coins")


def load_photos() -> list:
    try:
        import skimage.data as data
    except ImportError:
        raise SystemExit("error: this script needs scikit-image: pip install scikit-image")
    photos = []
    for name in PHOTOS:
        try:
            img = np.asarray(getattr(data, name)())
        except Exception:  # a sample missing from this scikit-image version
            continue
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        photos.append(Image.fromarray(img[..., :3].astype(np.uint8)))
    if not photos:
        raise SystemExit("error: no scikit-image sample photos could be loaded")
    return photos


def make_image(photo: Image.Image, rng: np.random.Generator) -> Image.Image:
    w, h = photo.size
    area = w * h * rng.uniform(0.3, 1.0)
    aspect = rng.uniform(0.6, 1.7)
    cw = int(min(w, max(32, round((area * aspect) ** 0.5))))
    ch = int(min(h, max(32, round((area / aspect) ** 0.5))))
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    size = (500, 375) if rng.random() < 0.75 else (375, 500)
    img = photo.crop((left, top, left + cw, top + ch)).resize(size, Image.BILINEAR)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


@functools.lru_cache(maxsize=1)
def photos_once() -> tuple:
    """The sample photos, loaded once per process."""
    return tuple(load_photos())


def write_class(job: tuple) -> int:
    """Write one class folder of one split; returns the number of files."""
    out, split, split_index, c, per_class, quality, seed = job
    photos = photos_once()
    rng = np.random.default_rng([seed, split_index, c])
    folder = os.path.join(out, split, f"n{c:08d}")
    os.makedirs(folder, exist_ok=True)
    for i in range(per_class):
        img = make_image(photos[int(rng.integers(len(photos)))], rng)
        img.save(os.path.join(folder, f"{split}_{c:05d}_{i:05d}.JPEG"), quality=quality)
    return per_class


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--train-per-class", type=int, default=20)
    p.add_argument("--val-per-class", type=int, default=4)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes writing class folders at once")
    args = p.parse_args(argv)
    if min(args.classes, args.train_per_class, args.val_per_class, args.jobs) < 1:
        print("error: --classes, --jobs and the per-class counts must be at least 1", file=sys.stderr)
        return 2
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"error: {args.out} is not empty; choose a new folder", file=sys.stderr)
        return 2
    photos_once()  # a missing scikit-image is one message here, not one per process
    jobs = [(args.out, split, k, c, per_class, args.quality, args.seed)
            for k, (split, per_class) in enumerate((("train", args.train_per_class), ("val", args.val_per_class)))
            for c in range(args.classes)]
    if args.jobs > 1:
        with multiprocessing.Pool(min(args.jobs, len(jobs))) as pool:
            total = sum(pool.map(write_class, jobs, chunksize=1))
    else:
        total = sum(map(write_class, jobs))
    print(f"wrote {total} JPEGs ({args.classes} classes) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
