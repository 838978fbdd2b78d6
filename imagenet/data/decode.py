"""Fast CPU image decoding: file -> cropped, resized uint8 HWC tensor, in one resize.

The crop box of RandomResizedCrop depends only on the image size, which the JPEG header gives
before any pixel is decoded. Knowing the box first lets libjpeg decode training images at 1/2,
1/4 or 1/8 scale (PIL's draft mode: the scaling happens inside the inverse DCT, almost for free)
whenever the crop would still be at least the output size, and the image is resized once.
Validation images are always decoded at full scale (see :class:`ValDecoder`). The output stays
uint8 (a quarter of float32's bytes through worker queues, pinned memory and the PCIe copy);
conversion and normalisation happen on the device (:mod:`imagenet.data.prefetch`).

The resize is torch's uint8 antialiased bilinear kernel, which computes PIL's filter with PIL's
fixed-point weights at 2-3x PIL's speed (0.39 vs 0.77 ms for a 300x270 crop to 224 px, one
core of the 2-core machine): the result is torchvision's Resize/CenterCrop (val), and without
draft mode its RandomResizedCrop/flip (train) on the same crop parameters, within one level, the
same in all but a few pixels in a thousand.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import RandomResizedCrop

_RATIO = (3.0 / 4.0, 4.0 / 3.0)


def path_identity(path: str) -> str:
    """ImageFolder loader that defers opening the file to the decoder."""
    return path


def _draft(img: Image.Image, max_factor: float) -> float:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale, at most ``max_factor`` smaller.

    Returns the factor by which coordinates of the full image shrink (1.0 when not reduced).
    """
    if img.format != "JPEG" or max_factor < 2:
        return 1.0
    scale = 2
    while scale < 8 and scale * 2 <= max_factor:
        scale *= 2
    w, h = img.size
    # PIL picks the largest DCT scale s with size // s >= the request, so ask with floor division.
    img.draft("RGB", (max(w // scale, 1), max(h // scale, 1)))
    return w / img.size[0]


def _to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8, copy=True))  # one copy, writable


def _resized(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 HWC -> uint8 HWC of (height, width), antialiased bilinear (PIL's filter)."""
    if tuple(image.shape[:2]) == (height, width):
        return image
    x = F.interpolate(image.permute(2, 0, 1)[None], size=(height, width), mode="bilinear", antialias=True,
                      align_corners=False)
    return x[0].permute(1, 2, 0).contiguous()


def _rgb(img: Image.Image) -> Image.Image:
    return img if img.mode == "RGB" else img.convert("RGB")


class TrainDecoder:
    """Path -> RandomResizedCrop(size, scale) + horizontal flip (+ a policy, + erasing), as uint8 HWC.

    ``augment``: a PIL -> PIL transform applied after the flip (RandAugment and friends);
    ``erase``: a transform on the uint8 CHW tensor (RandomErasing with the mean pixel as value).
    """

    def __init__(self, size: int, min_scale: float, hflip: float, draft: bool = True, augment=None, erase=None):
        self.size = size
        self.scale = (min_scale, 1.0)
        self.hflip = hflip
        self.draft = draft
        self.augment = augment
        self.erase = erase

    def crop_params(self, img: Image.Image) -> tuple:
        """(top, left, height, width) drawn from the torch RNG as torchvision draws them."""
        return RandomResizedCrop.get_params(img, list(self.scale), list(_RATIO))

    def draw(self, img: Image.Image) -> tuple:
        """(crop box, flip) for this image, from the torch RNG; reads only the header size."""
        params = self.crop_params(img)
        return params, self.hflip > 0 and torch.rand(1).item() < self.hflip

    def __call__(self, path: str) -> torch.Tensor:
        with Image.open(path) as img:
            return self.decode(img, *self.draw(img))

    def crop(self, img: Image.Image, params: tuple) -> Image.Image:
        """The RGB region of ``params`` (top, left, height, width in full-resolution pixels), at
        the smallest DCT scale that keeps it at least ``size`` px on its shorter side."""
        top, left, height, width = params
        f = _draft(img, min(width, height) / self.size) if self.draft else 1.0
        w, h = img.size
        box = (min(round(left / f), w - 1), min(round(top / f), h - 1),
               min(max(round((left + width) / f), 1), w), min(max(round((top + height) / f), 1), h))
        return _rgb(img).crop(box)

    def decode(self, img: Image.Image, params: tuple, flip: bool) -> torch.Tensor:
        out = _resized(_to_tensor(self.crop(img, params)), self.size, self.size)
        if flip:
            out = out.flip(1)
        if self.augment is not None:  # a PIL policy
            out = _to_tensor(self.augment(Image.fromarray(out.numpy())))
        if self.erase is not None:
            out = self.erase(out.permute(2, 0, 1)).permute(1, 2, 0).contiguous()
        return out


class TrainDecoderReader:
    """Base of the worker-side readers that leave part of the work to the device: they draw
    crops with a :class:`TrainDecoder` and share its output size (--progressive-resize sets it)."""

    def __init__(self, cpu_decoder: TrainDecoder):
        self.cpu = cpu_decoder

    @property
    def size(self) -> int:
        return self.cpu.size

    @size.setter
    def size(self, value: int) -> None:
        self.cpu.size = value


class ValDecoder:
    """Path -> Resize(shorter side = resize) + CenterCrop(size), as uint8 HWC.

    Always from the full-scale decode: a JPEG decoded at reduced DCT scale and then resized
    differs from torchvision's Resize by tens of levels (up to 56 on a 1601x1203 photo at
    224/256), and a validation score must be comparable with torchvision's."""

    def __init__(self, size: int, resize: int):
        self.size = size
        self.resize = resize

    def __call__(self, path: str) -> torch.Tensor:
        with Image.open(path) as img:
            return self.decode(img)

    def geometry(self, width: int, height: int) -> tuple:
        """(new_w, new_h, top, left): the resized size and the centre crop's corner in it."""
        # torchvision's Resize(int): the shorter side becomes `resize`, the other is truncated.
        if width <= height:
            new_w, new_h = self.resize, int(self.resize * height / width)
        else:
            new_w, new_h = int(self.resize * width / height), self.resize
        return new_w, new_h, int(round((new_h - self.size) / 2.0)), int(round((new_w - self.size) / 2.0))

    def decode(self, img: Image.Image) -> torch.Tensor:
        w, h = img.size
        new_w, new_h, top, left = self.geometry(w, h)
        out = _resized(_to_tensor(_rgb(img)), new_h, new_w)
        return out[top:top + self.size, left:left + self.size].contiguous()
