"""Training-mode BatchNorm fused with the residual add and the ReLU, as ``torch.library`` ops
with their autograd rules (``--bn-kernel triton|cudnn``).

:func:`bn_act` is ``relu(bn(x) + residual)`` for a BatchNorm module: where :func:`takes` (a plain
``nn.BatchNorm2d`` in training mode on a channels_last CUDA tensor, or under
``TRITON_INTERPRET=1``) it runs the Triton kernels (:mod:`imagenet.kernels.bnlaunch`), else
torch's modules. Forward, ``imagenet::bn_stats`` makes the batch's statistics and updates the
running ones (so it has no gradient of its own) and ``imagenet::bn_act`` normalises, adds and
applies the ReLU; its autograd rule calls ``imagenet::bn_act_backward``, the whole input
gradient, through the statistics too. A block's output read by two layers (the next block's
convolution and its shortcut) is forked (:class:`_ForkedBnAct`), so the backward adds its two
gradients as it loads them instead of autograd summing them in a pass of its own. A block's
shortcut BatchNorm (the downsample's) is applied by the residual add as it loads the shortcut
convolution's raw output, and its gradients come out of the add's own backward passes.

With ``--bn-kernel cudnn`` :func:`conv_bn_act` takes the statistics' pass away: the convolution
makes its output's per-channel sums (:mod:`imagenet.kernels.convstats`) and
``imagenet::bn_act_from_sums`` turns them into the mean and 1/std inside the normalise; it
changes the running statistics, so its gradient comes from an autograd Function
(:class:`_BnActFromSums`). The ops are opaque to ``torch.compile`` and CUDA graphs capture them;
the fused ResNet blocks that call them are :mod:`imagenet.models.fusedresnet`.
"""

import os  # no "from __future__ import annotations": torch.library reads the op signatures' annotations
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import convstats
from .bnlaunch import (MASK_FROM_BITS, MASK_NONE, Shortcut, ShortcutSums, Sums, gradient_sums, input_gradients,
                       mask_bits, mask_kind, normalise, normalise_from_sums, statistics, statistics_from_sums,
                       to_channels_last)
from .bntriton import triton

# Triton reads TRITON_INTERPRET when it defines the kernels; read here once too, so that takes()
# inside torch.compile reads no environment (which breaks the graph on torch before 2.5)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def takes(x: torch.Tensor, bn: nn.Module) -> bool:
    """Whether ``bn(x)`` (with its add and ReLU) goes through the kernels."""
    return (triton is not None and bn.training and type(bn) is nn.BatchNorm2d and bn.affine
            and bn.track_running_stats and bn.momentum is not None and (x.is_cuda or _INTERPRETED)
            and x.dim() == 4 and x.dtype in _DTYPES
            and x.is_contiguous(memory_format=torch.channels_last) and x.numel() > 0
            and x.shape[0] * x.shape[2] * x.shape[3] > 1)


