"""A convolution that also returns its output's per-channel sum and sum of squares, made in the
convolution's epilogue by a cuDNN fusion graph (``--bn-kernel cudnn``).

Every convolution of a ResNet block feeds a training-mode BatchNorm, whose first pass over the
convolution's output only sums it per channel. cuDNN's runtime-fusion engines can add those sums
to the convolution itself (a ``conv_fprop`` node followed by ``genstats``, through the
``nvidia-cudnn-frontend`` package of requirements.txt, where its wheels exist), so the output is
not read again for its statistics. The BatchNorm's normalise then makes its mean and variance
from the two sums (:func:`imagenet.kernels.fusedbn.bn_act`).
The variance is E[y^2] - E[y]^2 in float32, as NVIDIA's MLPerf kernels compute it.

Each shape's graph is built once per process, outside CUDA graph capture (torch.compile's CUDA
graphs run each shape once first): the heuristics' first few plans are timed and the fastest
kept, as cuDNN's benchmark mode does for torch's convolutions. A shape cuDNN has no engine for
falls back to torch's convolution and sums, with one log line; any other error is raised. The op is a ``torch.library``
custom op with a fake implementation, so ``torch.compile`` keeps it and CUDA graphs capture it;
its backward is torch's own convolution backward. Only channels_last fp16/bf16 CUDA tensors of a
plain ``nn.Conv2d`` (no bias, groups or dilation) take it (:func:`applies`).
"""

