#!/usr/bin/env python
"""Sort the official flat ImageNet val folder into class folders (``val/<wnid>/ILSVRC2012_val_*.JPEG``).

The 50,000 validation images ship in one flat folder; ImageFolder needs one sub-folder per class.

    python scripts/prepare_imagenet_val.py VAL_DIR GROUND_TRUTH [--mode move|copy|symlink] [--dry-run]

GROUND_TRUTH is any of (detected from the contents, or given with --format):
  kaggle    Kaggle's LOC_val_solution.csv: ``ImageId,PredictionString``, the wnid first in PredictionString
  pairs     one ``filename wnid`` pair per line (space, tab or comma separated; the extension may be left off)
  wnids     one wnid per line in file order (e.g. imagenet_2012_validation_synset_labels.txt):
            line k is ILSVRC2012_val_{k:08d}.JPEG
  devkit    ILSVRC2012_validation_ground_truth.txt (one ILSVRC2012_ID 1..1000 per line, in file order)
            together with --devkit-meta data/meta.mat from the devkit (needs scipy)

Every listed image must exist and every flat image must be listed, or nothing is touched. Re-running
on a sorted (or partly sorted) folder only does what is left.
"""

import os
import sys

# Runs as `python scripts/prepare_imagenet_val.py` from anywhere: make the repo's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import csv  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

from imagenet.base.errors import EXIT_USER_ERROR, UserError  # noqa: E402

FORMATS = ("kaggle", "pairs", "wnids", "devkit")
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}
WNID_RE = re.compile(r"^n\d{8}$")
VAL_NAME = "ILSVRC2012_val_{:08d}.JPEG"
SHOW = 5  # how many example names an error lists


def _examples(names) -> str:
    names = sorted(names)
    more = f", ... ({len(names)} in all)" if len(names) > SHOW else ""
    return ", ".join(names[:SHOW]) + more


def _image_name(name: str) -> str:
    """Ground-truth files disagree on whether the extension is written; the official files have .JPEG."""
    name = os.path.basename(name.strip())
    return name if Path(name).suffix.lower() in IMAGE_SUFFIXES else name + ".JPEG"


def _check_wnid(wnid: str, where: str) -> str:
    if not WNID_RE.match(wnid):
        hint = (" (integer class indices need a synset list to mean anything; use a file with wnids, "
                "e.g. Kaggle's LOC_val_solution.csv)" if wnid.isdigit() else "")
        raise UserError(f"{where}: {wnid!r} is not a WordNet id like n01440764{hint}")
    return wnid


