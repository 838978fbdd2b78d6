"""Crop, resize and flip a whole batch of decoded images in one kernel launch.

Used by ``--decode gpu`` (nvJPEG's CHW images) and by ``--decode cpu`` on a GPU (the workers'
HWC crops, :mod:`imagenet.data.images.cropbatch`). The decoded images (uint8, each its own size, CHW or
HWC) are laid end to end in one flat buffer; one small table per batch says, for each image,
where it starts, how its pixels are laid out, which region of it the output samples, at what
scale, and whether to flip. One Triton kernel then writes every output pixel
of the batch, rounded to uint8 NHWC (channels_last) as the training step takes it: a few
launches a batch (the concatenation, the table's copy, the kernel) instead of five per image.

The filter is PIL's antialiased bilinear (triangle) filter, computed exactly as torch's
``F.interpolate(mode="bilinear", antialias=True)`` computes it (tap range, weights, their
normalisation), in one 2-D pass over the taps where torch makes two 1-D passes: the two agree
up to float rounding, so after rounding to uint8 a pixel differs by at most one level, and both
equal PIL's resize within the same tolerance as the per-image path (tests). Rounding is half up
(torch's ``round`` is half to even: an exact .5 is where they can differ).

Without Triton (or on a CPU) :func:`available` is False and the per-image path runs instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; TRITON_INTERPRET=1 runs the kernel on a CPU
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None

# columns of the per-image table (int64); PIXEL, CHANNEL and LINE are the strides, in bytes, between
# neighbouring pixels of a row, between colour planes and between rows (CHW: 1, h*w and w; HWC: 3,
# 1 and 3*w, or a decoder's padded row pitch)
(SRC, HEIGHT, WIDTH, TOP, LEFT, REGION_H, REGION_W, OFF_Y, OFF_X, FLIP, ROW, TAPS_Y, TAPS_X, PIXEL,
 CHANNEL, LINE) = range(16)
COLUMNS = 16
BLOCK = 256  # output pixels per program


def available(device: torch.device) -> bool:
    """Whether the batched kernel can run on ``device``."""
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class Sampling:
    """Where one output image comes from: rows ``top..top+region_h`` and columns
    ``left..left+region_w`` of the decoded image (taps never leave that region), at ``scale_y``,
    ``scale_x`` input pixels per output pixel, the output's pixel (0, 0) sitting at (off_y,
    off_x) of the scaled region (a centre crop after a resize)."""

    top: int
    left: int
    region_h: int
    region_w: int
    scale_y: float
    scale_x: float
    off_y: int = 0
    off_x: int = 0

    @staticmethod
    def train(box: tuple, out: int) -> "Sampling":
        """RandomResizedCrop: the (top, left, height, width) box resized to out x out."""
        top, left, h, w = box
        return Sampling(top, left, h, w, h / out, w / out)

    @staticmethod
    def val(height: int, width: int, box: tuple) -> "Sampling":
        """Resize + CenterCrop: the image resized to (new_h, new_w), cropped at (top, left)."""
        top, left, new_h, new_w = box
        return Sampling(0, 0, height, width, height / new_h, width / new_w, top, left)


def taps(scale: float) -> int:
    """Most input pixels one output pixel reads along an axis at ``scale``: the filter's support
    is ``max(scale, 1)`` pixels either side of the centre (torch and PIL's bound)."""
    return int(math.ceil(2 * max(scale, 1.0))) + 1


def table(shapes: list, samplings: list, flips: list, rows: list, hwc: bool = False,
          pin: bool = False) -> tuple:
    """The kernel's table (int64 [n, COLUMNS]) and scales (float32 [n, 2]) for images of
    ``shapes`` ((height, width) each) laid end to end, CHW planes or (``hwc``) interleaved HWC pixels; ``pin``:
    in pinned memory, so they go to the device without a host wait."""
    rows_i, rows_f, offset = [], [], 0
    for (h, w), s, flip, row in zip(shapes, samplings, flips, rows):
        pixel, channel = (3, 1) if hwc else (1, h * w)
        rows_i.append([offset, h, w, s.top, s.left, s.region_h, s.region_w, s.off_y, s.off_x, int(flip), row,
                       taps(s.scale_y), taps(s.scale_x), pixel, channel, pixel * w])
        rows_f.append([s.scale_y, s.scale_x])
        offset += 3 * h * w
    ints = torch.tensor(rows_i, dtype=torch.int64).reshape(-1, COLUMNS)
    scales = torch.tensor(rows_f, dtype=torch.float32).reshape(-1, 2)
    return (ints.pin_memory(), scales.pin_memory()) if pin else (ints, scales)


def crop_resize_flip(images: list, samplings: list, flips: list, rows: list, out: torch.Tensor) -> torch.Tensor:
    """Write image k of ``images`` (CHW uint8 on the device), sampled as ``samplings[k]`` and
    flipped if ``flips[k]``, into ``out[rows[k]]`` (uint8 [batch, size, size, 3]); returns ``out``."""
    if not images:
        return out
    flat = torch.cat([img.reshape(-1) for img in images])
    ints, scales = table([img.shape[1:] for img in images], samplings, flips, rows,
                         pin=out.device.type == "cuda")
    return launch(flat, ints.to(out.device, non_blocking=True), scales.to(out.device, non_blocking=True), out)


def launch(flat: torch.Tensor, ints: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Run the kernel: every image the table (on ``out``'s device, as :func:`table` makes it)
    lists, read from ``flat`` (uint8, the images end to end), written into ``out`` (uint8
    [batch, size, size, 3]); returns ``out``."""
    size = out.shape[1]
    if len(ints):
        grid = (len(ints), triton.cdiv(size * size, BLOCK))
        _kernel[grid](flat, ints, scales, out, size, COLUMNS=COLUMNS, BLOCK=BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _axis(pos, off, scale, region, k):
        """Tap ``k`` of output coordinates ``pos`` along one axis: (input index in the region,
        unnormalised weight; 0 for taps past the filter's support)."""
        support = tl.maximum(scale, 1.0)
        center = (pos + off + 0.5) * scale
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0)
        hi = tl.minimum(tl.floor(center + support + 0.5), region * 1.0)
        idx = lo + k
        weight = tl.maximum(1.0 - tl.abs((idx - center + 0.5) / support), 0.0)
        weight = tl.where(idx < hi, weight, 0.0)
        return tl.minimum(idx, region - 1.0).to(tl.int64), weight

    @triton.jit
    def _kernel(src, ints, scales, dst, size, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
        image = tl.program_id(0)
        pixel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = pixel < size * size
        y = (pixel // size).to(tl.float32)
        x = (pixel % size).to(tl.float32)
        row_ptr = ints + image * COLUMNS
        base = tl.load(row_ptr + 0)
        top = tl.load(row_ptr + 3)
        left = tl.load(row_ptr + 4)
        region_h = tl.load(row_ptr + 5).to(tl.float32)
        region_w = tl.load(row_ptr + 6).to(tl.float32)
        off_y = tl.load(row_ptr + 7).to(tl.float32)
        off_x = tl.load(row_ptr + 8).to(tl.float32)
        flip = tl.load(row_ptr + 9)
        row = tl.load(row_ptr + 10)
        taps_y = tl.load(row_ptr + 11)
        taps_x = tl.load(row_ptr + 12)
        pixel_step = tl.load(row_ptr + 13)
        plane = tl.load(row_ptr + 14)
        line_step = tl.load(row_ptr + 15)
        scale_y = tl.load(scales + image * 2)
        scale_x = tl.load(scales + image * 2 + 1)
        # the weights' sums, for the normalisation (separable: the 2-D sum is their product)
        sum_y = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, taps_y):
            _, w = _axis(y, off_y, scale_y, region_h, k)
            sum_y += w
        sum_x = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, taps_x):
            _, w = _axis(x, off_x, scale_x, region_w, k)
            sum_x += w
        r = tl.zeros([BLOCK], dtype=tl.float32)
        g = tl.zeros([BLOCK], dtype=tl.float32)
        b = tl.zeros([BLOCK], dtype=tl.float32)
        for ky in range(0, taps_y):
            iy, wy = _axis(y, off_y, scale_y, region_h, ky)
            line = base + (top + iy) * line_step + left * pixel_step
            for kx in range(0, taps_x):
                ix, wx = _axis(x, off_x, scale_x, region_w, kx)
                w = wy * wx
                at = line + ix * pixel_step
                live = valid & (w > 0)
                r += w * tl.load(src + at, mask=live, other=0).to(tl.float32)
                g += w * tl.load(src + at + plane, mask=live, other=0).to(tl.float32)
                b += w * tl.load(src + at + 2 * plane, mask=live, other=0).to(tl.float32)
        norm = sum_y * sum_x
        norm = tl.where(norm > 0, norm, 1.0)  # pixels past the image's end: no taps, not stored
        out_x = tl.where(flip != 0, size - 1 - (pixel % size), pixel % size)
        at = ((row * size + pixel // size) * size + out_x) * 3
        tl.store(dst + at, _to_uint8(r / norm), mask=valid)
        tl.store(dst + at + 1, _to_uint8(g / norm), mask=valid)
        tl.store(dst + at + 2, _to_uint8(b / norm), mask=valid)

    @triton.jit
    def _to_uint8(v):
        return tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), 255.0).to(tl.uint8)