import contextlib
import functools
import importlib
import logging
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PACKAGE = "nvidia-cudnn-frontend"
INSTALL = "pip install -r requirements.txt installs it on Linux, x86_64 or aarch64"  # its wheels' platforms
PLANS = 3  # the heuristics' first plans built and timed for a shape (each may compile a kernel)
MIN_BACKEND = 8800  # cuDNN 8.8: genstats after a convolution in the runtime-fusion engines
_DTYPES = (torch.float16, torch.bfloat16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests: torch's convolution and sums


@functools.lru_cache(maxsize=None)
def _frontend():
    """The ``cudnn`` module of the optional package, or None where it is missing or does not load."""
    try:
        return importlib.import_module("cudnn")
    except Exception:  # not installed, or its library does not load here
        return None


def why_unavailable(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the fused convolutions cannot run on ``device`` (None: they can); with ``dtype``, also
    whether cuDNN has an engine for them in that dtype (cuDNN 9.19 on an H200 has one for float16,
    none for bfloat16), asked of one small graph without building it. Never raises: a package that
    loads but cannot reach its cuDNN is a reason like any other."""
    if device.type != "cuda":
        return f"this run is on {device}"
    frontend = _frontend()
    if frontend is None:
        return f"the {PACKAGE} package is not installed ({INSTALL})"
    try:
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "cuDNN's runtime-fusion engines need a GPU of compute capability 8.0 or later"
        if frontend.backend_version() < MIN_BACKEND:
            return f"cuDNN {frontend.backend_version_string()} is older than 8.8, which added these fusions"
        if dtype is not None and not _supports(device.index if device.index is not None else
                                               torch.cuda.current_device(), dtype):
            return (f"cuDNN {frontend.backend_version_string()} has no engine for them in "
                    f"{str(dtype).replace('torch.', '')} here")
    except Exception as e:  # the package loads, its cuDNN or the GPU does not answer
        return f"{PACKAGE} could not reach cuDNN here ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return None


@functools.lru_cache(maxsize=None)
def _supports(index: int, dtype: torch.dtype) -> bool:
    """Whether cuDNN proposes a supported plan for a convolution + statistics in ``dtype`` on GPU
    ``index`` (a 64-channel 1x1 convolution of a [2, 64, 8, 8] channels_last input): the engines'
    support depends on the dtype, not on ResNet's shapes. No plan is built, so nothing compiles."""
    x = torch.empty((2, 64, 8, 8), dtype=dtype, device=f"cuda:{index}").contiguous(memory_format=torch.channels_last)
    w = torch.empty((64, 64, 1, 1), dtype=dtype, device=x.device).contiguous(memory_format=torch.channels_last)
    try:
        _PLANS.graph(x, w, [1, 1], [0, 0])
    except _Refused:
        return False
    return True


def applies(x: torch.Tensor, conv: nn.Module) -> bool:
    """Whether ``conv(x)`` can go through :func:`conv_stats_op`."""
    return (type(conv) is nn.Conv2d and conv.bias is None and conv.groups == 1 and conv.dilation == (1, 1)
            and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
            and (x.is_cuda or _INTERPRETED) and x.dim() == 4 and x.numel() > 0
            and (x.dtype in _DTYPES or (_INTERPRETED and x.dtype == torch.float32))
            and x.is_contiguous(memory_format=torch.channels_last))


class _Plan:
    """One shape's built cuDNN graph: ``run(x, w, y, sums, squares)`` on the current stream."""

    def __init__(self, graph, tensors: tuple, index: int, workspace: int, handle, frontend):
        self.graph, self.tensors, self.index, self.workspace = graph, tensors, index, workspace
        self.handle, self.frontend = handle, frontend

    def run(self, *data) -> None:
        self.frontend.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=data[0].device)
        self.graph.execute_plan_at_index(dict(zip(self.tensors, data)), workspace, index=self.index,
                                         handle=self.handle)


class _Refused(Exception):
    """cuDNN has no engine, or no plan that builds, for a graph."""


class _Plans:
    """The built graphs of this process, per device and shape, and a cuDNN handle per device
    (state of the op below, which torch calls without an owner to hand it). Not locked: the
    training thread is the only caller per device (DataParallel's threads each have their own
    device, so their own keys and handle)."""

    def __init__(self):
        self.handles: dict = {}
        self.plans: dict = {}  # key -> _Plan, or None where cuDNN refused the shape

    def get(self, x: torch.Tensor, w: torch.Tensor, stride: list, padding: list) -> Optional[_Plan]:
        key = (x.device.index, x.dtype, tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()),
               tuple(stride), tuple(padding))
        if key not in self.plans:
            if torch.cuda.is_current_stream_capturing():  # building allocates and compiles: not capturable
                raise RuntimeError(f"imagenet::conv_stats met input {list(x.shape)}, weight {list(w.shape)} for the "
                                   "first time inside a CUDA graph capture; run the shape once before capturing")
            try:
                self.plans[key] = self._build(x, w, stride, padding)
            except _Refused as e:  # no engine for this shape: torch's convolution and sums
                self.plans[key] = None
                logger.warning("=> note: cuDNN builds no fused convolution + statistics for input %s, weight %s, "
                               "stride %s (%s); that layer's statistics use torch's kernels", list(x.shape),
                               list(w.shape), list(stride), " ".join(str(e).split())[:200])
        return self.plans[key]

    def graph(self, x, w, stride, padding) -> tuple:
        """The checked (not yet built) cuDNN graph of ``x``'s convolution by ``w`` and its
        statistics, its tensors and handle; _Refused where cuDNN has no engine for it."""
        cudnn = _frontend()
        device = x.device
        if device.index not in self.handles:
            with torch.cuda.device(device):
                self.handles[device.index] = cudnn.create_handle()
        handle = self.handles[device.index]
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[x.dtype]
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def tensor(name, t, dtype):
            return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype)

        X, W = tensor("X", x, io), tensor("W", w, io)
        Y = graph.conv_fprop(name="conv", image=X, weight=W, padding=list(padding), stride=list(stride),
                             dilation=[1, 1])
        Y.set_output(True).set_data_type(io)
        SUM, SQ = graph.genstats(name="stats", input=Y)
        SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
        except cudnn.cudnnGraphNotSupportedError as e:
            raise _Refused(str(e)) from None
        return graph, (X, W, Y, SUM, SQ), handle

    def _build(self, x, w, stride, padding) -> _Plan:
        cudnn = _frontend()
        graph, tensors, handle = self.graph(x, w, stride, padding)
        data = (x, w, *_outputs(x, w, stride, padding))  # written by the plans' timing runs
        best, why = None, ""
        for index in range(min(graph.get_execution_plan_count(), PLANS)):
            try:
                graph.build_plan_at_index(index)
            except cudnn.cudnnGraphNotSupportedError as e:  # e.g. its kernel does not compile: the next
                why = str(e)
                continue
            plan = _Plan(graph, tensors, index, graph.get_workspace_size_plan_at_index(index), handle, cudnn)
            ms = _time(plan, data)
            if best is None or ms < best[0]:
                best = (ms, plan)
        if best is None:
            raise _Refused(why or "no execution plan")
        return best[1]


