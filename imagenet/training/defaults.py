"""Fast by default: what ``auto`` means for a run on this machine.

On a GPU the plain command (``main.py DIR -a resnet50 -b 256 --fp16``) trains in the fastest mode
that is safe for it: channels_last tensors, the stem max-pool and the fused BatchNorm + add +
ReLU on our Triton kernels, and the model compiled with CUDA graphs (``--compile
reduce-overhead``), and JPEGs decoded on the GPU where too few CPU cores per GPU would decode
them (``--decode auto``, decided by :func:`imagenet.data.gpu.choice.choose`). On a CPU nothing
changes. :func:`resolve`
decides each of them from the config and the machine alone (a pure function, so tests can ask it
about any machine), and returns every choice it made by itself with its reason and the flag that
changes it, for the banner. A flag the user gave is never overridden; a combination that cannot take a fast path
falls back to torch's with a line saying why, never an error.

What each choice gives, per mode and machine, is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ..base.config import CUDA_GRAPH_MODES, Config, decode_share
from ..base.processenv import INDUCTOR_CACHE, MAX_CONNECTIONS, MAX_CONNECTIONS_VALUE, ProcessEnv
from ..data.gpu.choice import choose as choose_decode
from ..data.gpu.choice import gpu_decoder_available
from ..data.probe import images_are_jpeg
from ..models.registry import has_grouped_convolutions


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity: a batch scheduler's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_processes(ctx) -> int:
    """Training processes on this machine, which share its CPU cores: under DDP the launcher's
    ``LOCAL_WORLD_SIZE`` (multiproc and torchrun set it), else as many as the world has GPUs here."""
    if not ctx.distributed:
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    import torch
    return max(min(ctx.world_size, torch.cuda.device_count()), 1)


@dataclass(frozen=True)
class Machine:
    """What the speed defaults depend on besides the config."""

    device: str  # "cuda" or "cpu": the training device's type
    mode: str  # the launch mode (DistContext.mode): cpu | gpu | dp | ddp
    triton: bool  # Triton compiles for this GPU (our kernels and Inductor's need it)
    cpus_per_gpu: int = 1  # CPU cores of this machine over the GPUs training on it (--decode auto)
    gpus_per_process: int = 1  # GPUs this process's data workers feed (DataParallel: all of them)
    gpu_decode: bool = False  # a JPEG decoder here decodes on the GPU (imagenet.data.gpu.jpeg)
    jpeg: Optional[bool] = None  # the training images are JPEGs (None: not known, e.g. behind a URL)
    # why cuDNN's fused convolution + statistics cannot run here (None: they can; --bn-kernel auto)
    no_conv_stats: Optional[str] = "not looked up"

    @classmethod
    def of(cls, ctx, decode: str = "auto", data: Optional[str] = None, bn_kernel: str = "auto",
           half_dtype: Optional[str] = "float16") -> "Machine":
        """This process's machine, from its launch context. Whether a GPU JPEG decoder runs here
        is looked up (a probe decode on the GPU), and whether ``data``'s training images are
        JPEGs (no ``data``: the built-in dataset, PNGs), only for ``--decode auto`` on a GPU, the
        one choice they decide; ``--decode gpu`` finds its decoder when the loaders are built.
        Whether cuDNN's fused statistics run here, only for ``--bn-kernel auto|cudnn`` on a GPU, in
        the convolutions' dtype (Config.half_dtype; fp32 runs, None, do not use them)."""
        import torch

        from ..kernels.convstats import why_unavailable
        from ..kernels.compiles import available
        cuda = ctx.device.type == "cuda"
        gpus_per_process = len(ctx.device_ids) if ctx.mode == "dp" else 1
        gpus_here = local_processes(ctx) * gpus_per_process
        auto = cuda and decode == "auto"
        jpeg = (images_are_jpeg(data) if data else False) if auto else None
        return cls(ctx.device.type, ctx.mode, cuda and available(), cpus_per_gpu=max(usable_cpus() // gpus_here, 1),
                   gpus_per_process=gpus_per_process, gpu_decode=auto and gpu_decoder_available(), jpeg=jpeg,
                   no_conv_stats=why_unavailable(ctx.device, getattr(torch, half_dtype))
                   if cuda and bn_kernel in ("auto", "cudnn") and half_dtype else "not looked up")


@dataclass(frozen=True)
class Choice:
    """One decision the trainer took by itself: what, why, and the flag that changes it."""

    what: str
    why: str
    flag: str

    def line(self) -> str:
        return f"{self.what}: {self.why} ({self.flag})"


@dataclass(frozen=True)
class SpeedPlan:
    """The resolved layout, kernels and compilation of a run, and the choices behind them."""

    channels_last: bool
    maxpool_kernel: str  # torch | triton
    bn_kernel: str  # torch | triton | cudnn
    compile: str  # off | default | reduce-overhead | max-autotune
    tune_kernels: bool
    decode: str = "cpu"  # cpu | gpu: where JPEGs are decoded
    optimizer_impl: str = "foreach"  # triton | fused | foreach
    choices: tuple = ()
    notes: tuple = ()  # what the banner should say of the user's own settings (str)
    environment: tuple = ()  # (name, value) the trainer set in its environment, for config.yaml

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with every ``auto`` replaced by what this plan chose."""
        return dataclasses.replace(cfg, channels_last=self.channels_last, maxpool_kernel=self.maxpool_kernel,
                                   bn_kernel=self.bn_kernel, compile=self.compile, tune_kernels=self.tune_kernels,
                                   decode=self.decode, optimizer_impl=self.optimizer_impl)


def resolved(cfg: Config, ctx) -> Config:
    """``cfg`` as it runs in the launch context ``ctx``: unchanged where nothing is ``auto`` (the
    runner resolves once, up front); else resolved here, for callers that build a training state
    from a config of their own (benchmarks, tests)."""
    autos = (cfg.compile, cfg.bn_kernel, cfg.decode, cfg.optimizer_impl)
    if cfg.channels_last is not None and "auto" not in autos:
        return cfg
    return resolve(cfg, Machine.of(ctx, cfg.decode, cfg.data, cfg.bn_kernel, cfg.half_dtype)).apply(cfg)


def _compile_fallback(cfg: Config, machine: Machine) -> Optional[str]:
    """Why ``--compile auto`` does not compile here (None: it compiles)."""
    if machine.device != "cuda":
        return None  # said once for the whole CPU plan
    if cfg.evaluate:
        return "-e evaluates once; compiling would take longer than it saves"
    if machine.mode == "dp":
        return ("DataParallel re-replicates the model every step, which compiled models do not survive; "
                "python -m multiproc main.py ... runs one process per GPU and compiles")
    if not machine.triton:
        return "torch.compile needs Triton for this GPU, and this torch has none that compiles for it"
    if cfg.deterministic:
        return "--deterministic runs torch's own deterministic kernels, uncompiled"
    if cfg.sync_bn:
        return "--sync-bn's collectives inside the forward pass run uncompiled"
    if cfg.blurpool:
        return ("--blurpool's model under torch.compile did not reach its first step in 80 s on an H100, where the "
                "plain model's compiles in 30 s (docs/PERFORMANCE.md)")
    return None


def _bn_fallback(cfg: Config, machine: Machine, channels_last: bool) -> Optional[str]:
    """Why ``--bn-kernel auto`` keeps torch's BatchNorm here (None: the fused kernels run)."""
    if machine.device != "cuda":
        return None
    if cfg.evaluate:
        return "-e evaluates, and the fused kernels are training's (evaluation takes torch's)"
    if not machine.triton:
        return "the fused kernels need Triton for this GPU"
    if machine.mode == "dp":
        return "the fused kernels are not verified under DataParallel's replicas; python -m multiproc main.py ... runs them"
    if not channels_last:
        return "the fused kernels compute channels_last tensors only"
    if cfg.sync_bn:
        return "--sync-bn needs torch's SyncBatchNorm (the kernels compute per-process statistics)"
    if cfg.deterministic:
        return "--deterministic runs torch's own deterministic kernels"
    return None


def _one_pass_fallback(cfg: Config, machine: Machine) -> Optional[str]:
    """Why ``--optimizer-impl auto`` does not step ``--fp16``'s masters in the Triton kernels here
    (None: it does)."""
    if not cfg.fp16:
        return "the kernels step --fp16's fp32 master weights, and this run has none"
    if machine.device == "cuda" and not machine.triton:
        return "the kernels need Triton for this GPU"
    if cfg.clip_grad_norm is not None:
        return "--clip-grad-norm needs the unscaled gradients beside the masters"
    return None


def _conv_stats_fallback(cfg: Config, machine: Machine, compile_mode: str) -> Optional[str]:
    """Why ``--bn-kernel auto``'s fused BatchNorm does not take its statistics from cuDNN's fused
    convolutions here (None: it does)."""
    if cfg.half_dtype is None:  # before the machine's answer: an fp32 run does not ask cuDNN
        return "which serve half-precision convolutions (--fp16, --amp), and this run is fp32"
    if machine.no_conv_stats is not None:
        return f"as {machine.no_conv_stats}"
    if compile_mode not in CUDA_GRAPH_MODES:  # CUDA graphs replay the launches
        return "as without CUDA graphs each of their graphs would be launched from Python"
    return None


def _grouped_exception(cfg: Config) -> str:
    """What of ``--bn-kernel cudnn`` the architecture keeps on the Triton statistics, as a clause
    ('' where nothing): the grouped convolutions, which :func:`imagenet.kernels.convstats.applies`
    does not hand to cuDNN (its fused convolution + statistics is built for ungrouped ones)."""
    if not has_grouped_convolutions(cfg.arch):
        return ""
    return (f", except after {cfg.arch}'s grouped 3x3 convolutions, which cuDNN's fused convolution + statistics "
            "does not take (those BatchNorms make their statistics in a Triton pass of their own)")


def resolve(cfg: Config, machine: Machine) -> SpeedPlan:
    """The layout, kernels and compile mode of a run of ``cfg`` on ``machine``: the flags the user
    gave, and for each ``auto`` the fastest safe choice (see the module's docstring)."""
    choices = []
    gpu = machine.device == "cuda"
    explicit_kernel = cfg.bn_kernel in ("triton", "cudnn") or cfg.maxpool_kernel == "triton"
    if cfg.channels_last is None:
        channels_last = gpu or explicit_kernel
        if gpu:
            choices.append(Choice("channels_last", "the fastest layout for cuDNN's convolutions and our kernels",
                                  "--no-channels-last for contiguous tensors"))
    else:
        channels_last = cfg.channels_last

    maxpool = cfg.maxpool_kernel
    if maxpool == "auto":
        maxpool = "triton" if gpu and machine.triton and channels_last and not cfg.small_stem else "torch"
        if maxpool == "triton":
            choices.append(Choice("stem max-pool on Triton kernels", "2.7 -> 0.7 ms a ResNet-50 step",
                                  "--maxpool-kernel torch"))

    bn = cfg.bn_kernel
    if bn == "auto":
        why_not = _bn_fallback(cfg, machine, channels_last)
        bn = "triton" if gpu and why_not is None else "torch"
        if bn == "torch" and gpu:
            choices.append(Choice("BatchNorm on torch's kernels", why_not, "--bn-kernel triton asks for the fused ones"))

    compile_mode, tune = cfg.compile, cfg.tune_kernels
    if compile_mode == "auto":
        why_not = _compile_fallback(cfg, machine)
        if not gpu or why_not is not None:
            compile_mode = "off"
            if gpu:
                choices.append(Choice("not compiled", why_not, "--compile MODE asks for it"))
        else:
            compile_mode = "reduce-overhead"
            choices.append(Choice("torch.compile with CUDA graphs (reduce-overhead)",
                                  "the fastest mode; the first steps wait for the compilation, which later runs "
                                  "read from the cache", "--compile off skips it"))
    if bn == "triton" and cfg.bn_kernel == "auto":
        why_stats = _conv_stats_fallback(cfg, machine, compile_mode)
        if why_stats is None:
            bn = "cudnn"
            choices.append(Choice("BatchNorm + add + ReLU fused in Triton, statistics made by cuDNN's fused "
                                  "convolutions", "one pass each way instead of torch's separate kernels, and no "
                                  f"pass of its own for the statistics{_grouped_exception(cfg)}",
                                  "--bn-kernel triton, or torch"))
        else:
            choices.append(Choice("BatchNorm + add + ReLU fused in Triton",
                                  "one pass each way instead of torch's separate kernels; their statistics are not "
                                  f"made by cuDNN's fused convolutions, {why_stats}", "--bn-kernel torch"))
    notes = []
    if cfg.bn_kernel == "cudnn" and cfg.half_dtype is not None and _grouped_exception(cfg):
        notes.append("--bn-kernel cudnn: the statistics are made by cuDNN's fused convolutions" + _grouped_exception(cfg))
    if cfg.bn_kernel == "cudnn" and cfg.half_dtype is None:
        notes.append("--bn-kernel cudnn: cuDNN's fused statistics serve half-precision convolutions (--fp16, --amp); "
                     "in this fp32 run the Triton kernels make them")
    optimizer_impl, why_not = cfg.optimizer_impl, _one_pass_fallback(cfg, machine)
    if optimizer_impl == "auto":
        optimizer_impl = ("triton" if why_not is None else "fused") if gpu else "foreach"
        if optimizer_impl == "triton":
            choices.append(Choice("--fp16's optimizer step in two Triton kernels",
                                  "an inf/NaN check of the fp16 gradients, then one pass to the fp32 masters, "
                                  "momentum and fp16 weights: 22 bytes a parameter, not torch's 40",
                                  "--optimizer-impl fused for torch's fused SGD"))
        elif gpu and cfg.fp16:
            choices.append(Choice("--fp16's optimizer step on torch's fused SGD", why_not,
                                  "--optimizer-impl foreach for torch's multi-tensor SGD"))
    elif optimizer_impl == "triton" and why_not is not None:
        optimizer_impl = "fused" if gpu else "foreach"
        notes.append(f"--optimizer-impl triton: torch's {'fused' if gpu else 'multi-tensor'} SGD steps this run, as "
                     f"{why_not}")
    if tune and compile_mode == "off":
        tune = False
        choices.append(Choice("--tune-kernels ignored", "nothing is compiled in this run", "--compile default"))
    if not gpu and cfg.channels_last is None and cfg.compile == "auto" and cfg.bn_kernel == "auto":
        choices.append(Choice("contiguous tensors, torch's kernels, not compiled",
                              "the GPU fast path would not make a CPU run faster", "--channels-last, --compile MODE"))
    decode = choose_decode(cfg, cuda=gpu, cpus_per_gpu=machine.cpus_per_gpu,
                           gpus_per_process=machine.gpus_per_process, gpu_decoder=machine.gpu_decode,
                           jpeg=machine.jpeg)
    if cfg.decode == "auto" and not cfg.dummy and gpu:  # a CPU run decodes in its workers, as it always did
        choices.append(Choice(decode.what, decode.why, decode.flag))
    share = decode_share(cfg)
    if decode.decode == "gpu" and share is None and not cfg.dummy:
        choices.append(Choice("the workers decode a share of the training JPEGs while the GPU decode sets the pace",
                              "one thread makes the GPU decoder's calls, and at small sizes it can fall behind the "
                              "step while the workers have CPU to spare; the share starts at 0 and follows that "
                              "thread's load", "--decode-share 0 keeps every JPEG on the GPU"))
    elif decode.decode == "cpu" and str(cfg.decode_share).lower() != "auto":
        notes.append(f"--decode-share {cfg.decode_share} is left unused: the workers decode every image ({decode.why})")
    return SpeedPlan(channels_last, maxpool, bn, compile_mode, tune, decode.decode, optimizer_impl, tuple(choices),
                     tuple(notes))


def with_environment(plan: SpeedPlan, env: ProcessEnv, device: str) -> SpeedPlan:
    """``plan`` with what :mod:`imagenet.base.processenv` set for this run: CUDA's hardware queue
    count on a GPU and Inductor's cache folder when compiling (a banner line and config.yaml's
    comment for each), and a note where the user's own queue count holds the GPU's input back."""
    choices, notes, recorded = [], [], []
    if device == "cuda":
        if MAX_CONNECTIONS in env.ours:
            choices.append(Choice(f"{MAX_CONNECTIONS}={env.ours[MAX_CONNECTIONS]}",
                                  "a hardware queue for every CUDA stream, so the input's copies and GPU decode run "
                                  "beside the step's CUDA graph instead of queuing behind it",
                                  f"set {MAX_CONNECTIONS} in the environment to choose another"))
            recorded.append((MAX_CONNECTIONS, env.ours[MAX_CONNECTIONS]))
        elif not env.users.get(MAX_CONNECTIONS, "").isdigit() or int(env.users[MAX_CONNECTIONS]) < 32:
            notes.append(f"{MAX_CONNECTIONS}={env.users.get(MAX_CONNECTIONS)} from the environment: streams share "
                         f"hardware queues, so the input's copies and GPU decode can wait behind the step's CUDA "
                         f"graph (the trainer sets {MAX_CONNECTIONS_VALUE} when it is unset)")
    if plan.compile != "off" and INDUCTOR_CACHE in env.ours:
        recorded.append((INDUCTOR_CACHE, env.ours[INDUCTOR_CACHE]))
    return dataclasses.replace(plan, choices=tuple(choices) + plan.choices, notes=plan.notes + tuple(notes),
                               environment=plan.environment + tuple(recorded))
