"""What a training or validation image becomes: the crop and resize geometry, torchvision's
classic transforms, the augmentation policies, and the crop size of each epoch under
``--progressive-resize``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchvision import transforms

from ..base.config import DEFAULT_VAL_RESIZE
from ..base.errors import UserError
from ..kernels import gpugeometry
from .decode import TrainDecoder, TrainDecoderReader

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def set_output_size(transform, size: int) -> None:
    """Make a training transform (the fast decoder or torchvision's Compose) crop to ``size`` px."""
    if isinstance(transform, (TrainDecoder, TrainDecoderReader)):
        transform.size = size
        return
    for t in getattr(transform, "transforms", ()):
        if isinstance(t, transforms.RandomResizedCrop):
            t.size = (size, size)


def image_size_at(epoch: int, cfg) -> int:
    """The training crop of ``epoch``: --image-size, or under --progressive-resize MIN: MIN until
    the ramp's first epoch, --image-size from its last, and between them the straight line from
    one to the other rounded to the nearest multiple of --progressive-step px (kept within
    [MIN, --image-size]). The line and the rounding are FFCV's (``np.interp``, then ``np.round``,
    which rounds halves to even, as Python's ``round`` does), so its recipes' ramps give its sizes."""
    start = cfg.progressive_resize
    if not start:
        return cfg.image_size
    first, last = progressive_ramp(cfg)
    if epoch <= first:
        return start
    if epoch >= last:
        return cfg.image_size
    slope = (cfg.image_size - start) / (last - first)
    size = slope * (epoch - first) + start  # in np.interp's order of operations: the same float
    step = cfg.progressive_step
    return min(max(int(round(size / step)) * step, start), cfg.image_size)


def training_sizes(cfg) -> list:
    """Every training crop size of the run, smallest first (one per compiled training graph)."""
    return sorted({image_size_at(epoch, cfg) for epoch in range(cfg.epochs)})


def progressive_ramp(cfg) -> tuple:
    """(first, last) epoch of the --progressive-resize ramp; default from 0 to 3/4 of --epochs."""
    if cfg.progressive_ramp:
        first, last = (int(x) for x in cfg.progressive_ramp.split(":"))
        return first, last
    return 0, max(1, round(0.75 * cfg.epochs))


def augment_policy(name: str):
    """torchvision's learned/random augmentation policies, on PIL images (None for 'none')."""
    return {"none": None, "randaugment": transforms.RandAugment, "trivialaugment": transforms.TrivialAugmentWide,
            "autoaugment": transforms.AutoAugment}[name]() if name != "none" else None


def train_transform(image_size: int, min_scale: float, hflip: float, policy: str = "none", erase: float = 0.0):
    steps = [transforms.RandomResizedCrop(image_size, scale=(min_scale, 1.0))]
    if hflip > 0:
        steps.append(transforms.RandomHorizontalFlip(hflip))
    if policy != "none":
        steps.append(augment_policy(policy))
    steps += [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if erase > 0:
        steps.append(transforms.RandomErasing(erase, value=0))  # 0 after Normalize: the mean colour
    return transforms.Compose(steps)


def val_transform(image_size: int, resize: int):
    return transforms.Compose([
        transforms.Resize(resize),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


@dataclass(frozen=True)
class ValGeometry:
    """Validation images: shorter side resized to ``resize`` (bilinear, antialiased), centre crop."""

    resize: int
    crop: int
    source: str = ""  # set when pretrained weights chose the resize: for the banner


def val_geometry(cfg, weights=None) -> ValGeometry:
    """The crop is ``--val-crop``, else ``--image-size``; the resize ``--val-resize``, else that of
    the ``--pretrained`` ``weights``' evaluation transform (anything with ``name``, ``resize`` and
    ``crop``: 232 for 224 px crops with torchvision's V2 weights, so their published accuracy is
    reproducible; at another crop the same ratio), else the classic 256."""
    resize, crop = cfg.val_resize, cfg.val_crop or cfg.image_size
    source = ""
    if resize is None and weights is not None:
        resize = round(weights.resize * crop / weights.crop)
        source = (f"{weights.name}'s own evaluation resize" if crop == weights.crop else
                  f"{weights.name}'s evaluation ratio {weights.resize}/{weights.crop} at this crop")
    resize = resize or DEFAULT_VAL_RESIZE
    if resize < crop:
        raise UserError(f"validation would resize to {resize} px and crop {crop} px; the resize must be at least "
                        "the crop: give --val-resize")
    return ValGeometry(resize, crop, source)


def resize_on_device(cfg, device: Optional[torch.device]) -> bool:
    """Whether ``--decode cpu``'s workers stop after the crop and ``device`` resizes and flips
    the batch (:mod:`imagenet.cropbatch`): on a GPU with the batched kernel, unless a recipe
    transforms the resized pixels in the workers (--auto-augment, --random-erase). A config whose
    ``--decode auto`` was not resolved decodes in the workers, as :func:`build_datasets` builds it."""
    return (device is not None and gpugeometry.available(device) and cfg.data_pipeline == "fast"
            and cfg.decode != "gpu" and cfg.auto_augment == "none" and cfg.random_erase == 0)
