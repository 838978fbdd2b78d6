"""``--decode cpu`` on a GPU: workers decode and crop, the GPU resizes and flips the batch.

On a CPU, resizing a RandomResizedCrop box to the training size costs a large share of a
worker's time (PIL: 1.22 ms against 1.34 ms for the decode, an image on the 2-core machine;
torch's uint8 kernel, which the workers use otherwise, about half of PIL's time).
Where the batched kernel of :mod:`imagenet.kernels.gpugeometry` can run, the workers stop after the
crop: each ships its region (uint8 HWC, at the DCT scale that keeps it at least the output
size, as the worker-side resize would have read it) and the flip it drew; the batch's crops
are laid end to end in one buffer with the kernel's table, built in the worker, so the
training process only pins, copies and launches one kernel a batch.

The pixels are PIL's resize of the same seeded crops and flips within one level (the kernel
computes PIL's antialiased bilinear filter, :mod:`imagenet.kernels.gpugeometry`).
Every file PIL reads takes this path, PNG and CMYK JPEG too; an unreadable one is skipped as
on any path. RandAugment and random erasing work on resized pixels, so recipes using them keep
the resize in the workers (:func:`imagenet.data.transforms.resize_on_device`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import get_worker_info

from ...kernels import gpugeometry
from ..decode import TrainDecoderReader, _to_tensor


@dataclass
class CpuCrop:
    """One training image as a worker leaves it: the crop region, not yet resized."""

    image: torch.Tensor  # uint8 HWC
    flip: bool
    out: int  # the output size the device resizes it to


class TrainCropReader(TrainDecoderReader):
    """Worker side: path -> :class:`CpuCrop`, drawing the crop and flip as ``TrainDecoder`` does."""

    def __call__(self, path: str) -> CpuCrop:
        with Image.open(path) as img:
            params, flip = self.cpu.draw(img)
            return CpuCrop(_to_tensor(self.cpu.crop(img, params)), flip, self.cpu.size)


@dataclass
class CropBatch:
    """A collated batch of crops: their pixels end to end and the kernel's table for them."""

    flat: torch.Tensor  # uint8: every crop's HWC pixels, one after the other
    ints: torch.Tensor  # int64 [n, gpugeometry.COLUMNS]
    scales: torch.Tensor  # float32 [n, 2]
    size: int

    @staticmethod
    def collate(crops: list) -> "CropBatch":
        """Runs in the worker: one buffer (in shared memory there, so it is not copied again on
        its way to the training process) and the table."""
        shapes = [c.image.shape[:2] for c in crops]
        flat = torch.empty(sum(c.image.numel() for c in crops), dtype=torch.uint8)
        if get_worker_info() is not None:
            flat.share_memory_()
        torch.cat([c.image.reshape(-1) for c in crops], out=flat)
        size = crops[0].out
        ints, scales = gpugeometry.table(shapes, [gpugeometry.Sampling.train((0, 0, h, w), size) for h, w in shapes],
                                         [c.flip for c in crops], range(len(crops)), hwc=True)
        return CropBatch(flat, ints, scales, size)

    def __len__(self) -> int:
        return len(self.ints)

    def pin_memory(self, device=None) -> "CropBatch":  # the DataLoader's pin-memory thread
        return CropBatch(self.flat.pin_memory(), self.ints.pin_memory(), self.scales.pin_memory(), self.size)

    def to_device(self, device: torch.device) -> torch.Tensor:
        """uint8 NHWC [n, size, size, 3] on ``device``: three copies and one kernel, no host wait."""
        out = torch.empty((len(self), self.size, self.size, 3), dtype=torch.uint8, device=device)
        return gpugeometry.launch(self.flat.to(device, non_blocking=True), self.ints.to(device, non_blocking=True),
                                  self.scales.to(device, non_blocking=True), out)