@torch.library.custom_op("imagenet::bn_stats", mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def bn_stats_op(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                num_batches_tracked: torch.Tensor, momentum: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`statistics` as an op (no gradient: :func:`bn_act_op`'s backward accounts for the
    statistics' dependence on ``x``)."""
    return statistics(to_channels_last(x), running_mean, running_var, momentum, eps, num_batches_tracked)


@bn_stats_op.register_fake
def _(x, running_mean, running_var, num_batches_tracked, momentum, eps):
    c = x.shape[1]
    return x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)



@torch.library.custom_op("imagenet::bn_stats_from_sums",
                         mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def bn_stats_from_sums_op(sums: torch.Tensor, squares: torch.Tensor, count: int, running_mean: torch.Tensor,
                          running_var: torch.Tensor, num_batches_tracked: torch.Tensor, momentum: float,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`statistics_from_sums` as an op (no gradient, as :func:`bn_stats_op`)."""
    return statistics_from_sums(sums, squares, count, running_mean, running_var, momentum, eps, num_batches_tracked)


@bn_stats_from_sums_op.register_fake
def _(sums, squares, count, running_mean, running_var, num_batches_tracked, momentum, eps):
    return torch.empty_like(sums), torch.empty_like(sums)


def _shortcut_of(res_weight, res_bias, res_mean, res_invstd) -> Optional[Shortcut]:
    return Shortcut(res_weight, res_bias, res_mean, res_invstd) if res_mean is not None else None


@torch.library.custom_op("imagenet::bn_act", mutates_args=())
def bn_act_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: Optional[torch.Tensor],
              mean: torch.Tensor, invstd: torch.Tensor, relu: bool, res_weight: Optional[torch.Tensor],
              res_bias: Optional[torch.Tensor], res_mean: Optional[torch.Tensor],
              res_invstd: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(relu(bn(x) + residual) with ``x``'s batch statistics (mean, 1/std) from :func:`bn_stats_op`,
    the ReLU's mask bits for the backward or an empty tensor: :func:`normalise`); with the
    ``res_*`` tensors, ``residual`` is the raw input of that shortcut BatchNorm (:class:`Shortcut`)."""
    return normalise(to_channels_last(x), to_channels_last(residual) if residual is not None else None, mean, invstd, weight, bias, relu,
                     _shortcut_of(res_weight, res_bias, res_mean, res_invstd))


def _fake_bn_act(x, residual, relu) -> tuple:
    y = torch.empty_like(x, memory_format=torch.channels_last)
    if mask_kind(relu, residual is not None) == MASK_FROM_BITS:
        return y, mask_bits(x)
    return y, x.new_empty(0, dtype=torch.int32)


@bn_act_op.register_fake
def _(x, weight, bias, residual, mean, invstd, relu, res_weight, res_bias, res_mean, res_invstd):
    return _fake_bn_act(x, residual, relu)


@torch.library.custom_op("imagenet::bn_act_from_sums",
                         mutates_args=("running_mean", "running_var", "num_batches_tracked", "res_running_mean",
                                       "res_running_var", "res_num_batches_tracked"))
def bn_act_from_sums_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: Optional[torch.Tensor],
                        relu: bool, sums: torch.Tensor, squares: torch.Tensor, running_mean: torch.Tensor,
                        running_var: torch.Tensor, num_batches_tracked: torch.Tensor, momentum: float, eps: float,
                        res_weight: Optional[torch.Tensor], res_bias: Optional[torch.Tensor],
                        res_sums: Optional[torch.Tensor], res_squares: Optional[torch.Tensor],
                        res_running_mean: Optional[torch.Tensor], res_running_var: Optional[torch.Tensor],
                        res_num_batches_tracked: Optional[torch.Tensor], res_momentum: float,
                        res_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor]:
    """:func:`bn_act_op` with the statistics made in its kernel from the convolutions' sums
    (:func:`normalise_from_sums`): (y, bits, mean, 1/std, and the shortcut BatchNorm's mean and
    1/std where the ``res_*`` tensors are given, else empty tensors). It updates the running
    statistics and batch counts as :func:`bn_stats_from_sums_op` does; its gradient is
    :class:`_BnActFromSums`' (an op that changes its inputs cannot have one registered)."""
    shortcut = None
    if res_sums is not None:
        shortcut = ShortcutSums(res_weight, res_bias, Sums(res_sums, res_squares, res_running_mean, res_running_var,
                                                           res_num_batches_tracked, res_momentum, res_eps))
    y, bits, mean, invstd, res_mean, res_invstd = normalise_from_sums(
        to_channels_last(x), to_channels_last(residual) if residual is not None else None, weight, bias, relu,
        Sums(sums, squares, running_mean, running_var, num_batches_tracked, momentum, eps), shortcut)
    if shortcut is None:  # two tensors: a custom op's outputs may not alias each other
        res_mean, res_invstd = x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.float32)
    return y, bits, mean, invstd, res_mean, res_invstd


@bn_act_from_sums_op.register_fake
def _(x, weight, bias, residual, relu, sums, squares, running_mean, running_var, num_batches_tracked, momentum, eps,
      res_weight, res_bias, res_sums, res_squares, res_running_mean, res_running_var, res_num_batches_tracked,
      res_momentum, res_eps):
    y, bits = _fake_bn_act(x, residual, relu)
    c = x.shape[1]
    stats = [x.new_empty(c, dtype=torch.float32) for _ in range(2)]
    shortcut = [x.new_empty(c if res_sums is not None else 0, dtype=torch.float32) for _ in range(2)]
    return y, bits, *stats, *shortcut


@torch.library.custom_op("imagenet::bn_act_backward", mutates_args=())
def bn_act_backward(dy: torch.Tensor, dy2: Optional[torch.Tensor], x: torch.Tensor, bits: Optional[torch.Tensor],
                    mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: int,
                    has_res: bool, residual: Optional[torch.Tensor], res_weight: Optional[torch.Tensor],
                    res_bias: Optional[torch.Tensor], res_mean: Optional[torch.Tensor],
                    res_invstd: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dresidual or an empty tensor, and the shortcut BatchNorm's dweight and
    dbias or empty tensors) of :func:`bn_act_op`, the output's gradient ``dy`` plus ``dy2``
    where it was forked (:class:`_ForkedBnAct`). With a residual, the gradient-sums pass writes
    the masked gradient (the residual's gradient), and the input-gradient pass reads that one
    tensor instead of both gradients and the mask; with a shortcut BatchNorm, that pass also
    makes its gradient sums, and one more pass its input's gradient."""
    dy, x = to_channels_last(dy), to_channels_last(x)
    dy2 = to_channels_last(dy2) if dy2 is not None else None
    sc = _shortcut_of(res_weight, res_bias, res_mean, res_invstd)
    raw = to_channels_last(residual) if sc is not None else None
    sg, sgx, dw, db, g, sums_r = gradient_sums(dy, x, bits, mean, invstd, weight, bias, mask, dy2, keep_g=has_res,
                                               shortcut=(raw, sc) if sc is not None else None)
    if has_res:
        dx = input_gradients(g, x, None, mean, invstd, weight, bias, sg, sgx, MASK_NONE)
    else:
        dx = input_gradients(dy, x, bits, mean, invstd, weight, bias, sg, sgx, mask, dy2)
    if sc is None:
        return dx, dw, db, g, x.new_empty(0), x.new_empty(0)
    sgr, dw_r, db_r = sums_r
    return dx, dw, db, input_gradients(g, raw, None, sc.mean, sc.invstd, sc.weight, sc.bias, sg, sgr, MASK_NONE), \
        dw_r, db_r


@bn_act_backward.register_fake
def _(dy, dy2, x, bits, mean, invstd, weight, bias, mask, has_res, residual, res_weight, res_bias, res_mean,
      res_invstd):
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    dr = torch.empty_like(x, memory_format=torch.channels_last) if has_res else x.new_empty(0)
    if res_mean is None:
        return dx, torch.empty_like(weight), torch.empty_like(bias), dr, x.new_empty(0), x.new_empty(0)
    return dx, torch.empty_like(weight), torch.empty_like(bias), dr, torch.empty_like(res_weight), \
        torch.empty_like(res_bias)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, mean, invstd, relu, res_weight, res_bias, res_mean, res_invstd = inputs
    y, bits = output
    ctx.mask = mask_kind(relu, residual is not None)
    ctx.has_res = residual is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    # the mask's bits, not the output: y is read again only by the next layer (which keeps it
    # for its own backward), and the backward reads a sixteenth of the bytes; the raw residual
    # only where its shortcut BatchNorm's gradient is made here
    shortcut = res_mean is not None
    ctx.save_for_backward(x, bits if ctx.mask == MASK_FROM_BITS else None, mean, invstd, weight, bias,
                          residual if shortcut else None, res_weight, res_bias, res_mean, res_invstd)


def _backward_rule(ctx, dy, dy2=None):
    # the whole gradient of x, through the statistics too: mean and invstd get none
    x, bits, mean, invstd, weight, bias, raw, res_weight, res_bias, res_mean, res_invstd = ctx.saved_tensors
    # channels_last here, where torch.compile sees it: Inductor then writes the gradient in that
    # layout in the kernel that makes it (the last layer's, from the average pool, comes
    # broadcast) instead of the op copying it in a pass of its own
    dy, dy2 = to_channels_last(dy), (to_channels_last(dy2) if dy2 is not None else None)
    dx, dw, db, dr, dw_r, db_r = bn_act_backward(dy, dy2, x, bits, mean, invstd, weight, bias, ctx.mask, ctx.has_res,
                                                 raw, res_weight, res_bias, res_mean, res_invstd)
    if ctx.has_res and dr.dtype != ctx.residual_dtype:
        dr = dr.to(ctx.residual_dtype)
    shortcut = res_mean is not None
    return (dx, dw, db, (dr if ctx.has_res else None), None, None, None, dw_r if shortcut else None,
            db_r if shortcut else None, None, None)


def _op_backward(ctx, dy, _dbits):
    return _backward_rule(ctx, dy)


bn_act_op.register_autograd(_op_backward, setup_context=_setup_context)


class _ForkedBnAct(torch.autograd.Function):
    """:func:`bn_act_op` with its output returned twice (one tensor and a view of it), for a block
    output that two layers read: the next block's first convolution and its shortcut. Autograd
    would sum their two gradients in a pass of its own (read two, write one) before the backward
    read the sum; apart, the gradient-sums kernel adds them in float32 as it loads them: one pass
    over the tensor fewer. The arithmetic is bn_act_op's; that sum is rounded to the
    activations' dtype only where it is stored (the residual's gradient, which the input-gradient
    pass reads back), as torch's sum would be. (A custom op may not return aliases, hence a Function.)
    Autograd hands an unused output's gradient in as zeros: right, one read dearer. Neither output
    may be changed in place (autograd refuses it: one is a view of the other); the fused blocks
    never do."""

    @staticmethod
    def forward(ctx, *inputs):
        y, bits = bn_act_op(*inputs)
        _setup_context(ctx, inputs, (y, bits))
        return y, y.view_as(y)

    @staticmethod
    def backward(ctx, dy, dy2):
        return _backward_rule(ctx, dy, dy2)


class _BnActFromSums(torch.autograd.Function):
    """:func:`bn_act_from_sums_op`, one tensor out, or with ``fork`` a pair as :class:`_ForkedBnAct`'s;
    the gradient is :func:`bn_act_op`'s, from the statistics the op stored."""

    @staticmethod
    def forward(ctx, fork, x, weight, bias, residual, relu, *stats):
        # stats: the BatchNorm's _sums_args, then the shortcut's weight, bias and _sums_args (Nones without one)
        y, bits, mean, invstd, res_mean, res_invstd = bn_act_from_sums_op(x, weight, bias, residual, relu, *stats)
        res_weight, res_bias, res_sums = stats[_SUMS_ARGS:_SUMS_ARGS + 3]
        shortcut = (res_weight, res_bias, res_mean, res_invstd) if res_sums is not None else (None, None, None, None)
        _setup_context(ctx, (x, weight, bias, residual, mean, invstd, relu, *shortcut), (y, bits))
        return (y, y.view_as(y)) if fork else y

    @staticmethod
    def backward(ctx, dy, dy2=None):
        dx, dw, db, dr, _, _, _, dw_r, db_r, _, _ = _backward_rule(ctx, dy, dy2)
        none = (None,) * _SUMS_ARGS  # the sums, the buffers and the floats get no gradient
        return (None, dx, dw, db, dr, None, *none, dw_r, db_r, *none)


def _statistics(x: torch.Tensor, bn: nn.BatchNorm2d, sums: Optional[tuple]) -> tuple:
    """The batch's (mean, 1/std) of ``x`` for ``bn``, from a pass of their own or from ``sums``;
    the running statistics and the batch count (read only where momentum is None: never here)
    updated as nn.BatchNorm2d does, by the kernels that make the statistics."""
    if sums is None:
        return bn_stats_op(x.detach(), bn.running_mean, bn.running_var, bn.num_batches_tracked, float(bn.momentum),
                           float(bn.eps))
    return bn_stats_from_sums_op(sums[0], sums[1], x.shape[0] * x.shape[2] * x.shape[3], bn.running_mean,
                                 bn.running_var, bn.num_batches_tracked, float(bn.momentum), float(bn.eps))


_SUMS_ARGS = 7  # the length of _sums_args' answer


def _sums_args(bn: Optional[nn.BatchNorm2d], sums: Optional[tuple]) -> tuple:
    """:func:`bn_act_from_sums_op`'s arguments for ``bn`` whose input's sums are ``sums`` (sums,
    squares, running mean and variance, batch count, momentum, eps); Nones and zeros for no ``bn``."""
    if bn is None:
        return (None,) * (_SUMS_ARGS - 2) + (0.0, 0.0)
    return (sums[0], sums[1], bn.running_mean, bn.running_var, bn.num_batches_tracked, float(bn.momentum),
            float(bn.eps))


def bn_act(x: torch.Tensor, bn: nn.BatchNorm2d, residual: Optional[torch.Tensor] = None,
           relu: bool = True, fork: bool = False, sums: Optional[tuple] = None,
           residual_bn: Optional[tuple] = None):
    """``relu(bn(x) + residual)`` (without the add or the ReLU as asked), fused where :func:`takes`;
    with ``fork``, as a pair (for the next block's convolution, for its shortcut) whose two
    gradients the backward adds itself (:class:`_ForkedBnAct`); ``sums``: ``x``'s per-channel
    (sum, sum of squares), made by the convolution that made ``x`` (:func:`conv_bn_act`), from
    which the normalise makes the statistics itself (:class:`_BnActFromSums`).
    ``residual_bn``: (the shortcut's BatchNorm, ``residual``'s sums or None) where ``residual``
    is that BatchNorm's raw input: the add normalises it as it loads it where both BatchNorms
    are fused (its normalised tensor is never written), else it is normalised first."""
    fused = takes(x, bn) and (residual is None or residual.dtype == x.dtype)  # torch would promote
    if residual_bn is not None and not (fused and takes(residual, residual_bn[0])):
        residual = bn_act(residual, residual_bn[0], relu=False, sums=residual_bn[1])
        residual_bn = None
        fused = fused and residual.dtype == x.dtype
    if not fused:
        out = bn(x)
        if residual is not None:
            out = out + residual
        out = F.relu(out) if relu else out
        return (out, out) if fork else out
    if sums is not None and (residual_bn is None or residual_bn[1] is not None):
        # the statistics made in the normalise's kernel from the convolutions' sums
        rbn, rsums = residual_bn if residual_bn is not None else (None, None)
        res = (rbn.weight, rbn.bias) if rbn is not None else (None, None)
        return _BnActFromSums.apply(fork, x, bn.weight, bn.bias, residual, relu, *_sums_args(bn, sums), *res,
                                    *_sums_args(rbn, rsums))
    mean, invstd = _statistics(x, bn, sums)
    shortcut = (None, None, None, None)
    if residual_bn is not None:
        rbn = residual_bn[0]
        shortcut = (rbn.weight, rbn.bias, *_statistics(residual, rbn, residual_bn[1]))
    inputs = (x, bn.weight, bn.bias, residual, mean, invstd, relu, *shortcut)
    if fork:
        return _ForkedBnAct.apply(*inputs)
    return bn_act_op(*inputs)[0]


def conv_bn_act(x: torch.Tensor, conv: nn.Module, bn: nn.BatchNorm2d, residual: Optional[torch.Tensor] = None,
                relu: bool = True, fork: bool = False, stats_in_conv: bool = False,
                residual_bn: Optional[tuple] = None):
    """:func:`bn_act` of ``conv(x)``; with ``stats_in_conv``, where the BatchNorm is fused and the
    convolution :func:`convstats.applies`, its statistics come from the convolution's epilogue
    (``--bn-kernel cudnn``) instead of a pass of their own over its output."""
    y, sums = conv_with_sums(x, conv, bn, stats_in_conv)
    return bn_act(y, bn, residual, relu, fork, sums=sums, residual_bn=residual_bn)


def conv_with_sums(x: torch.Tensor, conv: nn.Module, bn: nn.BatchNorm2d, stats_in_conv: bool) -> tuple:
    """(``conv(x)``, its per-channel (sum, sum of squares) where the convolution makes them, else None)."""
    if stats_in_conv and bn.training and convstats.applies(x, conv):
        y, sums, squares = convstats.conv_stats(x, conv)
        return y, (sums, squares)
    return conv(x), None
