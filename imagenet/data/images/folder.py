"""ImageFolder datasets: the layout checks and the bad-file policy.

A dataset root holds ``train/`` and ``val/``, each with one folder per class (ImageFolder layout).
Layout mistakes are reported before any work starts, with the fix. An image that cannot be
read is skipped: the dataset hands back its path instead of pixels, the collate function drops
it and passes the path on, so the training loop can count skipped files per epoch even when
they were read in worker processes.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS

from ...base.errors import UserError
from ..transforms import set_output_size

logger = logging.getLogger(__name__)

VAL_PREP_HINT = ("sort it into class folders with: python scripts/prepare_imagenet_val.py "
                 "{val} LOC_val_solution.csv (or the devkit ground truth)")


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _class_dirs(split_dir: str) -> list:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def _has_image(class_dir: str) -> bool:
    for _root, _dirs, files in os.walk(class_dir, followlinks=True):
        if any(_is_image(f) for f in files):
            return True
    return False


def first_image_is_jpeg(root: str) -> Optional[bool]:
    """Whether ``root/train``'s first class folder holds JPEGs (its first image file, by name);
    None where there is nothing to look at (a layout the checks will report)."""
    try:
        classes = _class_dirs(os.path.join(root, "train"))
        for _dir, _subdirs, files in os.walk(os.path.join(root, "train", classes[0]), followlinks=True):
            for name in sorted(files):
                if _is_image(name):
                    return name.lower().endswith((".jpg", ".jpeg"))
    except (OSError, IndexError):
        pass
    return None


def check_layout(root: str) -> list:
    """Validate ``root/train`` and ``root/val``; return the class names. Raises UserError."""
    if not os.path.exists(root):
        raise UserError(f"dataset folder {root} does not exist; pass the folder that holds train/ and val/")
    if not os.path.isdir(root):
        raise UserError(f"dataset path {root} is a file, not a folder; pass the folder that holds train/ and val/")
    splits = {}
    for split in ("train", "val"):
        path = os.path.join(root, split)
        if not os.path.isdir(path):
            there = sorted(os.listdir(root))[:6]
            raise UserError(f"{path} is missing: the dataset folder must hold train/ and val/, each with "
                            f"one sub-folder per class (found: {', '.join(there) or 'nothing'})")
        splits[split] = path
    val = splits["val"]
    val_classes = _class_dirs(val)
    if not val_classes:
        flat = [f for f in os.listdir(val) if _is_image(f)]
        if flat:
            raise UserError(f"{val} holds {len(flat)} images directly, not in class folders (the official "
                            "flat ImageNet val set?); " + VAL_PREP_HINT.format(val=val))
        raise UserError(f"{val} has no class folders; it needs one sub-folder per class, like train/")
    train_classes = _class_dirs(splits["train"])
    if not train_classes:
        raise UserError(f"{splits['train']} has no class folders; it needs one sub-folder per class")
    for split, classes in (("train", train_classes), ("val", val_classes)):
        empty = [c for c in classes if not _has_image(os.path.join(splits[split], c))]
        if empty:
            more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
            raise UserError(f"{split}/ has class folders with no images: {', '.join(empty[:5])}{more}; "
                            f"add images or remove the folders (extensions read: {', '.join(IMG_EXTENSIONS)})")
    if train_classes != val_classes:
        only_t = sorted(set(train_classes) - set(val_classes))
        only_v = sorted(set(val_classes) - set(train_classes))
        parts = []
        if only_t:
            parts.append(f"only in train/: {', '.join(only_t[:5])}" + (" ..." if len(only_t) > 5 else ""))
        if only_v:
            parts.append(f"only in val/: {', '.join(only_v[:5])}" + (" ..." if len(only_v) > 5 else ""))
        raise UserError("train/ and val/ must have the same class folders, or labels would not match "
                        f"({'; '.join(parts)})")
    return train_classes


class SafeImageFolder(datasets.ImageFolder):
    """ImageFolder whose unreadable files come back as ``(None, target, path)`` instead of raising."""

    def find_classes(self, directory: str) -> tuple:
        # The same rule as check_layout: hidden folders (.ipynb_checkpoints, ...) are no classes,
        # or train and val labels could shift against each other.
        classes = _class_dirs(directory)
        return classes, {c: i for i, c in enumerate(classes)}

    def __getitem__(self, key):
        # (index, seed[, size]) keys come from SeededSampler: augmentations depend on the sample
        # and the epoch alone, not on which worker read it or what it read before; the size is
        # the epoch's training resolution under --progressive-resize.
        index, seed, size = (tuple(key) + (None,))[:3] if isinstance(key, tuple) else (key, None, None)
        if seed is not None:
            # The CPU generator is the only one a worker draws from; torch.manual_seed would also
            # seed every accelerator backend, 90x the time (140 us vs 1.5 us an image, 2-core machine).
            torch.default_generator.manual_seed(seed)
        if size is not None:
            set_output_size(self.transform, size)
        path, target = self.samples[index]
        try:
            image = self.loader(path)
            if self.transform is not None:
                image = self.transform(image)
        except Exception as e:  # any broken file must not end a multi-day run
            logger.debug("skipping unreadable image %s: %s", path, e)
            return None, target, path
        return image, target, None