def _lines(path: Path) -> List[str]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: spreadsheets add a BOM to CSVs
    except FileNotFoundError:
        raise UserError(f"ground truth {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"ground truth {path}: cannot read ({e}); pass a text or CSV file") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def detect_format(path: Path, lines: List[str], devkit_meta: Optional[Path]) -> str:
    """Guess the ground-truth format from its first line (see the module docstring)."""
    if not lines:
        raise UserError(f"ground truth {path} is empty")
    first = lines[0]
    tokens = re.split(r"[\s,]+", first)
    if first.lower().startswith("imageid") or (first.count(",") == 1 and len(tokens) > 2):
        return "kaggle"
    if len(tokens) == 2:
        return "pairs"
    if len(tokens) == 1 and WNID_RE.match(tokens[0]):
        return "wnids"
    if len(tokens) == 1 and tokens[0].isdigit():
        if devkit_meta is None:
            raise UserError(
                f"{path} holds class numbers, i.e. the devkit's ILSVRC2012_validation_ground_truth.txt; "
                "pass --devkit-meta path/to/ILSVRC2012_devkit_t12/data/meta.mat to map them to wnids"
            )
        return "devkit"
    raise UserError(f"cannot tell the format of {path} from its first line {first[:80]!r}; pass --format {{{','.join(FORMATS)}}}")


def parse_kaggle(path: Path, lines: List[str]) -> Dict[str, str]:
    rows = csv.reader(lines)
    gt = {}
    for lineno, row in enumerate(rows, 1):
        if lineno == 1 and row and row[0].strip().lower() == "imageid":
            continue
        if len(row) < 2 or not row[1].split():
            raise UserError(f"{path} line {lineno}: expected ImageId,PredictionString, got {','.join(row)[:80]!r}")
        _add(gt, _image_name(row[0]), _check_wnid(row[1].split()[0], f"{path} line {lineno}"), path)
    return gt


def parse_pairs(path: Path, lines: List[str]) -> Dict[str, str]:
    gt = {}
    for lineno, line in enumerate(lines, 1):
        tokens = re.split(r"[\s,]+", line)
        if len(tokens) != 2:
            raise UserError(f"{path} line {lineno}: expected 'filename wnid', got {line[:80]!r}")
        _add(gt, _image_name(tokens[0]), _check_wnid(tokens[1], f"{path} line {lineno}"), path)
    return gt


def parse_wnids(path: Path, lines: List[str]) -> Dict[str, str]:
    return {VAL_NAME.format(k): _check_wnid(line, f"{path} line {k}") for k, line in enumerate(lines, 1)}


def load_devkit_meta(meta_path: Path) -> Dict[int, str]:
    """ILSVRC2012_ID -> wnid for the 1,000 leaf synsets (num_children == 0) of the devkit's meta.mat."""
    try:
        import scipy.io
    except ImportError:
        raise UserError(
            "reading the devkit's meta.mat needs scipy: pip install scipy "
            "(or use Kaggle's LOC_val_solution.csv or a wnid-per-line file instead)"
        ) from None
    try:
        synsets = scipy.io.loadmat(str(meta_path), squeeze_me=True)["synsets"]
        ids, wnids, children = synsets["ILSVRC2012_ID"], synsets["WNID"], synsets["num_children"]
        mapping = {int(i): str(w) for i, w, c in zip(ids, wnids, children) if int(c) == 0}
    except FileNotFoundError:
        raise UserError(f"--devkit-meta {meta_path}: no such file") from None
    except (KeyError, ValueError, TypeError, IndexError, OSError) as e:
        raise UserError(f"--devkit-meta {meta_path}: not the ILSVRC2012 devkit meta.mat ({e!r})") from None
    if not mapping:
        raise UserError(f"--devkit-meta {meta_path}: no leaf synsets found; not the ILSVRC2012 devkit meta.mat")
    return mapping


def parse_devkit(path: Path, lines: List[str], meta_path: Optional[Path]) -> Dict[str, str]:
    if meta_path is None:
        raise UserError("--format devkit needs --devkit-meta path/to/ILSVRC2012_devkit_t12/data/meta.mat")
    id_to_wnid = load_devkit_meta(meta_path)
    gt = {}
    for k, line in enumerate(lines, 1):
        if not line.isdigit() or int(line) not in id_to_wnid:
            raise UserError(f"{path} line {k}: {line[:40]!r} is not an ILSVRC2012_ID listed in {meta_path}")
        gt[VAL_NAME.format(k)] = id_to_wnid[int(line)]
    return gt


def _add(gt: Dict[str, str], name: str, wnid: str, path: Path) -> None:
    if gt.get(name, wnid) != wnid:
        raise UserError(f"{path}: {name} is listed twice, as {gt[name]} and {wnid}; the ground truth is corrupt")
    gt[name] = wnid


def load_ground_truth(path: Path, fmt: str = "auto", devkit_meta: Optional[Path] = None) -> Dict[str, str]:
    """Image file name -> wnid, from any supported ground-truth file."""
    lines = _lines(path)
    if fmt == "auto":
        fmt = detect_format(path, lines, devkit_meta)
    if not lines:
        raise UserError(f"ground truth {path} is empty")
    if fmt == "kaggle":
        return parse_kaggle(path, lines)
    if fmt == "pairs":
        return parse_pairs(path, lines)
    if fmt == "wnids":
        return parse_wnids(path, lines)
    return parse_devkit(path, lines, devkit_meta)


def plan(val_dir: Path, gt: Dict[str, str]):
    """Split the ground truth into (to_do, already_sorted); UserError unless images and ground truth agree."""
    if not val_dir.is_dir():
        raise UserError(f"{val_dir}: no such folder; pass the folder holding the ILSVRC2012_val_*.JPEG images")
    flat = {p.name for p in val_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir()}
    todo, done, missing = [], [], []
    for name, wnid in sorted(gt.items()):
        if (val_dir / wnid / name).exists():
            done.append(name)  # sorted by an earlier (possibly interrupted) run
        elif name in flat:
            todo.append(name)
        else:
            missing.append(name)
    unassigned = flat - set(gt)
    if missing:
        raise UserError(
            f"{len(missing)} of {len(gt)} images in the ground truth are not in {val_dir} "
            f"({_examples(missing)}); is this the right folder and the right ground-truth file?"
        )
    if unassigned:
        raise UserError(
            f"{len(unassigned)} images in {val_dir} are not in the ground truth ({_examples(unassigned)}); "
            "is this the ImageNet 2012 val folder and the matching ground-truth file?"
        )
    return todo, done


def place(src: Path, dest: Path, mode: str) -> None:
    """Put one image into its class folder; copies go through a temp name so a crash leaves no half file."""
    if mode == "move":
        os.rename(src, dest)
    elif mode == "copy":
        tmp = dest.with_name(dest.name + ".part")
        shutil.copy2(src, tmp)
        os.replace(tmp, dest)
    else:
        # Relative link: the tree stays valid when the dataset folder is moved or mounted elsewhere.
        os.symlink(os.path.relpath(src, dest.parent), dest)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("val_dir", type=Path, help="the flat folder with the 50,000 ILSVRC2012_val_*.JPEG files")
    parser.add_argument("ground_truth", type=Path, help="ground-truth file (formats above)")
    parser.add_argument("--format", choices=("auto",) + FORMATS, default="auto", help="ground-truth format (default: detect)")
    parser.add_argument("--devkit-meta", type=Path, default=None, help="the devkit's data/meta.mat (for --format devkit)")
    parser.add_argument("--mode", choices=("move", "copy", "symlink"), default="move",
                        help="move the images (default), copy them, or leave them and link to them")
    parser.add_argument("--dry-run", action="store_true", help="check everything and say what would happen; change nothing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        gt = load_ground_truth(args.ground_truth, args.format, args.devkit_meta)
        todo, done = plan(args.val_dir, gt)
        n_classes = len(set(gt.values()))
        if not todo:
            print(f"{args.val_dir} is already sorted: {len(done)} images in {n_classes} class folders; nothing to do")
            return 0
        per_class = Counter(gt[name] for name in todo)
        verb = {"move": "move", "copy": "copy", "symlink": "link"}[args.mode]
        if args.dry_run:
            print(f"dry run: would {verb} {len(todo)} images into {len(per_class)} class folders of {args.val_dir} "
                  f"({len(done)} already in place, {n_classes} classes in all)")
            for name in todo[:SHOW]:
                print(f"  {name} -> {gt[name]}/{name}")
            return 0
        placed = 0
        try:
            for wnid in per_class:
                (args.val_dir / wnid).mkdir(exist_ok=True)
            for name in todo:
                place(args.val_dir / name, args.val_dir / gt[name] / name, args.mode)
                placed += 1
                if placed % 10000 == 0:
                    print(f"  {placed}/{len(todo)}", flush=True)
        except OSError as e:
            # Each placed image is complete, so a rerun picks up where this one stopped.
            raise UserError(f"{verb} failed after {placed} of {len(todo)} images ({e}); "
                            "fix the cause and rerun to finish") from None
        print(f"sorted {len(todo)} images into {len(per_class)} class folders of {args.val_dir} ({args.mode}); "
              f"{len(done)} were already in place, {len(todo) + len(done)} images in {n_classes} classes in all")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