def _time(plan: _Plan, data: tuple, repeats: int = 3) -> float:
    """Milliseconds of ``repeats`` runs of ``plan`` after one (the shape's first call only)."""
    plan.run(*data)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        plan.run(*data)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


_PLANS = _Plans()


def _output_shape(x_shape, w_shape, stride, padding) -> tuple:
    n, _, h, w = x_shape
    k, _, r, s = w_shape
    return n, k, (h + 2 * padding[0] - r) // stride[0] + 1, (w + 2 * padding[1] - s) // stride[1] + 1


def _outputs(x: torch.Tensor, weight: torch.Tensor, stride, padding) -> tuple:
    """Empty (output, sums, squares) of a convolution of ``x`` by ``weight``, the sums shaped
    [1, K, 1, 1] as cuDNN's graph declares them."""
    k = weight.shape[0]
    y = torch.empty(_output_shape(x.shape, weight.shape, stride, padding), dtype=x.dtype, device=x.device,
                    memory_format=torch.channels_last)
    return y, x.new_empty((1, k, 1, 1), dtype=torch.float32), x.new_empty((1, k, 1, 1), dtype=torch.float32)


@torch.library.custom_op("imagenet::conv_stats", mutates_args=())
def conv_stats_op(x: torch.Tensor, weight: torch.Tensor, stride: list[int],
                  padding: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conv2d(x, weight), its per-channel sum, its per-channel sum of squares), the sums float32."""
    x = x.contiguous(memory_format=torch.channels_last)
    weight = weight.contiguous(memory_format=torch.channels_last)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        plan = _PLANS.get(x, weight, stride, padding) if x.is_cuda else None
        if plan is not None:
            y, sums, squares = _outputs(x, weight, stride, padding)
            plan.run(x, weight, y, sums, squares)
            return y, sums.view(-1), squares.view(-1)
    # a shape cuDNN refused (or the CPU tests): torch's convolution and float32 sums (the squares
    # summed as such: a norm squared again rounds them enough to matter where the variance is small)
    y = F.conv2d(x, weight, stride=stride, padding=padding).contiguous(memory_format=torch.channels_last)
    y32 = y.float()
    return y, y32.sum((0, 2, 3)), y32.square().sum((0, 2, 3))


@conv_stats_op.register_fake
def _(x, weight, stride, padding):
    y, sums, squares = _outputs(x, weight, stride, padding)
    return y, sums.view(-1), squares.view(-1)


def _setup_context(ctx, inputs, output):
    x, weight, stride, padding = inputs
    ctx.save_for_backward(x, weight)
    ctx.stride, ctx.padding = stride, padding
    ctx.mark_non_differentiable(output[1], output[2])  # the BatchNorm's backward accounts for them


def _backward(ctx, dy, _dsums, _dsquares):
    x, weight = ctx.saved_tensors
    dx, dw, _ = torch.ops.aten.convolution_backward(
        dy.contiguous(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last),
        weight.contiguous(memory_format=torch.channels_last), None, ctx.stride, ctx.padding, [1, 1], False,
        [0, 0], 1, [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False])
    return dx, dw, None, None


conv_stats_op.register_autograd(_backward, setup_context=_setup_context)


def conv_stats(x: torch.Tensor, conv: nn.Conv2d) -> tuple:
    """``conv(x)`` with its output's per-channel (sum, sum of squares), where :func:`applies`;
    the weight in ``x``'s dtype (autocast's cast, which a custom op does not get by itself)."""
    weight = conv.weight if conv.weight.dtype == x.dtype else conv.weight.to(x.dtype)
    return conv_stats_op(x, weight, list(conv.stride), list(conv.padding))
