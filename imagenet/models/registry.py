"""Architecture registry: torchvision's ResNet family by name, a small-input stem, starting weights."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torchvision

from ..base.checkpoint import read_checkpoint
from ..base.config import ARCHS
from ..base.errors import UserError
from ..base.torch_private import inductor_tune_kernels, raise_recompile_limit
from ..base.wrappers import strip_prefix, unwrap
from ..kernels import convstats
from ..kernels.compiles import available as kernels_available
from ..kernels.bnlaunch import LAUNCH, LAUNCH_ENV, launch_override
from ..kernels.maxpool import StemMaxPool, is_stem_pool
from .fusedresnet import fuse_resnet, uses_bn_kernels, uses_conv_stats
from .blurpool import add_blur, uses_blur
from .stem import pad_stem

logger = logging.getLogger(__name__)


def create_model(arch: str, num_classes: int, small_stem: bool = False, stem_kernels: bool = False,
                 bn_kernels: bool = False, stats_in_conv: bool = False, blurpool: bool = False) -> nn.Module:
    """A freshly initialised ResNet-family model with ``num_classes`` outputs; ``stem_kernels``:
    its max-pool computed by :mod:`imagenet.kernels.maxpool`'s kernels, ``bn_kernels``: its BatchNorms
    with their adds and ReLUs by :mod:`imagenet.kernels.fusedbn`'s (:mod:`.fusedresnet`), ``stats_in_conv``: their
    statistics by the convolutions before them (:mod:`imagenet.kernels.convstats`; not those of
    blurred convolutions, which take the Triton pass); ``blurpool``: FFCV's blur before each
    strided convolution (:mod:`.blurpool`). The same state dict every way."""
    if arch not in ARCHS:
        raise UserError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if small_stem:
        # Low-resolution images (28-64 px) lose most of their pixels to the 7x7/2 conv and the
        # max-pool; a 3x3/1 conv without pooling keeps the feature maps large enough to learn.
        width = model.conv1.out_channels
        model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    else:
        pad_stem(model)  # the convolution cuDNN pads to 4 channels itself, padded once (models/stem.py)
        if stem_kernels and is_stem_pool(model.maxpool):
            model.maxpool = StemMaxPool()
    if blurpool:
        add_blur(model)
    if bn_kernels:
        fuse_resnet(model, stats_in_conv)
    return model


def has_grouped_convolutions(arch: str) -> bool:
    """Whether ``arch``'s blocks have grouped convolutions (ResNeXt's 3x3 ones), which
    :func:`imagenet.kernels.convstats.applies` leaves to torch's convolution, their BatchNorms to
    the Triton statistics (``--bn-kernel cudnn``)."""
    return arch.startswith("resnext")


def model_from_checkpoint(path: str, weights: str = "state_dict") -> nn.Module:
    """The model of one of this trainer's checkpoints, on the CPU in float32, in evaluation mode:
    the architecture its resolved config names (``-a``, ``--small-stem``, ``--blurpool``: a
    ``--blurpool`` model's weights load into a plain torchvision model too, but without the blur it
    scores lower) with torch's own modules, its classes from the classifier's shape, and its
    ``weights`` (``state_dict_ema``: the weight average's). A plain state dict names no
    architecture and is refused: load it into the model it came from yourself."""
    ckpt = read_checkpoint(path)
    config = ckpt.get("config")
    if not isinstance(config, dict) or weights not in ckpt:
        raise UserError(f"{path} is no checkpoint of this trainer with {weights!r} (a plain state dict names no "
                        "architecture): load it into torchvision's model yourself")
    state = strip_prefix(ckpt[weights])
    model = create_model(ckpt.get("arch", config.get("arch")), int(state["fc.weight"].shape[0]),
                         small_stem=bool(config.get("small_stem")), blurpool=bool(config.get("blurpool")))
    load_weights_into(model, state, path)
    return model.float().eval()


def has_blur(model: nn.Module) -> bool:
    """Whether the (possibly wrapped) model blurs before its strided convolutions (``--blurpool``)."""
    return uses_blur(unwrap(model))


def has_stem_kernels(model: nn.Module) -> bool:
    """Whether the (possibly wrapped) model's max-pool runs on :mod:`imagenet.kernels.maxpool`'s kernels."""
    return any(isinstance(m, StemMaxPool) for m in unwrap(model).modules())


def has_fused_bn(model: nn.Module) -> bool:
    """Whether the (possibly wrapped) model's BatchNorms run on :mod:`imagenet.kernels.fusedbn`'s kernels."""
    return uses_bn_kernels(unwrap(model))


def has_conv_stats(model: nn.Module) -> bool:
    """Whether the (possibly wrapped) model's BatchNorm statistics come from its convolutions
    (:mod:`imagenet.kernels.convstats`)."""
    return uses_conv_stats(unwrap(model))


def use_stem_kernels(kind: str, device: torch.device, channels_last: bool, small_stem: bool) -> bool:
    """Whether ``--maxpool-kernel kind`` puts the stem's max-pool on the Triton kernels here;
    ``triton`` where they cannot run is a UserError (``auto`` then quietly uses torch's)."""
    if kind == "torch" or small_stem:
        return False
    runs = device.type == "cuda" and kernels_available()
    if kind == "triton" and not runs:
        why = f"this run is on {device}" if device.type != "cuda" else "this torch has no Triton, or the GPU is too old"
        raise UserError(f"--maxpool-kernel triton needs a CUDA GPU and Triton; {why}: use --maxpool-kernel auto")
    return runs and channels_last


def use_bn_kernels(kind: str, device: torch.device) -> bool:
    """Whether ``--bn-kernel kind`` runs the fused BatchNorm kernels here (a UserError where it asks
    for them and they cannot run). Triton's interpreter (TRITON_INTERPRET=1) runs them on a CPU."""
    if kind == "torch":
        return False
    if not ((device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and kernels_available()):
        why = f"this run is on {device}" if device.type != "cuda" else "this torch has no Triton, or the GPU is too old"
        raise UserError(f"--bn-kernel {kind} needs a CUDA GPU and Triton; {why}: use --bn-kernel torch")
    try:
        LAUNCH.update(launch_override(os.environ.get(LAUNCH_ENV)))
    except ValueError as e:
        raise UserError(f"{e}; or unset {LAUNCH_ENV}") from None
    return True


def use_conv_stats(kind: str, device: torch.device, half_dtype: Optional[str]) -> bool:
    """Whether ``--bn-kernel kind`` has the convolutions make their BatchNorms' sums here
    (``cudnn`` in a run whose convolutions are in ``half_dtype``, Config.half_dtype; a UserError naming
    the fix where it cannot run). Under Triton's interpreter the CPU tests run the same path on
    torch's convolution."""
    if kind != "cudnn" or half_dtype is None:  # fp32: the Triton kernels make them (the banner says so)
        return False
    why = convstats.why_unavailable(device, getattr(torch, half_dtype))
    if why is not None and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise UserError(f"--bn-kernel cudnn takes the BatchNorm statistics from cuDNN's fused convolutions, and "
                        f"{why}: use --bn-kernel triton")
    return True


def load_weights_into(model: nn.Module, state_dict: dict, source: str) -> dict:
    """Load a (possibly prefixed) state dict; returns it as loaded (see :func:`fit_state_dict`)."""
    state_dict = fit_state_dict(model, state_dict, source)
    model.load_state_dict(state_dict)
    return state_dict


def fit_state_dict(model: nn.Module, state_dict: dict, source: str) -> dict:
    """Check a (possibly prefixed) state dict against ``model``; a classifier of another class
    count is replaced by the model's own (fresh) one.

    Anything else that does not match is an error naming the offending keys: silently keeping
    random layers would train a different model than the user asked for. Returns the state
    dict ready to load (prefixes stripped, gaps filled).
    """
    state_dict = strip_prefix(state_dict)
    own = model.state_dict()
    fc_keys = [k for k in ("fc.weight", "fc.bias") if k in state_dict and k in own]
    if fc_keys and state_dict["fc.weight"].shape != own["fc.weight"].shape:
        logger.info("%s: classifier has %d classes, the dataset %d; the final layer starts fresh",
                    source, state_dict["fc.weight"].shape[0], own["fc.weight"].shape[0])
        state_dict = {k: v for k, v in state_dict.items() if k not in fc_keys}
        state_dict.update({k: own[k] for k in fc_keys})
    # Older checkpoints (torchvision's V1 weights among them) predate BatchNorm's step counter.
    for k in own:
        if k.endswith("num_batches_tracked") and k not in state_dict:
            state_dict[k] = own[k]
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        detail = []
        if missing:
            detail.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            detail.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
        raise UserError(f"weights in {source} do not fit this model: {'; '.join(detail)}; "
                        "check -a/--arch and --small-stem match the run that saved them")
    bad = [k for k, v in state_dict.items() if hasattr(v, "shape") and v.shape != own[k].shape]
    if bad:
        k = bad[0]
        raise UserError(f"weights in {source} do not fit this model: {k} has shape "
                        f"{tuple(state_dict[k].shape)}, the model {tuple(own[k].shape)}; "
                        "check -a/--arch and --small-stem")
    return state_dict


@dataclass(frozen=True)
class PretrainedWeights:
    """One of torchvision's ImageNet weight sets for an architecture, and how it was evaluated."""

    arch: str
    name: str  # e.g. IMAGENET1K_V2 (DEFAULT resolved)
    url: str
    resize: int  # evaluation transform: shorter side resized to this, bilinear, antialiased ...
    crop: int  # ... then centre-cropped to this
    acc1: float  # torchvision's published ImageNet-1K Acc@1 at that geometry


def pretrained_weights(arch: str, name: str = "DEFAULT") -> PretrainedWeights:
    """torchvision's weights ``name`` for ``arch`` (``DEFAULT``, ``IMAGENET1K_V1``, or the qualified
    ``ResNet50_Weights.IMAGENET1K_V2``); an unknown name lists the valid ones."""
    enum = torchvision.models.get_model_weights(arch)
    qualifier, _, member = name.rpartition(".")
    wanted = member.upper() if qualifier in ("", enum.__name__) else None
    members = {m.name: m for m in enum}
    if wanted == "DEFAULT":
        weights = enum.DEFAULT
    elif wanted in members:
        weights = members[wanted]
    else:
        default = enum.DEFAULT.name
        # argparse took a lower-case word after --pretrained for a name: a dataset folder that is not there?
        hint = f" (if {name} is the dataset folder, it does not exist)" if name == name.lower() else ""
        raise UserError(f"--pretrained {name}: {arch} has no such torchvision weights{hint}; choose one of "
                        f"{', '.join(sorted(members))}, or DEFAULT ({default})")
    evaluation = weights.transforms()
    return PretrainedWeights(arch, weights.name, weights.url, int(evaluation.resize_size[0]),
                             int(evaluation.crop_size[0]), float(weights.meta["_metrics"]["ImageNet-1K"]["acc@1"]))


def pretrained_state_dict(weights: PretrainedWeights) -> dict:
    """The state dict of ``weights`` from the local torch hub cache (never downloads)."""
    filename = os.path.basename(weights.url)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    if not os.path.isfile(path):
        raise UserError(f"--pretrained needs torchvision's {weights.arch} {weights.name} weights, which are not "
                        f"cached at {path}; this trainer never downloads: copy {filename} there "
                        "(or set TORCH_HOME), or use --weights PATH")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cached pretrained weights {path} could not be read ({type(e).__name__}); "
                        "delete the file and copy it again")


COMPILE_BACKEND_ENV = "IMAGENET_COMPILE_BACKEND"  # a torch.compile backend instead of Inductor (tests: eager)
DYNAMO_GRAPHS = 8  # torch's own recompile limit: graphs per function beside the ones a run plans for


def compile_model(model: nn.Module, mode: str, parallel: str, tune: bool = False, shapes: int = 1) -> nn.Module:
    """``torch.compile`` the (wrapped) training model unless ``mode`` is ``off``.

    Under DDP the DDP wrapper itself is compiled, so the graph is split at gradient-bucket
    boundaries and all-reduces still overlap the backward pass. DataParallel re-replicates the
    module on every forward, which compiled modules do not survive: it is refused.
    ``reduce-overhead`` also captures the forward and backward in CUDA graphs (static shapes:
    the trainer drops the last partial batch, so every training step has the same shape).
    ``dynamic=False``: a batch of another shape (unreadable files shorten one; a second run in
    one process at another batch size) compiles a static graph of its own, as the first shape
    did, instead of Dynamo's automatic switch to a graph with a symbolic batch size. On an H200 a
    16 px ResNet-18 (1x1 last feature maps) compiled fresh trained, while such a second compile
    in one process failed Inductor's stride check on a convolution's weight gradient.
    ``shapes``: the input shapes the run plans to compile (``--progressive-resize``'s sizes):
    Dynamo's limit of graphs per function is raised to hold them and torch's own 8 besides,
    since past it Dynamo would run the model uncompiled for good (pytorch/pytorch#139474).
    ``tune`` (``--tune-kernels``): Inductor tunes every generated kernel's block sizes and warps by
    coordinate descent, timing them on the first steps (minutes, cached on disk for later runs).
    ``IMAGENET_COMPILE_BACKEND`` (e.g. ``eager``, ``aot_eager``) compiles with that backend instead
    of Inductor, ``mode`` aside: Dynamo's capture and guards without Inductor's code generation,
    which is how the CPU tests count graphs in seconds.
    """
    if mode == "off":
        return model
    if parallel == "dp":
        raise UserError("--compile does not work with DataParallel; run one process per GPU instead: "
                        "python -m multiproc main.py ... --compile " + mode)
    if not hasattr(torch, "compile"):
        raise UserError(f"--compile needs torch >= 2.0; this is torch {torch.__version__}: drop --compile")
    raise_recompile_limit(shapes + DYNAMO_GRAPHS)
    backend = os.environ.get(COMPILE_BACKEND_ENV)
    if backend:
        return torch.compile(model, backend=backend, dynamic=False)
    if tune:
        inductor_tune_kernels()
    return torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
