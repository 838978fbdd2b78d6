"""Typed configuration: defaults < YAML recipe (--config) < command line, then validation.

Every option is a command-line flag (kebab-case) and a YAML key (the same name with dashes or
underscores). Unknown keys, wrong types and impossible values raise :class:`UserError` with a
one-line message; the resolved config is written next to the checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Optional

import yaml

from .errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_VAL_RESIZE = 256  # the reference script's validation resize (shorter side, pixels)
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")  # torch.compile's modes (and off)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that replay the step as CUDA graphs
LR_SCHEDULES = ("step", "cosine", "triangular", "poly")  # imagenet/training/schedule.py
MAXPOOL_KERNELS = ("auto", "torch", "triton")  # --maxpool-kernel (imagenet/kernels/maxpool.py)
BN_KERNELS = ("auto", "torch", "triton", "cudnn")  # --bn-kernel (imagenet/kernels/fusedbn.py, convstats.py)
ARCHS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
)


@dataclass
class Config:
    """All options of a run. Units are given where they are not obvious."""

    # -- data -------------------------------------------------------------------------------
    data: Optional[str] = None  # ImageFolder root with train/ and val/, a tar shard folder (scripts/make_shards.py)
    #                             or its URL; None: built-in MNIST-5k
    workers: int = 4  # data-loading processes per training process
    image_size: int = 224  # training crop (and validation crop unless --val-crop), pixels
    val_resize: Optional[int] = None  # validation images are resized to this (shorter side), then center-cropped;
    #                                    default 256, or with --pretrained the weights' own (232 for V2 weights)
    val_crop: Optional[int] = None  # validation crop if not --image-size: train low-res, test at 224
    val_flip: bool = False  # validation averages the logits of each image and its left-right mirror
    progressive_resize: Optional[int] = None  # train at this many px first, growing to --image-size
    progressive_ramp: Optional[str] = None  # "FIRST:LAST" epochs of that growth (default 0:3/4 of --epochs)
    progressive_step: int = 32  # px the ramp's sizes are rounded to (each size compiles once under --compile)
    min_crop_scale: float = 0.08  # RandomResizedCrop's lower area bound (fraction of the image)
    hflip: float = 0.5  # probability of a horizontal flip in training
    auto_augment: str = "none"  # none | randaugment | trivialaugment | autoaugment (torchvision's)
    random_erase: float = 0.0  # probability of RandomErasing a rectangle of a training image
    data_pipeline: str = "fast"  # fast: uint8 decode+crop in workers, normalise on the device;
    #                              classic: torchvision's PIL transforms to float in workers
    no_jpeg_draft: bool = False  # fast pipeline: decode training JPEGs at full scale too (validation always is)
    decode: str = "auto"  # cpu: workers decode; gpu: workers read bytes, nvJPEG decodes batches on the GPU;
    #                      auto (default): gpu where too few CPU cores per GPU would decode
    #                      JPEGs (imagenet/training/defaults.py)
    decode_share: str = "auto"  # --decode gpu: the training JPEGs the workers decode instead: auto (steered
    #                             by the decode thread's load, imagenet/data/gpu/share.py) or a fraction
    dummy: bool = False  # synthetic data of the right shape instead of files
    dummy_train_size: int = 1281167  # synthetic training images per epoch (ImageNet's count)
    dummy_val_size: int = 50000
    dummy_classes: int = 1000
    shuffle_window: int = 65536  # tar shards: images whose order is shuffled together (whole shards, shuffled);
    #                              at least the training set: a full shuffle, the order of a folder run
    cache_dir: Optional[str] = None  # where the built-in dataset is exported and shards behind a URL are copied
    max_bad_fraction: float = 0.01  # the largest share of an epoch's images that may be unreadable; more stops

    # -- model ------------------------------------------------------------------------------
    arch: str = "resnet18"
    small_stem: bool = False  # 3x3 stride-1 first conv and no max-pool, for low-resolution images
    blurpool: bool = False  # a 3x3 binomial blur before each strided convolution of >= 16 input channels (FFCV's)
    pretrained: Optional[str] = None  # torchvision ImageNet weights by name (DEFAULT, IMAGENET1K_V1, ...), from
    #                                   the local torch hub cache only; --pretrained alone: DEFAULT
    weights: Optional[str] = None  # a state dict or one of our checkpoints to start from
    # The four speed settings default to auto: the fastest safe choice for the machine
    # (imagenet/training/defaults.py), printed in the banner with the flag that changes it.
    channels_last: Optional[bool] = None  # channels_last tensors; None (auto): on CUDA GPUs
    compile: str = "auto"  # torch.compile: auto (reduce-overhead on GPUs where it applies) | off | default |
    #                        reduce-overhead (CUDA graphs) | max-autotune
    tune_kernels: bool = False  # with --compile: tune each generated kernel's launch settings (coordinate descent)
    maxpool_kernel: str = "auto"  # stem max-pool: auto (Triton kernels on a GPU, channels_last) | torch | triton
    bn_kernel: str = "auto"  # training BatchNorm + add + ReLU: auto (fused Triton kernels on GPUs where they
    #                          apply) | torch (its modules) | triton | cudnn (triton, with the statistics made
    #                          in cuDNN's fused convolutions: nvidia-cudnn-frontend, in requirements.txt)
    sync_bn: bool = False

    # -- optimisation -----------------------------------------------------------------------
    epochs: int = 90
    start_epoch: Optional[int] = None  # override the epoch to start at (default 0, or resumed)
    batch_size: int = 256  # GLOBAL batch over all devices/processes, images per optimizer step
    accum_steps: int = 1  # forward/backward passes (micro-batches of b / accum) per optimizer step
    lr: float = 0.1  # peak learning rate for the global batch (not rescaled automatically)
    momentum: float = 0.9
    weight_decay: float = 1e-4  # L2 coefficient applied by SGD, per step
    no_bn_weight_decay: bool = False  # exempt BatchNorm weights/biases and all biases from decay
    optimizer: str = "sgd"  # sgd | lars (MLPerf's: SGD with each layer's step scaled by its trust ratio)
    lars_eta: float = 0.001  # --optimizer lars: trust coefficient (dimensionless)
    lars_eps: float = 0.0  # --optimizer lars: added to the trust ratio's denominator (gradient-norm units)
    optimizer_impl: str = "auto"  # SGD kernel: auto (triton for --fp16 on CUDA, else fused on CUDA, foreach
    #                               elsewhere) | triton | fused | foreach
    label_smoothing: float = 0.0
    mixup: float = 0.0  # Beta(a, a) parameter of mixup (0: off)
    cutmix: float = 0.0  # Beta(a, a) parameter of CutMix (0: off); with both, half the batches each
    clip_grad_norm: Optional[float] = None  # max global L2 norm of the (unscaled) gradients per step
    model_ema: Optional[float] = None  # keep an fp32 moving average of the weights with this decay per step
    lr_schedule: str = "step"  # step: x lr_gamma every lr_step epochs; cosine, triangular (linear), poly: to
    #                            lr_end at lr_decay_epochs (imagenet/training/schedule.py)
    lr_step: int = 30  # epochs between decays of the step schedule
    lr_gamma: float = 0.1
    lr_end: float = 0.0  # learning rate the cosine, triangular and poly decays end at (absolute, like --lr)
    lr_decay_epochs: Optional[float] = None  # epoch (from the run's start) at which the decay reaches lr_end;
    #                                          default --epochs
    lr_poly_power: float = 2.0  # exponent of the poly decay
    warmup_epochs: float = 0.0  # linear warm-up from ~0 to lr, per iteration, in epochs

    # -- precision --------------------------------------------------------------------------
    fp16: bool = False  # fp16 model (BatchNorm fp32) with fp32 master weights and loss scaling
    loss_scale: Optional[str] = None  # a number (static) or "dynamic"; default dynamic with --fp16
    dynamic_loss_scale: bool = False
    scale_window: int = 1000  # clean steps before a dynamic loss scale doubles
    initial_loss_scale: float = 2.0 ** 16
    amp: bool = False  # torch.autocast mixed precision
    amp_dtype: str = "float16"
    tf32: bool = True  # TF32 matmul/convolutions on GPUs that have them (--no-tf32 to disable)
    max_nonfinite_steps: int = 200  # stop after this many consecutive NaN/inf losses (0: never)

    # -- devices and distribution --------------------------------------------------------
    gpu: Optional[int] = None
    world_size: int = -1
    rank: int = -1
    dist_url: str = "env://"
    dist_backend: Optional[str] = None  # default: nccl with CUDA, gloo without
    multiprocessing_distributed: bool = False
    dist_timeout: int = 1800  # seconds a collective may wait for a peer before the run fails

    # -- run control and output ----------------------------------------------------------
    output_dir: str = "."
    resume: str = ""  # a checkpoint path, or "auto" for OUTPUT_DIR/checkpoint.pth.tar if present
    save_every_steps: int = 0  # also checkpoint every N training steps inside an epoch (0: per epoch only)
    on_data_change: str = "stop"  # a mid-epoch resume whose data order changed (files, shards, --seed,
    #                               --shuffle-window): stop (exit 2) | restart-epoch (train that epoch from its start)
    evaluate: bool = False
    seed: Optional[int] = None
    deterministic: bool = False  # deterministic cuDNN algorithms (slower)
    print_freq: int = 10
    tensorboard: bool = False  # also write the per-epoch metrics to OUTPUT_DIR/tensorboard (needs tensorboard)
    progress: str = "auto"  # auto: a bar on a terminal, plain lines otherwise; bar; lines
    eval_every: int = 1  # validate every N epochs (and always after the last one)
    eval_start: int = 0  # the first epoch validated, 0-based as in metrics.jsonl (MLPerf's "eval offset")
    target_acc: Optional[float] = None  # stop once validation Acc@1 (percent) reaches this
    prof: int = -1  # >0: run only this many iterations of one epoch, for profiling (no checkpoint written)
    config: Optional[str] = None

    def to_dict(self) -> dict:
        """Plain dict (YAML/JSON-serialisable) of every option."""
        return dataclasses.asdict(self)

    @property
    def precision_name(self) -> str:
        if self.fp16:
            return "fp16"
        if self.amp:
            return "amp-bf16" if self.amp_dtype == "bfloat16" else "amp-fp16"
        return "fp32"

    @property
    def half_dtype(self) -> Optional[str]:
        """The torch dtype name the convolutions run in where it is a half-precision one
        (``float16`` with --fp16 or --amp, ``bfloat16`` with --amp-dtype bfloat16); None in fp32."""
        if self.fp16:
            return "float16"
        return self.amp_dtype if self.amp else None


# Flags whose CLI spelling differs from the field name or that need special argparse handling.
_SHORT = {"arch": ["-a"], "workers": ["-j"], "batch_size": ["-b"], "print_freq": ["-p"],
          "evaluate": ["-e"], "weight_decay": ["--wd"]}
_CHOICES = {"arch": ARCHS, "data_pipeline": ("fast", "classic"),
            "auto_augment": ("none", "randaugment", "trivialaugment", "autoaugment"), "lr_schedule": LR_SCHEDULES,
            "amp_dtype": ("float16", "bfloat16"), "progress": ("auto", "bar", "lines"),
            "dist_backend": ("nccl", "gloo", "mpi", "ucc"), "optimizer_impl": ("auto", "triton", "fused", "foreach"),
            "optimizer": ("sgd", "lars"),
            "compile": ("auto",) + COMPILE_MODES, "decode": ("cpu", "gpu", "auto"), "maxpool_kernel": MAXPOOL_KERNELS,
            "bn_kernel": BN_KERNELS, "on_data_change": ("stop", "restart-epoch")}
_HELP = {
    "batch_size": "global batch over all devices (default 256)",
    "loss_scale": "static loss scale (a number) or 'dynamic' (default with --fp16: dynamic)",
    "resume": "checkpoint to resume from, or 'auto' for OUTPUT_DIR/checkpoint.pth.tar",
    "tf32": "use TF32 on GPUs that support it (default on; --no-tf32 turns it off)",
    "channels_last": "channels_last tensors (default: on with CUDA GPUs; --no-channels-last turns it off)",
    "compile": "torch.compile the model: auto (default: reduce-overhead, with CUDA graphs, on GPUs where it "
               "applies; the banner says what was chosen and why), off, default, reduce-overhead, max-autotune",
    "bn_kernel": "training BatchNorm + add + ReLU: auto (default: our fused Triton kernels on GPUs where they "
                 "apply, their statistics made by cuDNN's fused convolutions where the "
                 "nvidia-cudnn-frontend package of requirements.txt loads), torch, triton, cudnn",
    "no_jpeg_draft": "fast pipeline: decode training JPEGs at full scale (by default one whose random crop is at "
                     "least twice the output size is decoded at 1/2-1/8 scale inside libjpeg); validation always "
                     "decodes at full scale, as torchvision does",
    "decode": "where training and validation JPEGs are decoded: auto (default: on the GPU where the images are "
              "JPEGs and each process trains one GPU; under DataParallel only with fewer than 12 workers per GPU; "
              "else in the workers; the banner says what was chosen and why), cpu (in the data workers), gpu (the workers read files, nvJPEG decodes batches "
              "on the GPU)",
    "decode_share": "with the GPU decode: the share of the training JPEGs the workers decode on their CPUs "
                    "instead: auto (default: 0, rising while the GPU decode thread sets the pace and falling when "
                    "it waits; the epoch's input line says how much they took) or a fraction from 0 (every JPEG "
                    "on the GPU) to 1",
    "on_data_change": "what a resume in the middle of an epoch does when the training data's order changed since "
                      "its checkpoint (the image files, the shards, --seed, --shuffle-window): stop (default; exit "
                      "2) or restart-epoch (train that epoch again from its start)",
    "max_bad_fraction": "the largest share of an epoch's images that may be unreadable (skipped and counted): "
                        "exactly this share goes on, more stops the run; 0 stops at the first, 1 never (default "
                        "0.01)",
    "optimizer": "sgd (default) or lars: SGD whose step of each weight tensor is scaled by its trust ratio "
                 "eta |w| / (|g| + wd |w| + eps), with no scaling and no weight decay on BatchNorm parameters and "
                 "biases (MLPerf's ResNet-50 recipe)",
    "eval_every": "validate every N epochs from --eval-start on, and after the last epoch (default 1)",
    "eval_start": "the first epoch to validate, 0-based as in metrics.jsonl (default 0; MLPerf's ResNet-50: "
                  "--eval-every 4 --eval-start 2, its epochs 3, 7, ..., 35)",
    "target_acc": "stop once validation Acc@1 reaches this percentage (e.g. 75.9), and report the time it took from "
                  "the first training step",
    "prof": "run only N iterations of one epoch, for profiling (N defaults to 10); writes no checkpoint, and its "
            "row goes to OUTPUT_DIR/prof.jsonl, not metrics.jsonl (its options to prof-config.yaml)",
    "pretrained": "start from torchvision's ImageNet weights NAME (default: DEFAULT, the best; e.g. IMAGENET1K_V1), "
                  "read from the local torch hub cache; validation then resizes as the weights were evaluated",
}


@functools.lru_cache(maxsize=None)
def _field_types() -> dict:
    hints = {}
    for f in fields(Config):
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        hints[f.name] = t.replace("Optional[", "").rstrip("]")
    return hints


@functools.lru_cache(maxsize=None)
def _optional_fields() -> frozenset:
    return frozenset(f.name for f in fields(Config) if "Optional[" in str(f.type))


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a number (YAML 1.1 insists on ``1.0e-4``) and reads
    ``2:26`` as the text it looks like, not as YAML 1.1's base-60 number 146."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
            or ":" not in rx.pattern or rx.pattern.startswith("^(?:[-+]?[0-9][0-9_]*\\.")]
    for first, resolvers in _YamlLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))


class _PretrainedAction(argparse.Action):
    """``--pretrained [NAME]``. The classic script's ``--pretrained`` takes no value, so in
    ``main.py -e --pretrained /data/imagenet`` the folder is the dataset, not a weights name."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value != self.const and (os.sep in value or os.path.isdir(value)) and getattr(namespace, "data", None) is None:
            namespace.data, value = value, self.const
        setattr(namespace, self.dest, value)


