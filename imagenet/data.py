"""Datasets, transforms, samplers and loaders; the layout checks and the bad-file policy.

A dataset root holds ``train/`` and ``val/``, each with one folder per class (ImageFolder layout).
Layout mistakes are reported before any work starts, with the fix. An image that cannot be
read is skipped: the collate function drops it and hands its path on, so the training loop can
count skipped files per epoch even when they were read in worker processes.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

from . import gpugeometry
from .cropbatch import CpuCrop, CropBatch, TrainCropReader
from .decode import TrainDecoder, TrainDecoderReader, ValDecoder, path_identity
from .gpudecode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, ValJpegReader
from .config import DEFAULT_VAL_RESIZE
from .errors import UserError
from .prefetch import DeviceLoader, Normalize, is_uint8_batch

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
VAL_PREP_HINT = ("sort it into class folders with: python scripts/prepare_imagenet_val.py "
                 "{val} --ground-truth LOC_val_solution.csv (or the devkit ground truth)")


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _class_dirs(split_dir: str) -> list:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def _has_image(class_dir: str) -> bool:
    for _root, _dirs, files in os.walk(class_dir, followlinks=True):
        if any(_is_image(f) for f in files):
            return True
    return False


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


class SyntheticDataset(Dataset):
    """``--dummy``: ``size`` images of one shape, labels cycling through the classes (one random
    normalised image per class, at most 64 distinct). No files and no workers: the loaders
    make their batches once, on the training device (:class:`SyntheticLoader`)."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0):
        self.size = size
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def batch(self, n: int, device: torch.device, channels_last: bool) -> tuple:
        """Images and labels of samples 0..n-1, on ``device``."""
        g = torch.Generator().manual_seed(self.seed)
        protos = torch.randn(min(self.num_classes, 64), 3, self.image_size, self.image_size, generator=g)
        index = torch.arange(n)
        images = protos[index % len(protos)].to(device)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, (index % self.num_classes).to(device)


class SyntheticLoader:
    """``--dummy``'s loader: one batch made on the device at start-up, handed out every step.

    A rank's epoch has as many steps as the file loaders would give it (the same sampler
    arithmetic), so ``--dummy`` runs the real loop, and measures the model alone: nothing is
    decoded, collated or copied per step.
    """

    def __init__(self, dataset: SyntheticDataset, *, batch: int, samples: int, drop_last: bool,
                 device: torch.device, channels_last: bool):
        self.batch_size = batch
        self.batches = samples // batch if drop_last else -(-samples // batch)
        self.last = batch if drop_last else samples - (self.batches - 1) * batch
        self.images, self.targets = dataset.batch(min(batch, samples) or 1, device, channels_last)
        self.sampler = self  # the runner's per-epoch calls (set_epoch, set_start) land here;
        #                      --progressive-resize, its only set_image_size caller, refuses --dummy
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.start = 0

    def set_start(self, samples_done: int) -> None:
        self.start = samples_done // self.batch_size

    def decode_counts(self) -> dict:
        return {"gpu": 0, "cpu": 0}

    def __len__(self) -> int:
        return max(self.batches - self.start, 0)

    def __iter__(self):
        for i in range(self.start, self.batches):
            n = self.batch_size if i < self.batches - 1 else self.last
            if n == len(self.targets):
                yield self.images, self.targets, []
            else:  # validation's last, partial batch
                yield self.images[:n], self.targets[:n], []


def collate_skipping(batch: Sequence) -> tuple:
    """Stack the good samples; return ``(images, targets, skipped_paths)``."""
    good = [(img, t) for img, t, _ in batch if img is not None]
    skipped = [p for img, _, p in batch if img is None]
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    if isinstance(good[0][0], (JpegJob, CpuDecoded)):  # --decode gpu: the device decodes them
        images = JpegBatch([g[0] for g in good])
    elif isinstance(good[0][0], CpuCrop):  # --decode cpu on a GPU: the device resizes them
        images = CropBatch.collate([g[0] for g in good])
    else:
        images = torch.stack([g[0] for g in good])
    targets = torch.tensor([g[1] for g in good], dtype=torch.long)
    return images, targets, skipped


