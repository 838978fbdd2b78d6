"""The datasets of a run and their loaders: which input format a path holds (an image folder or
tar shards, local or behind a URL), collation (with the skipped files), worker signals,
per-process batch sizes, and the device loaders that hand the training loop ready batches."""

from __future__ import annotations

import os
import signal
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets.folder import default_loader

from ..base.config import decode_share
from ..base.errors import UserError
from ..base.paths import default_cache_dir
from .gpu import jpeg as gpujpeg
from .images.cropbatch import CpuCrop, CropBatch, TrainCropReader
from .decode import TrainDecoder, ValDecoder, path_identity
from .images.folder import SafeImageFolder, check_layout
from .gpu.decode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, ValJpegReader
from .gpu.share import DecodeShare
from .prefetch import DeviceLoader, Normalize, is_uint8_batch
from .shards.remote import is_url, local_copy
from .samplers import BlockSampler, SeededSampler, ShardSampler, ShardWindowSampler
from .shards.index import ShardIndex, hold
from .shards.lease import Lease
from .shards.dataset import ShardDataset, find_shards, open_rgb
from .synthetic import SyntheticDataset, SyntheticLoader
from .transforms import (IMAGENET_MEAN, IMAGENET_STD, ValGeometry, augment_policy, resize_on_device, train_transform,
                         val_geometry, val_transform)

PREFETCH = 2  # batches each worker has under way (torch's default), which --decode-share's look waits out


def collate_skipping(batch: Sequence) -> tuple:
    """Stack the good samples; return ``(images, targets, skipped_paths)``."""
    good = [(img, t) for img, t, _ in batch if img is not None]
    skipped = [p for img, _, p in batch if img is None]
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    if isinstance(good[0][0], (JpegJob, CpuDecoded)):  # --decode gpu: the device decodes them
        images = JpegBatch.collate([g[0] for g in good], [g[1] for g in good])
        return images, images.targets, skipped  # the targets travel in the batch's one buffer
    if isinstance(good[0][0], CpuCrop):  # --decode cpu on a GPU: the device resizes them
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


@dataclass
class DataBundle:
    """What the rest of the run needs to know about the data."""

    train: Dataset
    val: Dataset
    classes: list
    root: str  # where the images are ("synthetic" for --dummy)
    pipeline: str = ""  # how training images are made, for the banner
    layout: str = ""  # the input format when not an image folder, for the banner
    jpeg_decoder: Optional[gpujpeg.JpegDecoder] = None  # what decodes on the GPU (--decode gpu)
    decode_share: Optional[DecodeShare] = None  # the workers' share of the training JPEGs (--decode gpu)
    lease: Optional[Lease] = None  # on the shards' version (a URL's cached copy, the index's generation) read

    def close(self) -> None:
        """Release what reading the data holds: open shard files, the shards' lease. The
        run's owner calls it at the end (``with`` does); the workers' files go with them."""
        for dataset in (self.train, self.val):
            if isinstance(dataset, ShardDataset):
                dataset.close()
        if self.lease is not None:
            self.lease.close()

    def __enter__(self) -> "DataBundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    shards, lease = _shard_index(cfg, root)
    try:
        return _build(cfg, root, val_geo, device, shards, lease)
    except BaseException:
        if lease is not None:
            lease.close()
        raise