def build_parser() -> argparse.ArgumentParser:
    """The command line. Defaults are suppressed so only flags the user gave override YAML."""
    p = argparse.ArgumentParser(
        prog="main.py",
        description="Train ResNets on an ImageNet-layout folder (DIR/train, DIR/val). "
                    "Without DIR, trains on the built-in MNIST-5k digits.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("data", nargs="?", metavar="DIR",
                   help="dataset root with train/ and val/, or a tar shard folder (scripts/make_shards.py) or its URL")
    types = _field_types()
    for f in fields(Config):
        if f.name == "data":
            continue
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + _SHORT.get(f.name, [])
        if f.name != f.name.replace("_", "-"):
            names.append("--" + f.name)  # the reference script's underscore spelling works too
        kind = types[f.name]
        kwargs: dict[str, Any] = {"dest": f.name, "help": _HELP.get(f.name)}
        if f.name in ("tf32", "channels_last"):
            p.add_argument(*names, dest=f.name, action="store_true", help=_HELP[f.name])
            p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false")
            continue
        if f.name == "prof":
            p.add_argument(flag, dest="prof", nargs="?", const=10, type=int, help=_HELP["prof"])
            continue
        if f.name == "pretrained":
            p.add_argument(flag, dest="pretrained", nargs="?", const="DEFAULT", metavar="NAME",
                           action=_PretrainedAction, help=_HELP["pretrained"])
            continue
        if kind == "bool":
            p.add_argument(*names, action="store_true", **kwargs)
            continue
        kwargs["type"] = {"int": int, "float": float}.get(kind, str)
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        p.add_argument(*names, metavar=f.name.upper() if kind == "str" else None, **kwargs)
    return p