class CollateNormalized:
    """:func:`collate_skipping`, then the fast pipeline's uint8 batch normalised to float, in the
    worker. Training on a CPU, the device is the host: the conversion would otherwise run in the
    training process, beside the workers, on the same cores."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.normalize = Normalize(mean, std)

    def __call__(self, batch: Sequence) -> tuple:
        images, targets, skipped = collate_skipping(batch)
        return (self.normalize(images) if is_uint8_batch(images) else images), targets, skipped


def collate_for(device: torch.device):
    """The collate function of loaders feeding ``device``."""
    return CollateNormalized(IMAGENET_MEAN, IMAGENET_STD) if device.type == "cpu" else collate_skipping


class SeededSampler(Sampler):
    """A rank's shuffled share of an epoch, as ``(index, augmentation_seed)`` pairs.

    Shuffling is DistributedSampler's (a world of one is a single process, so every launch mode
    sees the same global batches), without padding. The per-sample seed is a function of
    (seed, epoch, index): a run resumed in the middle of an epoch (``set_start``) draws the same
    crops and flips as one that never stopped, whatever the worker count.
    """

    def __init__(self, dataset, world_size: int, rank: int, seed: int):
        self.inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                        drop_last=True)
        self.seed = seed
        self.epoch = 0
        self.start = 0
        self.image_size: Optional[int] = None  # set per epoch under --progressive-resize

    def set_image_size(self, size: Optional[int]) -> None:
        """Ask the dataset for ``size`` px training crops (travels with every key to the workers)."""
        self.image_size = size

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)
        self.epoch = epoch
        self.start = 0

    def set_start(self, samples_done: int) -> None:
        """Skip the first ``samples_done`` samples of this rank's share of the epoch."""
        self.start = samples_done

    def __iter__(self):
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        for idx in list(self.inner)[self.start:]:
            if self.image_size is None:
                yield idx, (base + idx) % (2 ** 63)
            else:
                yield idx, (base + idx) % (2 ** 63), self.image_size

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