def _build(cfg, root: str, val_geo: ValGeometry, device, shards: Optional[ShardIndex], lease) -> DataBundle:
    classes = shards.classes if shards is not None else check_layout(root)
    decoder = share = None
    if cfg.data_pipeline == "fast":
        # On uint8 pixels the mean colour is what erasing with 0 after normalisation gives.
        erase = (transforms.RandomErasing(cfg.random_erase, value=[round(255 * m) for m in IMAGENET_MEAN])
                 if cfg.random_erase > 0 else None)
        train_tf = TrainDecoder(cfg.image_size, cfg.min_crop_scale, cfg.hflip, draft=not cfg.no_jpeg_draft,
                                augment=augment_policy(cfg.auto_augment), erase=erase)
        val_tf, loader = ValDecoder(val_geo.crop, val_geo.resize), path_identity  # never a reduced-scale decode
        pipeline = "fast: workers decode, crop, resize and flip"
        if cfg.decode == "gpu":  # workers read bytes and draw crops; the GPU decodes
            # a change of the share reaches the batches after those the workers have under way
            decoder, share = gpujpeg.require(), DecodeShare(decode_share(cfg), lag=PREFETCH * cfg.workers)
            train_tf, val_tf = TrainJpegReader(train_tf, share), ValJpegReader(val_tf)
            pipeline = (f"fast, --decode gpu: workers read files, the GPU decodes ({gpujpeg.describe(decoder)}), "
                        "one kernel crops, resizes and flips")
        elif resize_on_device(cfg, device):  # workers decode and crop; the GPU resizes and flips
            train_tf = TrainCropReader(train_tf)
            pipeline = "fast: workers decode and crop, one kernel on the GPU resizes and flips each batch"
    else:
        train_tf = train_transform(cfg.image_size, cfg.min_crop_scale, cfg.hflip, cfg.auto_augment, cfg.random_erase)
        val_tf, loader = val_transform(val_geo.crop, val_geo.resize), default_loader
        pipeline = "classic: torchvision's transforms in the workers"
    if shards is not None:
        # the fast decoders open the sample's bytes as they open a path
        loader = path_identity if loader is path_identity else open_rgb
        train = ShardDataset(shards.splits["train"], train_tf, loader)
        val = ShardDataset(shards.splits["val"], val_tf, loader)
        left_out = len(train.split.left_out) + len(val.split.left_out)
        layout = (f"tar shards ({train.split.samples} train / {val.split.samples} val in {shards.shard_count} shards"
                  + (f"; {left_out} unreadable image(s) left out when converted, counted as skipped" if left_out else "")
                  + ")")
        return DataBundle(train, val, classes, root, pipeline, layout, decoder, share, lease=lease)
    train = SafeImageFolder(os.path.join(root, "train"), train_tf, loader=loader)
    val = SafeImageFolder(os.path.join(root, "val"), val_tf, loader=loader)
    return DataBundle(train, val, classes, root, pipeline, jpeg_decoder=decoder, decode_share=share)


def _shard_index(cfg, root: str) -> tuple:
    """(the index, the lease on its generation) when ``root`` is a shard folder; (the index of its
    cached copy, the copy's lease) for a URL; (None, None) for an image folder. A lease keeps
    ``make_shards`` (a rebuild of the folder) or a newer copy from removing the files the run reads."""
    if not is_url(root):
        index = find_shards(root)
        return index, (hold(index) if index is not None else None)
    lease = local_copy(root, cfg.cache_dir or default_cache_dir())
    try:
        return find_shards(lease.path), lease
    except BaseException:
        lease.close()
        raise


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
    if isinstance(data.train, ShardDataset):
        train_sampler = ShardWindowSampler(data.train.shard_of_rows, data.train.image_ids, world, rank, seed,
                                           cfg.shuffle_window)
        # a rank reads ~1/world of the val shards; in the folder's order, the images left out included
        val_sampler = BlockSampler(len(data.val), rank, world, order=np.argsort(data.val.image_ids, kind="stable"))
    else:
        train_sampler = SeededSampler(data.train, world, rank, seed)
        val_sampler = ShardSampler(len(data.val), rank, world)
    # torch warns when -j is above the CPU cores this process may use, once for each loader built
    # and each time one starts its workers; the banner says it once, with the flag.
    warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes in total",
                            category=UserWarning)
    common = dict(num_workers=cfg.workers, prefetch_factor=PREFETCH if cfg.workers > 0 else None,
                  pin_memory=ctx.device.type == "cuda",
                  collate_fn=collate_for(ctx.device), persistent_workers=cfg.workers > 0,
                  worker_init_fn=worker_signals if cfg.workers > 0 else None)
    # Dropping the last partial batch keeps every step's batch (and its BatchNorm statistics)
    # full-sized and the same on every rank.
    train_loader = DataLoader(data.train, batch_size=batch, sampler=train_sampler, drop_last=True, **common)
    val_loader = DataLoader(data.val, batch_size=batch, sampler=val_sampler, drop_last=False, **common)
    return tuple(DeviceLoader(loader, ctx.device, cfg.channels_last, IMAGENET_MEAN, IMAGENET_STD,
                              background=cfg.decode == "gpu", decoder=data.jpeg_decoder, share=share)
                 for loader, share in ((train_loader, data.decode_share), (val_loader, None)))