def _load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} does not exist")
    try:
        with open(path) as fh:
            raw = yaml.load(fh, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"config file {path!r} is not valid YAML{where}: {getattr(e, 'problem', e)}")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path!r} must be a mapping of option: value")
    known = {f.name for f in fields(Config)}
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name == "config":
            raise UserError(f"{path}: a config file cannot name another config file (key {key!r})")
        if name not in known:
            hint = _closest(name, known - {"config"})
            raise UserError(f"unknown key {key!r} in {path}" + (f" (did you mean {hint!r}?)" if hint else ""))
        out[name] = _coerce(name, value, source=path)
    return out


def _closest(name: str, known) -> Optional[str]:
    import difflib
    m = difflib.get_close_matches(name, sorted(known), n=1)
    return m[0].replace("_", "-") if m else None


def _coerce(name: str, value: Any, source: str) -> Any:
    """Check a YAML value against the field's type (YAML already typed it)."""
    kind = _field_types()[name]
    key = name.replace("_", "-")
    if name == "pretrained" and isinstance(value, bool):  # `pretrained: true` as in the classic flag
        return "DEFAULT" if value else None
    if value is None:
        if name in _optional_fields():
            return None
        raise UserError(f"{key} in {source} needs a value (it has none)")
    if kind == "bool":
        if not isinstance(value, bool):
            raise UserError(f"{key} in {source} must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} in {source} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} in {source} must be a number, got {value!r}")
        return float(value)
    if isinstance(value, (dict, list)):
        raise UserError(f"{key} in {source} must be a single value, got {value!r}")
    value = str(value)
    if name in _CHOICES and value not in _CHOICES[name]:
        raise UserError(f"{key} in {source} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
    return value


def parse_config(argv: Optional[list] = None) -> Config:
    """Parse the command line (and the YAML recipe it names) into a validated :class:`Config`."""
    parser = build_parser()
    ns = vars(_parse_args(parser, argv))
    values: dict[str, Any] = {}
    if "config" in ns:
        values.update(_load_yaml(ns["config"]))
    values.update(ns)  # the command line wins
    cfg = Config(**values)
    validate(cfg)
    return cfg


def _parse_args(parser: argparse.ArgumentParser, argv):
    # argparse prints usage and exits 2 on its own errors; keep that (it is one clear line),
    # but make it go through our error type so callers can test it.
    def error(message):
        raise UserError(f"{message} (see python main.py --help)")
    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def _loss_scale_value(cfg: Config) -> Optional[float]:
    """None for dynamic scaling, else the static scale; raises on a bad value."""
    if cfg.loss_scale is None or str(cfg.loss_scale).lower() == "dynamic":
        return None
    try:
        value = float(cfg.loss_scale)
    except ValueError:
        raise UserError(f"--loss-scale must be a positive number or 'dynamic', got {cfg.loss_scale!r}")
    if not value > 0 or value == float("inf"):
        raise UserError(f"--loss-scale must be a positive number or 'dynamic', got {cfg.loss_scale!r}")
    return value


def decode_share(cfg: Config) -> Optional[float]:
    """``--decode-share`` as a fraction, None for ``auto`` (0 under ``--deterministic``, whose runs
    repeat pixel for pixel); raises on a bad value."""
    if str(cfg.decode_share).lower() == "auto":
        return 0.0 if cfg.deterministic else None
    try:
        value = float(cfg.decode_share)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 <= value <= 1:
        raise UserError(f"--decode-share is auto or a fraction from 0 to 1, got {cfg.decode_share!r}")
    return value


def static_loss_scale(cfg: Config) -> Optional[float]:
    """The static loss scale, or None when dynamic scaling is asked for (or implied)."""
    if cfg.dynamic_loss_scale:
        return None
    return _loss_scale_value(cfg)


def validate(cfg: Config) -> None:
    """Reject impossible combinations with one clear line each (the first one found)."""
    _check_numbers(cfg)
    _check_input(cfg)
    _check_run_control(cfg)
    _check_modes(cfg)
    _check_companions(cfg)
    _check_launch(cfg)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


def _check_numbers(cfg: Config) -> None:
    """Counts, rates and schedule values each in its range."""
    _need(cfg.arch in ARCHS, f"unknown architecture {cfg.arch!r}; choose one of {', '.join(ARCHS)}")
    _need(cfg.epochs >= 1, f"--epochs must be at least 1, got {cfg.epochs}")
    _need(cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}")
    _need(cfg.accum_steps >= 1, f"--accum-steps must be at least 1, got {cfg.accum_steps}")
    _need(cfg.workers >= 0, f"--workers must be 0 or more, got {cfg.workers}")
    _need(cfg.shuffle_window >= 1, f"--shuffle-window is a number of images, at least 1, got {cfg.shuffle_window}")
    _need(cfg.mixup >= 0 and cfg.cutmix >= 0, "--mixup and --cutmix take a Beta parameter >= 0 (0: off)")
    _need(0 <= cfg.random_erase <= 1, f"--random-erase must be a probability in [0, 1], got {cfg.random_erase}")
    for name in ("lr", "momentum", "weight_decay", "label_smoothing", "warmup_epochs", "lr_gamma",
                 "min_crop_scale", "hflip", "max_bad_fraction", "initial_loss_scale"):
        value = getattr(cfg, name)
        _need(math.isfinite(value), f"--{name.replace('_', '-')} must be a finite number, got {value}")
    _need(cfg.lr > 0, f"--lr must be positive, got {cfg.lr}")
    _need(cfg.model_ema is None or 0 < cfg.model_ema < 1,
          f"--model-ema is the per-step decay, in (0, 1) (e.g. 0.9998), got {cfg.model_ema}")
    _need(cfg.clip_grad_norm is None or (math.isfinite(cfg.clip_grad_norm) and cfg.clip_grad_norm > 0),
          f"--clip-grad-norm must be a positive number, got {cfg.clip_grad_norm}")
    _need(cfg.momentum >= 0, f"--momentum must be 0 or more, got {cfg.momentum}")
    _need(cfg.weight_decay >= 0, f"--weight-decay must be 0 or more, got {cfg.weight_decay}")
    _need(0.0 <= cfg.label_smoothing < 1.0, f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}")
    _need(cfg.warmup_epochs >= 0, f"--warmup-epochs must be 0 or more, got {cfg.warmup_epochs}")
    _need(cfg.warmup_epochs < cfg.epochs or cfg.warmup_epochs == 0,
          f"--warmup-epochs ({cfg.warmup_epochs}) must be shorter than --epochs ({cfg.epochs})")
    _need(cfg.lr_step >= 1, f"--lr-step must be at least 1 epoch, got {cfg.lr_step}")
    _need(math.isfinite(cfg.lr_end) and 0 <= cfg.lr_end < cfg.lr,
          f"--lr-end is the learning rate the decay ends at, in [0, --lr), got {cfg.lr_end}")
    _need(math.isfinite(cfg.lr_poly_power) and cfg.lr_poly_power > 0,
          f"--lr-poly-power must be a positive number, got {cfg.lr_poly_power}")
    if cfg.lr_decay_epochs is not None:
        _need(math.isfinite(cfg.lr_decay_epochs) and cfg.lr_decay_epochs > cfg.warmup_epochs,
              f"--lr-decay-epochs ({cfg.lr_decay_epochs}) is the epoch the decay ends at: it must come after "
              f"--warmup-epochs ({cfg.warmup_epochs})")
    _need(0 < cfg.lr_gamma <= 1, f"--lr-gamma must be in (0, 1], got {cfg.lr_gamma}")
    _need(math.isfinite(cfg.lars_eta) and cfg.lars_eta > 0, f"--lars-eta must be a positive number, got {cfg.lars_eta}")
    _need(math.isfinite(cfg.lars_eps) and cfg.lars_eps >= 0, f"--lars-eps must be 0 or more, got {cfg.lars_eps}")


def _check_input(cfg: Config) -> None:
    """Image sizes, the input pipeline and its augmentations."""
    _need(cfg.image_size >= 8, f"--image-size must be at least 8 pixels, got {cfg.image_size}")
    crop = cfg.val_crop if cfg.val_crop is not None else cfg.image_size
    _need(crop >= 8, f"--val-crop must be at least 8 pixels, got {crop}")
    # without --val-resize: 256, or with --pretrained the weights' ratio (above 1) at this crop
    resize = cfg.val_resize if cfg.val_resize is not None else (None if cfg.pretrained else DEFAULT_VAL_RESIZE)
    _need(resize is None or resize >= crop,
          f"--val-resize ({resize}) must be at least the validation crop ({crop}: "
          f"{'--val-crop' if cfg.val_crop is not None else '--image-size'})")
    if cfg.decode == "gpu":
        _need(cfg.data_pipeline == "fast", "--decode gpu is part of the fast pipeline; drop --data-pipeline classic")
        _need(cfg.auto_augment == "none" and cfg.random_erase == 0,
              "--auto-augment and --random-erase run on decoded images in the workers; with --decode gpu the "
              "workers never see pixels: use --decode cpu for those recipes")
    decode_share(cfg)  # a fraction or auto
    _need(str(cfg.decode_share).lower() == "auto" or cfg.decode != "cpu",
          f"--decode-share {cfg.decode_share} is the workers' share of the GPU decode's JPEGs; with --decode cpu the "
          "workers decode every image already: drop one of the two")
    if cfg.progressive_resize is not None:
        _need(8 <= cfg.progressive_resize < cfg.image_size,
              f"--progressive-resize is the starting training crop, from 8 px to below --image-size "
              f"({cfg.image_size}), got {cfg.progressive_resize}")
    if cfg.progressive_ramp is not None:
        parts = cfg.progressive_ramp.split(":")
        ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
        _need(ok and int(parts[0]) < int(parts[1]) <= cfg.epochs,
              f"--progressive-ramp is FIRST:LAST, two epochs with FIRST < LAST <= --epochs ({cfg.epochs}), "
              f"e.g. 0:{max(1, round(0.75 * cfg.epochs))}; got {cfg.progressive_ramp!r}")
        _need(cfg.progressive_resize is not None, "--progressive-ramp needs --progressive-resize MIN_SIZE")
    _need(cfg.progressive_step >= 1,
          f"--progressive-step is a number of pixels, at least 1, got {cfg.progressive_step}")
    _need(0 < cfg.min_crop_scale <= 1, f"--min-crop-scale must be in (0, 1], got {cfg.min_crop_scale}")
    _need(0 <= cfg.hflip <= 1, f"--hflip must be a probability in [0, 1], got {cfg.hflip}")
    _need(0 <= cfg.max_bad_fraction <= 1, f"--max-bad-fraction must be in [0, 1], got {cfg.max_bad_fraction}")


def _check_run_control(cfg: Config) -> None:
    """Saving, printing, stopping, devices, loss-scale settings, --dummy sizes."""
    _need(cfg.save_every_steps >= 0, f"--save-every-steps must be 0 or more, got {cfg.save_every_steps}")
    _need(cfg.print_freq >= 1, f"--print-freq must be at least 1, got {cfg.print_freq}")
    _need(cfg.start_epoch is None or 0 <= cfg.start_epoch < cfg.epochs,
          f"--start-epoch must be in [0, {cfg.epochs}), got {cfg.start_epoch}")
    _need(cfg.gpu is None or cfg.gpu >= 0, f"--gpu must be a device index (0, 1, ...), got {cfg.gpu}")
    _need(cfg.max_nonfinite_steps >= 0, f"--max-nonfinite-steps must be 0 or more, got {cfg.max_nonfinite_steps}")
    _need(cfg.dist_timeout >= 1, f"--dist-timeout must be at least 1 second, got {cfg.dist_timeout}")
    _need(cfg.scale_window >= 1, f"--scale-window must be at least 1, got {cfg.scale_window}")
    _need(cfg.initial_loss_scale > 0, f"--initial-loss-scale must be positive, got {cfg.initial_loss_scale}")
    _need(cfg.prof == -1 or cfg.prof >= 1, f"--prof takes a positive number of iterations, got {cfg.prof}")
    _need(cfg.eval_every >= 1, f"--eval-every is a number of epochs, at least 1, got {cfg.eval_every}")
    _need(cfg.eval_start >= 0, f"--eval-start is a 0-based epoch, 0 or more, got {cfg.eval_start}")
    # Acc@1 is printed and stored in percent; MLPerf writes its target as a fraction (0.759)
    _need(cfg.target_acc is None or (math.isfinite(cfg.target_acc) and 1 < cfg.target_acc <= 100),
          f"--target-acc is a percentage of validation Acc@1 above 1, as printed (75.9 for 75.9%), "
          f"got {cfg.target_acc}")
    for name in ("dummy_train_size", "dummy_val_size", "dummy_classes"):
        _need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")


def _check_modes(cfg: Config) -> None:
    """Precision, kernels, starting weights and loss scaling that exclude each other."""
    _need(not (cfg.fp16 and cfg.amp),
          "--fp16 and --amp are two ways of doing mixed precision; pick one "
          "(--fp16: fp16 model with fp32 master weights; --amp: autocast)")
    _need(not cfg.tune_kernels or cfg.compile != "off",
          "--tune-kernels tunes the kernels torch.compile generates; add --compile default (or reduce-overhead)")
    _need(cfg.maxpool_kernel != "triton" or cfg.channels_last is not False,
          "--maxpool-kernel triton computes channels_last tensors only; drop --no-channels-last (or use auto)")
    _need(cfg.maxpool_kernel != "triton" or not cfg.small_stem,
          "--small-stem has no max-pool for --maxpool-kernel triton to compute; drop one of them")
    if cfg.bn_kernel in ("triton", "cudnn"):
        _need(cfg.channels_last is not False,
              f"--bn-kernel {cfg.bn_kernel} computes channels_last tensors only; drop --no-channels-last")
        _need(not cfg.sync_bn, f"--bn-kernel {cfg.bn_kernel} computes per-process statistics; --sync-bn needs "
                               "torch's SyncBatchNorm: drop one of them")
    _need(cfg.bn_kernel != "cudnn" or not cfg.deterministic,
          "--bn-kernel cudnn adds the BatchNorm statistics with atomics, which --deterministic rules out: use "
          "--bn-kernel triton (deterministic) or drop --deterministic")
    _need(not (cfg.pretrained and cfg.weights),
          "--pretrained and --weights both name starting weights; pick one")
    _need(not (cfg.evaluate and cfg.resume and cfg.weights),
          "--evaluate takes its weights from --resume or --weights, not both")
    if cfg.loss_scale is not None or cfg.dynamic_loss_scale:
        _need(cfg.fp16 or (cfg.amp and cfg.amp_dtype == "float16"),
              "--loss-scale/--dynamic-loss-scale apply to --fp16 (or --amp with float16); add --fp16")
        _loss_scale_value(cfg)
        _need(not (cfg.dynamic_loss_scale and _loss_scale_value(cfg) is not None),
              "--dynamic-loss-scale contradicts a static --loss-scale; give one of them")
        _need(not (cfg.amp and static_loss_scale(cfg) is not None),
              "--amp uses a dynamic loss scale; a static --loss-scale needs --fp16")


def _check_companions(cfg: Config) -> None:
    """Settings of a feature given without the flag that turns it on: they would do nothing."""
    defaults = {f.name: f.default for f in fields(Config)}
    given = [name for name in defaults if getattr(cfg, name) != defaults[name]]
    _need(cfg.optimizer == "lars" or not {"lars_eta", "lars_eps"} & set(given),
          "--lars-eta and --lars-eps set LARS's trust ratio: add --optimizer lars, or drop them")
    _need(cfg.lr_schedule != "step" or not {"lr_end", "lr_decay_epochs"} & set(given),
          "--lr-end and --lr-decay-epochs shape the cosine, triangular and poly decays, and --lr-schedule step "
          "has none: choose one of those schedules, or drop them")
    _need(cfg.lr_schedule == "poly" or "lr_poly_power" not in given,
          "--lr-poly-power is the poly decay's exponent: add --lr-schedule poly, or drop it")
    _need(cfg.progressive_resize is not None or "progressive_step" not in given,
          "--progressive-step rounds --progressive-resize's sizes: add --progressive-resize MIN_SIZE, or drop it")


def _check_launch(cfg: Config) -> None:
    """World size and rank."""
    _need(cfg.world_size == -1 or cfg.world_size >= 1, f"--world-size must be at least 1, got {cfg.world_size}")
    _need(cfg.rank >= -1, f"--rank must be 0 or more, got {cfg.rank}")
    if cfg.world_size >= 1 and cfg.rank >= 0 and not cfg.multiprocessing_distributed:
        _need(cfg.rank < cfg.world_size,
              f"--rank {cfg.rank} is not below --world-size {cfg.world_size}; ranks are 0..world_size-1")
