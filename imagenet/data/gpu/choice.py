"""``--decode auto`` (the default): decode JPEGs in the CPU workers or on the GPU, from what the
machine has.

:func:`choose` is a pure function of the recipe (the flags that need pixels in the workers, the
worker count) and the machine's facts (a CUDA device or not, CPU cores per GPU, GPUs one process
feeds, a GPU JPEG decoder here, whether the training images are JPEGs), so its table is tested
without either. The training layer's speed defaults (:mod:`imagenet.training.defaults`) gather
the facts once and call it; it returns the choice with its reason and the flag that changes it,
for the banner.

The rule: where each process trains one GPU (one GPU, DDP), the GPU decodes JPEGs whatever the
worker count: on an H200, with the decode stream on a hardware queue of its own
(:mod:`imagenet.base.processenv`), it fed ResNet-50's fastest step faster than the workers'
decode at every count measured, 2 to 15 (the figures: docs/INPUT.md). Under DataParallel one
process's decode thread feeds every GPU, so there the workers decode once at least
:data:`CPU_DECODE_CORES` of them would decode for each GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import jpeg as gpujpeg

CPU_DECODE_CORES = 12  # DataParallel: workers decoding for each GPU from which the workers decode
_MEASURED = "on an H200 the GPU decode fed the step faster than 2-15 decoding workers"


@dataclass(frozen=True)
class DecodeChoice:
    """Where JPEGs are decoded (``cpu`` | ``gpu``), why, and the flag that changes it."""

    decode: str
    why: str = ""
    flag: str = ""

    @property
    def what(self) -> str:
        """The choice in words, for the banner's default line."""
        where = "on the GPU (nvJPEG)" if self.decode == "gpu" else "in the CPU workers"
        return f"JPEGs decoded {where} (--decode auto)"


def gpu_decoder_available() -> bool:
    """Whether a JPEG decoder here decodes on CUDA devices (:mod:`imagenet.data.gpu.jpeg`:
    torchvision's nvJPEG op or TorchCodec, each tried on a small JPEG where a GPU is visible)."""
    return gpujpeg.gpu_capable(gpujpeg.find())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def choose(cfg, *, cuda: bool, cpus_per_gpu: int, gpus_per_process: int = 1,
           gpu_decoder: bool = False, jpeg: Optional[bool] = None) -> DecodeChoice:
    """``cfg.decode`` resolved: ``cpu`` and ``gpu`` stand as asked; ``auto`` decides by the rule in
    the module's docstring. ``cuda``: training on a CUDA device; ``cpus_per_gpu``: this machine's
    CPU cores over the GPUs training on it; ``gpus_per_process``: GPUs this process's workers feed
    (DataParallel: all of them); ``gpu_decoder``: :func:`gpu_decoder_available`; ``jpeg``:
    whether the training images are JPEGs (:func:`imagenet.data.probe.images_are_jpeg`, which
    asks a shard folder's index; None: not known, as for a URL or an older shard index, taken as
    JPEGs)."""
    if cfg.decode != "auto":
        return DecodeChoice(cfg.decode)
    if cfg.dummy:
        return DecodeChoice("cpu", "synthetic data (--dummy): nothing to decode")
    if cfg.data_pipeline == "classic":
        return DecodeChoice("cpu", "--data-pipeline classic decodes with torchvision's transforms in the workers",
                            "--data-pipeline fast can decode on the GPU")
    if cfg.auto_augment != "none" or cfg.random_erase > 0:
        return DecodeChoice("cpu", "--auto-augment and --random-erase work on decoded pixels in the workers",
                            "without them --decode gpu can decode on the GPU")
    if not cuda:
        return DecodeChoice("cpu", "no CUDA GPU here", "--decode cpu says the same")
    if not gpu_decoder:
        return DecodeChoice("cpu", "no GPU JPEG decoder here (nvJPEG in torchvision's CUDA builds, or TorchCodec)",
                            f"{gpujpeg.INSTALL}, then --decode gpu")
    if jpeg is False:
        what = "the built-in dataset is stored as PNGs" if not cfg.data else "the training images are not JPEGs"
        return DecodeChoice("cpu", f"{what}: nvJPEG decodes only JPEGs",
                            "--decode gpu still decodes any JPEGs on the GPU, the rest in the workers")
    share = f"{_plural(cfg.workers, 'worker')}, {_plural(cpus_per_gpu, 'CPU core')} per GPU"
    if gpus_per_process <= 1:
        return DecodeChoice("gpu", f"{share} ({_MEASURED})", "--decode cpu decodes in the workers")
    # DataParallel: one decode thread for every GPU, so many workers per GPU decode instead
    decoding = min(cfg.workers // gpus_per_process, cpus_per_gpu)
    dp = f"{share}, one process feeding {gpus_per_process} GPUs (DataParallel)"
    if decoding >= CPU_DECODE_CORES:
        return DecodeChoice("cpu", f"{dp}: {decoding} decoding for each GPU, where one decode thread would feed them "
                            "all", "--decode gpu decodes on the GPU")
    fix = "--decode cpu decodes in the workers"
    if cpus_per_gpu >= CPU_DECODE_CORES:
        fix = f"-j {CPU_DECODE_CORES * gpus_per_process} {fix}"
    return DecodeChoice("gpu", f"{dp}: {decoding} decoding for each GPU would hold the step back", fix)