class ShardSampler(Sampler):
    """Rank ``r`` of ``w`` gets indices r, r+w, r+2w, ...: every sample exactly once, no padding."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = list(range(rank, length, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def set_output_size(transform, size: int) -> None:
    """Make a training transform (the fast decoder or torchvision's Compose) crop to ``size`` px."""
    if isinstance(transform, (TrainDecoder, TrainDecoderReader)):
        transform.size = size
        return
    for t in getattr(transform, "transforms", ()):
        if isinstance(t, transforms.RandomResizedCrop):
            t.size = (size, size)


def image_size_at(epoch: int, cfg) -> int:
    """The training crop of ``epoch``: --image-size, or under --progressive-resize MIN a linear ramp
    from MIN (until the ramp's first epoch) to --image-size (from its last), in steps of 8 px."""
    start = cfg.progressive_resize
    if not start:
        return cfg.image_size
    first, last = progressive_ramp(cfg)
    if epoch <= first:
        return start
    if epoch >= last:
        return cfg.image_size
    size = start + (cfg.image_size - start) * (epoch - first) / (last - first)
    return max(start, int(size // 8 * 8))


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


@dataclass
class DataBundle:
    """What the rest of the run needs to know about the data."""

    train: Dataset
    val: Dataset
    classes: list
    root: str  # where the images are ("synthetic" for --dummy)
    pipeline: str = ""  # how training images are made, for the banner


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
    transforms the resized pixels in the workers (--auto-augment, --random-erase)."""
    return (device is not None and gpugeometry.available(device) and cfg.data_pipeline == "fast"
            and cfg.decode == "cpu" and cfg.auto_augment == "none" and cfg.random_erase == 0)


def build_datasets(cfg, root: Optional[str], val: Optional[ValGeometry] = None,
                   device: Optional[torch.device] = None) -> DataBundle:
    """Datasets for ``root`` (already resolved: the user's DIR or the built-in export);
    validation as ``val`` says (default: :func:`val_geometry` of the flags); ``device``: the
    training device, where ``--decode cpu`` resizes if it can (:func:`resize_on_device`)."""
    val_geo = val or val_geometry(cfg)
    if cfg.dummy:
        n = cfg.dummy_classes
        return DataBundle(SyntheticDataset(cfg.dummy_train_size, n, cfg.image_size, seed=1),
                          SyntheticDataset(cfg.dummy_val_size, n, val_geo.crop, seed=2),
                          [str(i) for i in range(n)], "synthetic", "one synthetic batch made on the device")
    classes = check_layout(root)
    if cfg.data_pipeline == "fast":
        draft = not cfg.no_jpeg_draft
        # On uint8 pixels the mean colour is what erasing with 0 after normalisation gives.
        erase = (transforms.RandomErasing(cfg.random_erase, value=[round(255 * m) for m in IMAGENET_MEAN])
                 if cfg.random_erase > 0 else None)
        train_tf = TrainDecoder(cfg.image_size, cfg.min_crop_scale, cfg.hflip, draft=draft,
                                augment=augment_policy(cfg.auto_augment), erase=erase)
        val_tf, loader = ValDecoder(val_geo.crop, val_geo.resize, draft=draft), path_identity
        pipeline = "fast: workers decode, crop, resize and flip"
        if cfg.decode == "gpu":  # workers read bytes and draw crops; the GPU decodes
            train_tf, val_tf = TrainJpegReader(train_tf), ValJpegReader(val_tf)
            pipeline = "fast, --decode gpu: workers read files, nvJPEG decodes, one kernel crops, resizes and flips"
        elif resize_on_device(cfg, device):  # workers decode and crop; the GPU resizes and flips
            train_tf = TrainCropReader(train_tf)
            pipeline = "fast: workers decode and crop, one kernel on the GPU resizes and flips each batch"
    else:
        train_tf = train_transform(cfg.image_size, cfg.min_crop_scale, cfg.hflip, cfg.auto_augment, cfg.random_erase)
        val_tf, loader = val_transform(val_geo.crop, val_geo.resize), default_loader
        pipeline = "classic: torchvision's transforms in the workers"
    train = SafeImageFolder(os.path.join(root, "train"), train_tf, loader=loader)
    val = SafeImageFolder(os.path.join(root, "val"), val_tf, loader=loader)
    return DataBundle(train, val, classes, root, pipeline)


WORKER_TERM_GRACE = 90  # seconds a worker lives on after SIGTERM; the trainer's stop takes < 60


def _term_later(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough
    signal.alarm(WORKER_TERM_GRACE)  # SIGALRM's default action ends the process


def worker_signals(worker_id: int) -> None:
    """Workers leave Ctrl-C and SIGTERM to the training process, which stops them after writing
    its checkpoint. A terminal sends Ctrl-C, and a scheduler (SLURM) SIGTERM, to every process of
    the job: a worker that died of it would make the DataLoader raise in the middle of the last
    step. SIGTERM only arms a timer, so a worker the DataLoader has to end (one that hangs) still
    ends, WORKER_TERM_GRACE seconds later (SIGALRM's default action: a handler the training process
    had, pytest-timeout's in the tests, is not inherited for it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _term_later)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # SLURM's --signal=USR1@T reaches them too


def per_process_batch(batch_size: int, ctx) -> int:
    """``-b`` is global: each DDP rank takes its share (DataParallel splits inside the model)."""
    if ctx.distributed:
        if batch_size % ctx.world_size:
            raise UserError(f"-b/--batch-size {batch_size} is the global batch and must divide evenly "
                            f"over {ctx.world_size} processes; use a multiple of {ctx.world_size}")
        return batch_size // ctx.world_size
    return batch_size


def micro_batch_size(cfg, ctx) -> int:
    """Images per forward pass in one process: the process's share of ``-b``, split over
    ``--accum-steps`` gradient-accumulation passes."""
    per_process = per_process_batch(cfg.batch_size, ctx)
    accum = cfg.accum_steps
    if per_process % accum:
        share = f"each of {ctx.world_size} processes takes {per_process}" if ctx.distributed else f"-b {per_process}"
        raise UserError(f"--accum-steps {accum} must divide the batch of each process ({share}): each forward "
                        f"pass takes an equal part; use -b {per_process // accum * accum * (ctx.world_size if ctx.distributed else 1)} "
                        f"or another --accum-steps")
    return per_process // accum


def build_loaders(cfg, data: DataBundle, ctx, seed: int) -> tuple:
    """(train_loader, val_loader) yielding device-ready batches; ``train_loader.sampler.set_epoch``
    reshuffles per epoch."""
    batch = micro_batch_size(cfg, ctx)
    n_train = len(data.train)
    # One shuffling scheme for every mode (a single process is a world of one), so a DDP run's
    # global batches hold the same images as a single-process run with the same seed.
    world, rank = (ctx.world_size, ctx.rank) if ctx.distributed else (1, 0)
    step_images = batch * cfg.accum_steps
    if n_train // world < step_images:
        raise UserError(f"the training set has {n_train} images, fewer than one batch of {step_images} per "
                        f"process; lower -b/--batch-size (now {cfg.batch_size})")
    # No padding with repeated images: a DDP epoch has as many global steps as a single-process
    # epoch of the same global batch. Augmentations are seeded per sample (SeededSampler), so
    # workers may live across epochs and resume stays exact.
    if isinstance(data.train, SyntheticDataset):
        per_rank = dict(device=ctx.device, channels_last=cfg.channels_last, batch=batch)
        return (SyntheticLoader(data.train, samples=n_train // world, drop_last=True, **per_rank),
                SyntheticLoader(data.val, samples=len(range(rank, len(data.val), world)), drop_last=False,
                                **per_rank))
    train_sampler = SeededSampler(data.train, world, rank, seed)
    common = dict(num_workers=cfg.workers, pin_memory=ctx.device.type == "cuda",
                  collate_fn=collate_for(ctx.device), persistent_workers=cfg.workers > 0,
                  worker_init_fn=worker_signals if cfg.workers > 0 else None)
    # Dropping the last partial batch keeps every step's batch (and its BatchNorm statistics)
    # full-sized and the same on every rank.
    train_loader = DataLoader(data.train, batch_size=batch, sampler=train_sampler, drop_last=True, **common)
    val_sampler = ShardSampler(len(data.val), rank, world)
    val_loader = DataLoader(data.val, batch_size=batch, sampler=val_sampler, drop_last=False, **common)
    return tuple(DeviceLoader(loader, ctx.device, cfg.channels_last, IMAGENET_MEAN, IMAGENET_STD,
                              background=cfg.decode == "gpu")
                 for loader in (train_loader, val_loader))
