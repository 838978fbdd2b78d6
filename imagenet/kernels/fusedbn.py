"""Training-mode BatchNorm fused with the residual add and the ReLU, in Triton (``--bn-kernel triton``).

In a ResNet step BatchNorm, the ReLU, the residual add and their gradients are separate passes
over the activations in memory (their time per step: docs/BENCHMARKS.md). Fused, a layer costs
the passes its arithmetic needs: forward, one for the per-channel statistics (tile sums combined
in a fixed order, so deterministic) and one that normalises, adds and applies the ReLU; backward,
one for the two per-channel sums (which also writes the residual's gradient) and one that writes
the input's gradient. A block's output, read by the next block's convolution and shortcut, is
forked (:class:`_ForkedBnAct`) so the gradient-sums pass loads its two gradients instead of
autograd summing them first. Without a residual the ReLU mask is recomputed from the input (two
fewer passes); it is then the float32 sum's mask, which differs from torch's only for outputs
that round to zero in fp16. With one, the forward writes the mask as bits (read off the rounded
output, as torch's backward reads it; a sixteenth of an fp16 pass from 32 channels up, instead of
reading the output back twice), and the gradient-sums pass writes the masked gradient, which is
the residual's gradient, so the input-gradient pass reads that one tensor (rounded to the
activations' dtype, as torch's own gradient would be) instead of both gradients and the mask. A
block's shortcut BatchNorm (the downsample's) is applied by the residual add as it loads the
shortcut convolution's raw output (:class:`Shortcut`): its normalised tensor is never written,
and its gradient sums come out of the add's own gradient-sums pass. Arithmetic is float32; each
stored tensor is rounded once; running statistics follow torch's rule.

With ``--bn-kernel cudnn`` the statistics' pass goes too: each block's convolution makes its
output's per-channel sums in its epilogue (:mod:`imagenet.kernels.convstats`), and the normalise
turns them into the mean and 1/std itself (:func:`normalise_from_sums`: no kernel between the
convolution and the normalise; :func:`conv_bn_act`).

The kernels are ``torch.library`` custom ops, so ``torch.compile`` keeps them and CUDA graphs
capture them. Only channels_last CUDA tensors (or ``TRITON_INTERPRET=1``) of a plain
``nn.BatchNorm2d`` in training mode take them; everything else runs torch's modules.
:func:`fuse_resnet` rewires torchvision's ResNet blocks to call :func:`bn_act`, keeping every
module, parameter and buffer name, so state dicts are torchvision's.
"""

import json
import os  # no "from __future__ import annotations": torch.library reads the op signatures' annotations
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from . import convstats

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None

# Triton reads TRITON_INTERPRET when it defines the kernels; read here once too, so that takes()
# inside torch.compile reads no environment (which breaks the graph on torch before 2.5)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched: ``tile`` elements per program step (BLOCK_M x BLOCK_C), ``warps``
    per program; for the reductions, ``programs_per_sm`` programs aimed at per multiprocessor and
    ``stages``, the loop iterations whose loads are in flight at once (Triton's software
    pipelining of the row loop, ``tl.range(num_stages=)``; 1: none)."""
    tile: int
    warps: int
    programs_per_sm: int = 0
    stages: int = 1


# The settings of scripts/perf/bn_kernel_sweep.py's fastest rows on an H200 (its figures: docs/BENCHMARKS.md)
LAUNCH = {"stats": Launch(4096, 4, 2, 4), "apply": Launch(2048, 4), "grad": Launch(2048, 4, 2, 4),
          "grad_input": Launch(2048, 4)}
LAUNCH_ENV = "IMAGENET_BN_LAUNCH"
TILES = tuple(2 ** k for k in range(8, 15))  # 256 .. 16384 elements a program step (the sweep tries 2048-16384)


def launch_override(value: Optional[str]) -> dict:
    """The settings ``value`` (``IMAGENET_BN_LAUNCH``: a JSON object of phase: [tile, warps,
    programs_per_sm, stages] as scripts/perf/bn_kernel_sweep.py writes it; stages may be left out,
    and for the pointwise phases programs_per_sm too) asks for, to be put over :data:`LAUNCH`
    (models.use_bn_kernels does, for main.py and bench.py); a ValueError naming the problem
    where it is not one."""
    if not value:
        return {}
    try:
        asked = json.loads(value)
        if not all(type(v) is int for values in asked.values() for v in values):
            raise ValueError("the values must be whole numbers")
        settings = {phase: Launch(*values) for phase, values in asked.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{LAUNCH_ENV}={value!r} is not a JSON object of phase: [tile, warps, programs_per_sm, "
                         f"stages] ({e})") from None
    unknown = sorted(set(settings) - set(LAUNCH))
    reduction = {"stats", "grad"}  # the phases with a row loop (programs per multiprocessor, stages)
    bad = [p for p, launch in settings.items() if launch.tile not in TILES or launch.warps not in (1, 2, 4, 8, 16)
           or not (1 if p in reduction else 0) <= launch.programs_per_sm <= 64
           or not 1 <= launch.stages <= (4 if p in reduction else 1)]
    if unknown or bad:
        raise ValueError(f"{LAUNCH_ENV}={value!r}: " + (f"unknown phase(s) {unknown}, choose from {sorted(LAUNCH)}"
                         if unknown else f"{bad}: tiles are powers of two from {TILES[0]} to {TILES[-1]}, warps "
                                         "1-16 (a power of two), the reductions (stats, grad) 1-64 programs per "
                                         "multiprocessor, stages 1-4 (the reductions; 1 for the others)"))
    return settings


PARTIALS = None  # tests: at most this many row ranges per channel block (None: from the GPU's size)
FINISH_C = 16  # channels per program of the kernels that combine the partial results
FINISH_P = 128  # partial results combined per step of those kernels
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_NONE, MASK_FROM_BITS, MASK_FROM_INPUT = 0, 1, 2  # the backward's ReLU mask


def takes(x: torch.Tensor, bn: nn.Module) -> bool:
    """Whether ``bn(x)`` (with its add and ReLU) goes through the kernels."""
    return (triton is not None and bn.training and type(bn) is nn.BatchNorm2d and bn.affine
            and bn.track_running_stats and bn.momentum is not None and (x.is_cuda or _INTERPRETED)
            and x.dim() == 4 and x.dtype in _DTYPES
            and x.is_contiguous(memory_format=torch.channels_last) and x.numel() > 0
            and x.shape[0] * x.shape[2] * x.shape[3] > 1)


if triton is not None:
    @triton.jit
    def _partial_stats(x_ptr, pmean_ptr, pm2_ptr, M, C, ROWS, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                       STAGES: tl.constexpr):
        # Rows ROWS * pid .. of the [M, C] view, one channel block: sums of x - shift and of its
        # square, element-wise in registers, reduced once at the end (the shift, the block's
        # first row, keeps the variance's cancellation small); stored as (mean, M2).
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        first = tl.program_id(0) * ROWS
        shift = tl.load(x_ptr + first.to(tl.int64) * C + c, mask=c_ok, other=0.0).to(tl.float32)
        s1 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
        s2 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
        for start in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
            r = first + start + tl.arange(0, BLOCK_M)
            mask = (r < M)[:, None] & c_ok[None, :]
            x = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - shift[None, :], 0.0)
            s1 += d
            s2 += d * d
        n = tl.minimum(ROWS, M - first).to(tl.float32)
        t1 = tl.sum(s1, 0)
        out = tl.program_id(0) * C + c
        tl.store(pmean_ptr + out, shift + t1 / n, mask=c_ok)
        tl.store(pm2_ptr + out, tl.maximum(tl.sum(s2, 0) - t1 * t1 / n, 0.0), mask=c_ok)

    @triton.jit
    def _finish_stats(pmean_ptr, pm2_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, M, C, P, ROWS, eps,
                      momentum, COUNT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        # The P partial results of each channel, BLOCK_P at a time (each tile combined exactly:
        # its count-weighted mean, then its M2 about that mean), tiles in order; then torch's
        # running-statistics update.
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        n = tl.zeros((BLOCK_C,), tl.float32)
        mean = tl.zeros((BLOCK_C,), tl.float32)
        m2 = tl.zeros((BLOCK_C,), tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_ok = p < P
            count = tl.where(p_ok, tl.minimum(ROWS, M - p * ROWS), 0).to(tl.float32)
            mask = p_ok[:, None] & c_ok[None, :]
            offs = p[:, None] * C + c[None, :]
            pm = tl.load(pmean_ptr + offs, mask=mask, other=0.0)
            pm2 = tl.load(pm2_ptr + offs, mask=mask, other=0.0)
            tile_n = tl.sum(count, 0)
            tile_mean = tl.sum(pm * count[:, None], 0) / tile_n
            dev = tl.where(mask, pm - tile_mean[None, :], 0.0)
            tile_m2 = tl.sum(pm2, 0) + tl.sum(dev * dev * count[:, None], 0)
            total = n + tile_n
            frac = tile_n / total
            delta = tile_mean - mean
            mean = mean + delta * frac
            m2 = m2 + tile_m2 + delta * delta * n * frac
            n = total
        _store_statistics(mean, m2 / M, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, c, c_ok, M, eps,
                          momentum, COUNT, tl.program_id(0) == 0)

    @triton.jit
    def _store_statistics(mean, var, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, c, c_ok, M, eps,
                          momentum, COUNT: tl.constexpr, counts):
        # The batch's mean and 1/std, and torch's running-statistics update (unbiased variance);
        # with COUNT, the one program whose ``counts`` is true adds the batch to BatchNorm's count
        # (a kernel of its own per layer otherwise)
        if COUNT:
            if counts:
                tl.store(batches_ptr, tl.load(batches_ptr) + 1)
        tl.store(mean_ptr + c, mean, mask=c_ok)
        tl.store(invstd_ptr + c, _invstd(var, eps), mask=c_ok)
        rm = tl.load(rmean_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        rv = tl.load(rvar_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(rmean_ptr + c, ((1.0 - momentum) * rm + momentum * mean).to(rmean_ptr.dtype.element_ty), mask=c_ok)
        unbiased = var * M / tl.maximum(M - 1, 1)
        tl.store(rvar_ptr + c, ((1.0 - momentum) * rv + momentum * unbiased).to(rvar_ptr.dtype.element_ty), mask=c_ok)

    @triton.jit
    def _stats_from_sums(sum_ptr, sq_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, M, C, eps, momentum,
                         COUNT: tl.constexpr, BLOCK_C: tl.constexpr):
        # The batch's statistics from a convolution's per-channel sum and sum of squares
        # (imagenet.kernels.convstats): E[y^2] - E[y]^2, then torch's running-statistics update.
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        mean, var = _moments(sum_ptr, sq_ptr, M, c, c_ok)
        _store_statistics(mean, var, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, c, c_ok, M, eps,
                          momentum, COUNT, tl.program_id(0) == 0)

    @triton.jit
    def _moments(sum_ptr, sq_ptr, M, c, c_ok):
        # (mean, variance) of M values a channel from their sum and sum of squares: E[y^2] - E[y]^2
        mean = tl.load(sum_ptr + c, mask=c_ok, other=0.0) / M
        return mean, tl.maximum(tl.load(sq_ptr + c, mask=c_ok, other=0.0) / M - mean * mean, 0.0)

    @triton.jit
    def _invstd(var, eps):
        # the one expression of 1/std: the statistics stored for the backward and those a
        # normalise computes for itself (:func:`_batch_statistics`) are the same bits
        return 1.0 / tl.sqrt(var + eps)

    @triton.jit
    def _batch_statistics(sum_ptr, sq_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, M, eps, momentum,
                          c, c_ok, COUNT: tl.constexpr):
        # Inside a normalise over [M, C]: the batch's (mean, 1/std) of this program's channels from
        # the convolution's sums, made by every program (a few operations a channel) instead of by
        # a kernel of their own; the first row block's programs store them for the backward and
        # update the running statistics, its first program the batch count.
        mean, var = _moments(sum_ptr, sq_ptr, M, c, c_ok)
        if tl.program_id(0) == 0:
            _store_statistics(mean, var, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, batches_ptr, c, c_ok, M, eps,
                              momentum, COUNT, tl.program_id(1) == 0)
        return mean, _invstd(var, eps)

    @triton.jit
    def _scale_shift(mean, invstd, w_ptr, b_ptr, c, c_ok):
        # BatchNorm as x * scale + shift per channel
        scale = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32) * invstd
        shift = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32) - mean * scale
        return scale, shift

    @triton.jit
    def _affine(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, c_ok):
        # :func:`_scale_shift` of stored statistics; the forward and the backward's mask use this one.
        invstd = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
        mean = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
        scale, shift = _scale_shift(mean, invstd, w_ptr, b_ptr, c, c_ok)
        return mean, invstd, scale, shift

    @triton.jit
    def _apply(x_ptr, r_ptr, y_ptr, bits_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, rmean_ptr, rinvstd_ptr, rw_ptr,
               rb_ptr, sum_ptr, sq_ptr, run_mean_ptr, run_var_ptr, batches_ptr, rsum_ptr, rsq_ptr, rrun_mean_ptr,
               rrun_var_ptr, rbatches_ptr, M, C, NW, eps, momentum, reps, rmomentum, HAS_RES: tl.constexpr,
               RES_BN: tl.constexpr, RELU: tl.constexpr, BITS: tl.constexpr, SUMS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
        # With SUMS, the statistics (this BatchNorm's and the shortcut's) are made here from the
        # convolutions' sums and stored (:func:`_batch_statistics`); else they are read.
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        mask = (r < M)[:, None] & c_ok[None, :]
        if SUMS:
            mean, invstd = _batch_statistics(sum_ptr, sq_ptr, mean_ptr, invstd_ptr, run_mean_ptr, run_var_ptr,
                                             batches_ptr, M, eps, momentum, c, c_ok, True)
            scale, shift = _scale_shift(mean, invstd, w_ptr, b_ptr, c, c_ok)
        else:
            _, _, scale, shift = _affine(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, c_ok)
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :]
        if HAS_RES:
            res = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if RES_BN:  # the shortcut's BatchNorm, applied as its raw input is loaded
                if SUMS:
                    rmean, rinvstd = _batch_statistics(rsum_ptr, rsq_ptr, rmean_ptr, rinvstd_ptr, rrun_mean_ptr,
                                                       rrun_var_ptr, rbatches_ptr, M, reps, rmomentum, c, c_ok, True)
                    rscale, rshift = _scale_shift(rmean, rinvstd, rw_ptr, rb_ptr, c, c_ok)
                else:
                    _, _, rscale, rshift = _affine(rmean_ptr, rinvstd_ptr, rw_ptr, rb_ptr, c, c_ok)
                res = res * rscale[None, :] + rshift[None, :]
            z += res
        if RELU:
            z = tl.where(z < 0, 0.0, z)  # torch's ReLU: NaN stays NaN
        y = z.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y, mask=mask)
        if BITS:  # the ReLU's mask as torch's backward reads it off the output: passes where not <= 0
            keep = tl.where(mask & ~(y.to(tl.float32) <= 0), 1, 0)
            _store_bits(keep, bits_ptr, r, M, NW, BLOCK_M, BLOCK_C, WORD)

    @triton.jit
    def _store_bits(keep, bits_ptr, r, M, NW, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
        # keep, [BLOCK_M, BLOCK_C] of 0/1 for this program's channel block, as WORD-bit words:
        # channel c is bit c % WORD of word c // WORD of its row ([M, NW] int32)
        tl.static_assert(BLOCK_C % WORD == 0)  # a word never straddles two programs' channel blocks
        words = tl.sum(tl.reshape(keep, (BLOCK_M, BLOCK_C // WORD, WORD)) << tl.arange(0, WORD)[None, None, :], 2)
        w = tl.program_id(1) * (BLOCK_C // WORD) + tl.arange(0, BLOCK_C // WORD)
        tl.store(bits_ptr + r.to(tl.int64)[:, None] * NW + w[None, :], words.to(tl.int32),
                 mask=(r < M)[:, None] & (w < NW)[None, :])

    @triton.jit
    def _load_bits(bits_ptr, r, M, NW, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
        # :func:`_store_bits`' words back as a [BLOCK_M, BLOCK_C] tile of 0/1
        tl.static_assert(BLOCK_C % WORD == 0)
        w = tl.program_id(1) * (BLOCK_C // WORD) + tl.arange(0, BLOCK_C // WORD)
        words = tl.load(bits_ptr + r.to(tl.int64)[:, None] * NW + w[None, :], mask=(r < M)[:, None] & (w < NW)[None, :],
                        other=0)
        return tl.reshape((words[:, :, None] >> tl.arange(0, WORD)[None, None, :]) & 1, (BLOCK_M, BLOCK_C))

    @triton.jit
    def _masked(g, x, bits_ptr, r, M, NW, scale, shift, MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_C: tl.constexpr, WORD: tl.constexpr):
        # torch's ReLU gradient: zero where the output is <= 0 (a NaN output passes it), from the
        # bits the forward wrote (MASK 1) or recomputed from the input (MASK 2, no residual was added)
        if MASK == 1:
            g = tl.where(_load_bits(bits_ptr, r, M, NW, BLOCK_M, BLOCK_C, WORD) == 0, 0.0, g)
        if MASK == 2:
            g = tl.where(x * scale[None, :] + shift[None, :] <= 0, 0.0, g)
        return g

    @triton.jit
    def _incoming(dy_ptr, dy2_ptr, offs, mask, TWO_GRADS: tl.constexpr):
        # the gradient reaching the output, float32: one tensor, or the sum of the two a forked
        # output receives (its block's next convolution's and the next block's shortcut's)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if TWO_GRADS:
            g += tl.load(dy2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return g

    @triton.jit
    def _partial_grad(dy_ptr, dy2_ptr, bits_ptr, x_ptr, g_ptr, r_ptr, rmean_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr,
                      psg_ptr, psgx_ptr, psgr_ptr, M, C, ROWS, NW, TWO_GRADS: tl.constexpr, MASK: tl.constexpr,
                      KEEP_G: tl.constexpr, RES_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                      WORD: tl.constexpr, STAGES: tl.constexpr):
        # Per channel: sum of g and of g * (x - mean) over this program's rows, g the ReLU-masked
        # gradient; with KEEP_G, g itself is written too (the residual's gradient, which the
        # input-gradient pass then reads in place of the incoming gradients and the mask); with
        # RES_BN, also the sum of g * (r - the shortcut BatchNorm's mean), r its raw input: that
        # BatchNorm's own gradient sums (its sum of g is this one's).
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        mean, invstd, scale, shift = _affine(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, c_ok)
        sg = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)  # element-wise in registers; reduced once at the end
        sgx = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
        sgr = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
        rmean = tl.load(rmean_ptr + c, mask=c_ok, other=0.0)  # (the mean's own pointer without RES_BN)
        first = tl.program_id(0) * ROWS
        for start in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
            r = first + start + tl.arange(0, BLOCK_M)
            mask = (r < M)[:, None] & c_ok[None, :]
            offs = r.to(tl.int64)[:, None] * C + c[None, :]
            g = _incoming(dy_ptr, dy2_ptr, offs, mask, TWO_GRADS)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = _masked(g, x, bits_ptr, r, M, NW, scale, shift, MASK, BLOCK_M, BLOCK_C, WORD)
            if KEEP_G:
                tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)
            sg += g
            sgx += tl.where(mask, g * (x - mean[None, :]), 0.0)
            if RES_BN:
                rr = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                sgr += tl.where(mask, g * (rr - rmean[None, :]), 0.0)
        out = tl.program_id(0) * C + c
        tl.store(psg_ptr + out, tl.sum(sg, 0), mask=c_ok)
        tl.store(psgx_ptr + out, tl.sum(sgx, 0), mask=c_ok)
        if RES_BN:
            tl.store(psgr_ptr + out, tl.sum(sgr, 0), mask=c_ok)

    @triton.jit
    def _finish_grad(psg_ptr, psgx_ptr, invstd_ptr, sg_ptr, sgx_ptr, dw_ptr, db_ptr, C, P,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        sg = tl.zeros((BLOCK_C,), tl.float32)
        sgx = tl.zeros((BLOCK_C,), tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            mask = (p < P)[:, None] & c_ok[None, :]
            offs = p[:, None] * C + c[None, :]
            sg += tl.sum(tl.load(psg_ptr + offs, mask=mask, other=0.0), 0)
            sgx += tl.sum(tl.load(psgx_ptr + offs, mask=mask, other=0.0), 0)
        tl.store(sg_ptr + c, sg, mask=c_ok)
        tl.store(sgx_ptr + c, sgx, mask=c_ok)
        invstd = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
        tl.store(dw_ptr + c, (sgx * invstd).to(dw_ptr.dtype.element_ty), mask=c_ok)
        tl.store(db_ptr + c, sg.to(db_ptr.dtype.element_ty), mask=c_ok)

    @triton.jit
    def _grad_input(dy_ptr, dy2_ptr, bits_ptr, x_ptr, dx_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, sg_ptr, sgx_ptr,
                    M, C, NW, TWO_GRADS: tl.constexpr, MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_C: tl.constexpr, WORD: tl.constexpr):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        mask = (r < M)[:, None] & c_ok[None, :]
        mean, invstd, scale, shift = _affine(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, c_ok)
        mean_g = tl.load(sg_ptr + c, mask=c_ok, other=0.0) / M
        proj = tl.load(sgx_ptr + c, mask=c_ok, other=0.0) * invstd * invstd / M
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        g = _incoming(dy_ptr, dy2_ptr, offs, mask, TWO_GRADS)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = _masked(g, x, bits_ptr, r, M, NW, scale, shift, MASK, BLOCK_M, BLOCK_C, WORD)
        dx = scale[None, :] * (g - mean_g[None, :] - (x - mean[None, :]) * proj[None, :])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _blocks(c: int, launch: Launch) -> tuple:
    """(BLOCK_M, BLOCK_C) of a kernel over [m, c] rows."""
    block_c = min(triton.next_power_of_2(c), 128)
    return max(launch.tile // block_c, 1), block_c


def _layout(m: int, c: int, device: torch.device, launch: Optional[Launch] = None) -> tuple:
    """(BLOCK_M, BLOCK_C, rows per partial, partials) of a reduction over an [m, c] activation:
    enough row ranges that every multiprocessor gets ``programs_per_sm`` programs."""
    launch = launch or LAUNCH["stats"]
    block_m, block_c = _blocks(c, launch)
    chunks = triton.cdiv(m, block_m)
    partials = PARTIALS or triton.cdiv(launch.programs_per_sm * _multiprocessors(device), triton.cdiv(c, block_c))
    rows = block_m * triton.cdiv(chunks, partials)
    return block_m, block_c, rows, triton.cdiv(m, rows)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A channels_last NCHW tensor as its [N*H*W, C] matrix (no copy)."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _mask_kind(relu: bool, has_res: bool) -> int:
    return (MASK_FROM_BITS if has_res else MASK_FROM_INPUT) if relu else MASK_NONE


def _word(c: int) -> int:
    """Bits per int32 word of the ReLU's mask over ``c`` channels: 32, or the channel block where
    it is narrower (a word never straddles two programs' channel blocks)."""
    return min(32, triton.next_power_of_2(c))


def mask_bits(x: torch.Tensor) -> torch.Tensor:
    """An empty [N*H*W, words] int32 tensor for the ReLU mask of the channels_last ``x``: one bit a
    value (:func:`normalise` writes it): a sixteenth of an fp16 pass over ``x`` from 32 channels up
    (narrower, a row's one word holds fewer bits)."""
    n, c, h, w = x.shape
    return x.new_empty((n * h * w, -(-c // _word(c))), dtype=torch.int32)


class Shortcut(NamedTuple):
    """A block's shortcut BatchNorm (the downsample's) that the residual add applies itself: its
    parameters and the batch's statistics of its raw input."""
    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor


def _reduction(x: torch.Tensor, launch: Launch) -> tuple:
    """For a per-channel reduction over a channels_last ``x``: (rows M, channels C, its
    :func:`_layout`, two float32 [partials, C] buffers for the partial results, two [C] ones)."""
    n, c, h, w = x.shape
    m = n * h * w
    layout = _layout(m, c, x.device, launch)
    f32 = dict(dtype=torch.float32, device=x.device)
    partials = (torch.empty((layout[3], c), **f32), torch.empty((layout[3], c), **f32))
    return m, c, layout, partials, (torch.empty(c, **f32), torch.empty(c, **f32))


def statistics(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float,
               eps: float, batches: Optional[torch.Tensor] = None) -> tuple:
    """The batch's per-channel (mean, 1/std) in float32 of a channels_last ``x``; updates the
    running statistics in place, and adds one to ``batches`` (BatchNorm's count) where given."""
    launch = LAUNCH["stats"]
    m, c, (block_m, block_c, rows, parts), (pmean, pm2), (mean, invstd) = _reduction(x, launch)
    _partial_stats[(parts, triton.cdiv(c, block_c))](_rows(x), pmean, pm2, m, c, rows, BLOCK_M=block_m,
                                                     BLOCK_C=block_c, STAGES=launch.stages, num_warps=launch.warps)
    finish_c = min(FINISH_C, triton.next_power_of_2(c))
    _finish_stats[(triton.cdiv(c, finish_c),)](pmean, pm2, mean, invstd, running_mean, running_var,
                                               batches if batches is not None else mean, m, c, parts, rows, eps,
                                               momentum, COUNT=batches is not None, BLOCK_P=FINISH_P,
                                               BLOCK_C=finish_c)
    return mean, invstd


class Sums(NamedTuple):
    """A BatchNorm's batch statistics still as its input's per-channel float32 (sum, sum of
    squares), made by the convolution before it (:mod:`imagenet.kernels.convstats`), with what the
    normalise that turns them into statistics updates: the running statistics and batch count, by
    the BatchNorm's momentum; and its eps."""
    sums: torch.Tensor
    squares: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor
    batches: torch.Tensor
    momentum: float
    eps: float


class ShortcutSums(NamedTuple):
    """A shortcut BatchNorm whose statistics :func:`normalise_from_sums` makes from its input's sums."""
    weight: torch.Tensor
    bias: torch.Tensor
    sums: Sums


def normalise(x: torch.Tensor, residual: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
              weight: torch.Tensor, bias: torch.Tensor, relu: bool, shortcut: Optional[Shortcut] = None) -> tuple:
    """(``relu(bn(x) + residual)`` from the batch's statistics, channels_last, in ``x``'s dtype;
    the ReLU's mask as bits where the backward will read it (a ReLU after the add: the input
    alone no longer tells), else an empty tensor). With ``shortcut``, ``residual`` is the raw
    input of that BatchNorm, normalised here as it is loaded (never written normalised)."""
    return _normalise(x, residual, mean, invstd, weight, bias, relu, shortcut=shortcut)


def normalise_from_sums(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor,
                        relu: bool, sums: Sums, shortcut: Optional[ShortcutSums] = None) -> tuple:
    """:func:`normalise` with the batch's statistics made in the same kernel from ``sums`` (no kernel
    of their own: every program turns its channels' sums into mean and 1/std, the first row's
    programs store them and update the running statistics, as :func:`statistics_from_sums`
    does, bit for bit). ``shortcut``: where ``residual`` is that BatchNorm's raw input. Returns
    (y, bits, mean, 1/std, and the shortcut's mean and 1/std or None)."""
    c = x.shape[1]
    mean, invstd = x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)
    sc, res_sums = None, None
    if shortcut is not None:
        sc = Shortcut(shortcut.weight, shortcut.bias, torch.empty_like(mean), torch.empty_like(mean))
        res_sums = shortcut.sums
    y, bits = _normalise(x, residual, mean, invstd, weight, bias, relu, shortcut=sc, sums=sums, res_sums=res_sums)
    return y, bits, mean, invstd, (sc.mean if sc else None), (sc.invstd if sc else None)


def _normalise(x, residual, mean, invstd, weight, bias, relu: bool, *, shortcut: Optional[Shortcut] = None,
               sums: Optional[Sums] = None, res_sums: Optional[Sums] = None) -> tuple:
    """The one launch of :func:`_apply` for both of the above: with ``sums``, ``mean`` and
    ``invstd`` (and the shortcut's) are written, else read; ``res_sums`` goes with ``sums``
    where there is a shortcut."""
    n, c, h, w = x.shape
    m = n * h * w
    launch = LAUNCH["apply"]
    block_m, block_c = _blocks(c, launch)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    with_bits = _mask_kind(relu, residual is not None) == MASK_FROM_BITS
    bits = mask_bits(x) if with_bits else x.new_empty(0, dtype=torch.int32)
    xs = _rows(x)
    sc = shortcut or Shortcut(weight, bias, mean, invstd)  # unread without a shortcut BatchNorm
    st = sums or Sums(mean, invstd, mean, invstd, mean, 0.0, 0.0)  # unread without sums
    rst = res_sums or st  # unread without both
    _apply[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
        xs, _rows(residual) if residual is not None else xs, _rows(y), bits if with_bits else xs, mean, invstd,
        weight, bias, sc.mean, sc.invstd, sc.weight, sc.bias, st.sums, st.squares, st.running_mean, st.running_var,
        st.batches, rst.sums, rst.squares, rst.running_mean, rst.running_var, rst.batches, m, c,
        bits.shape[-1] if with_bits else 0, st.eps, st.momentum, rst.eps, rst.momentum,
        HAS_RES=residual is not None, RES_BN=shortcut is not None, RELU=relu, BITS=with_bits, SUMS=sums is not None,
        BLOCK_M=block_m, BLOCK_C=block_c, WORD=_word(c), num_warps=launch.warps)
    return y, bits


def gradient_sums(dy: torch.Tensor, x: torch.Tensor, bits: Optional[torch.Tensor], mean: torch.Tensor,
                  invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: int,
                  dy2: Optional[torch.Tensor] = None, keep_g: bool = False,
                  shortcut: Optional[tuple] = None) -> tuple:
    """Per channel, float32: (sum of g, sum of g * (x - mean)), g the ReLU-masked ``dy`` (plus
    ``dy2``, a forked output's second gradient; the mask from ``bits`` or ``x`` as ``mask``
    says); the weight's and bias's gradients; with ``keep_g``, g itself in ``x``'s dtype (else an
    empty tensor); and with ``shortcut`` = (its raw input r, its :class:`Shortcut`), that
    BatchNorm's (sum of g * (r - its mean), weight gradient, bias gradient) from the same pass
    (else None)."""
    launch = LAUNCH["grad"]
    m, c, (block_m, block_c, rows, parts), (psg, psgx), (sg, sgx) = _reduction(x, launch)
    dw, db = torch.empty_like(weight), torch.empty_like(bias)
    g = torch.empty_like(x, memory_format=torch.channels_last) if keep_g else x.new_empty(0)
    psgr = torch.empty_like(psgx) if shortcut is not None else psgx
    xs = _rows(x)
    dys = _rows(dy)
    _partial_grad[(parts, triton.cdiv(c, block_c))](
        dys, _rows(dy2) if dy2 is not None else dys, bits if mask == MASK_FROM_BITS else xs, xs,
        _rows(g) if keep_g else xs, _rows(shortcut[0]) if shortcut is not None else xs,
        shortcut[1].mean if shortcut is not None else mean, mean, invstd, weight, bias, psg, psgx, psgr, m, c, rows,
        bits.shape[-1] if mask == MASK_FROM_BITS else 0, TWO_GRADS=dy2 is not None, MASK=mask, KEEP_G=keep_g,
        RES_BN=shortcut is not None, BLOCK_M=block_m, BLOCK_C=block_c, WORD=_word(c), STAGES=launch.stages,
        num_warps=launch.warps)
    finish_c = min(FINISH_C, triton.next_power_of_2(c))
    _finish_grad[(triton.cdiv(c, finish_c),)](psg, psgx, invstd, sg, sgx, dw, db, c, parts,
                                              BLOCK_P=FINISH_P, BLOCK_C=finish_c)
    sums_r = None
    if shortcut is not None:
        sc = shortcut[1]
        sgr, dw_r, db_r = torch.empty_like(sgx), torch.empty_like(sc.weight), torch.empty_like(sc.bias)
        # its sum of g is this layer's: sg is written again with the same values
        _finish_grad[(triton.cdiv(c, finish_c),)](psg, psgr, sc.invstd, sg, sgr, dw_r, db_r, c, parts,
                                                  BLOCK_P=FINISH_P, BLOCK_C=finish_c)
        sums_r = (sgr, dw_r, db_r)
    return sg, sgx, dw, db, g, sums_r


def input_gradients(dy: torch.Tensor, x: torch.Tensor, bits: Optional[torch.Tensor], mean: torch.Tensor,
                    invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, sg: torch.Tensor,
                    sgx: torch.Tensor, mask: int, dy2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The input's gradient, channels_last, in ``x``'s dtype, from the sums of :func:`gradient_sums`
    (``dy``, ``dy2``, ``bits`` and ``mask`` as there; or ``dy`` its kept g, with MASK_NONE)."""
    n, c, h, w = x.shape
    m = n * h * w
    launch = LAUNCH["grad_input"]
    block_m, block_c = _blocks(c, launch)
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    xs, dys = _rows(x), _rows(dy)
    _grad_input[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
        dys, _rows(dy2) if dy2 is not None else dys, bits if mask == MASK_FROM_BITS else xs, xs, _rows(dx), mean,
        invstd, weight, bias, sg, sgx, m, c, bits.shape[-1] if mask == MASK_FROM_BITS else 0,
        TWO_GRADS=dy2 is not None, MASK=mask, BLOCK_M=block_m, BLOCK_C=block_c, WORD=_word(c),
        num_warps=launch.warps)
    return dx


@torch.library.custom_op("imagenet::bn_stats", mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def bn_stats_op(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                num_batches_tracked: torch.Tensor, momentum: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`statistics` as an op (no gradient: :func:`bn_act_op`'s backward accounts for the
    statistics' dependence on ``x``)."""
    return statistics(_cl(x), running_mean, running_var, momentum, eps, num_batches_tracked)


@bn_stats_op.register_fake
def _(x, running_mean, running_var, num_batches_tracked, momentum, eps):
    c = x.shape[1]
    return x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)


def statistics_from_sums(sums: torch.Tensor, squares: torch.Tensor, count: int, running_mean: torch.Tensor,
                         running_var: torch.Tensor, momentum: float, eps: float,
                         batches: Optional[torch.Tensor] = None) -> tuple:
    """The batch's per-channel (mean, 1/std) in float32 from the per-channel sum and sum of squares
    of ``count`` values each; updates the running statistics in place, and ``batches`` as
    :func:`statistics` does."""
    c = sums.shape[0]
    mean, invstd = torch.empty_like(sums), torch.empty_like(sums)
    block_c = min(triton.next_power_of_2(c), 128)
    _stats_from_sums[(triton.cdiv(c, block_c),)](sums, squares, mean, invstd, running_mean, running_var,
                                                 batches if batches is not None else mean, count, c, eps, momentum,
                                                 COUNT=batches is not None, BLOCK_C=block_c)
    return mean, invstd


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
    return normalise(_cl(x), _cl(residual) if residual is not None else None, mean, invstd, weight, bias, relu,
                     _shortcut_of(res_weight, res_bias, res_mean, res_invstd))


def _fake_bn_act(x, residual, relu) -> tuple:
    y = torch.empty_like(x, memory_format=torch.channels_last)
    if _mask_kind(relu, residual is not None) == MASK_FROM_BITS:
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
        _cl(x), _cl(residual) if residual is not None else None, weight, bias, relu,
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
    dy, x = _cl(dy), _cl(x)
    dy2 = _cl(dy2) if dy2 is not None else None
    sc = _shortcut_of(res_weight, res_bias, res_mean, res_invstd)
    raw = _cl(residual) if sc is not None else None
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
    ctx.mask = _mask_kind(relu, residual is not None)
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
    dy, dy2 = _cl(dy), (_cl(dy2) if dy2 is not None else None)
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
    y, sums = _conv(x, conv, bn, stats_in_conv)
    return bn_act(y, bn, residual, relu, fork, sums=sums, residual_bn=residual_bn)


def _conv(x: torch.Tensor, conv: nn.Module, bn: nn.BatchNorm2d, stats_in_conv: bool) -> tuple:
    """(``conv(x)``, its per-channel (sum, sum of squares) where the convolution makes them, else None)."""
    if stats_in_conv and bn.training and convstats.applies(x, conv):
        y, sums, squares = convstats.conv_stats(x, conv)
        return y, (sums, squares)
    return conv(x), None


def _block_input(x) -> tuple:
    """A block's input as (for its first convolution, for its shortcut): a forked pair or one tensor."""
    return x if isinstance(x, tuple) else (x, x)


def _residual(block: nn.Module, x: torch.Tensor) -> tuple:
    """A block's residual for :func:`bn_act`: (the tensor to add, None), or where the shortcut is a
    convolution and a BatchNorm, (the convolution's raw output, (the BatchNorm, the output's sums
    or None)), which the residual add normalises itself."""
    ds = block.downsample
    if ds is None:
        return x, None
    if isinstance(ds, nn.Sequential) and len(ds) == 2 and isinstance(ds[1], nn.BatchNorm2d):
        y, sums = _conv(x, ds[0], ds[1], block.stats_in_conv)
        return y, (ds[1], sums)
    return ds(x), None


class FusedBasicBlock(BasicBlock):
    """torchvision's BasicBlock with its BatchNorms, add and ReLUs through :func:`bn_act`; with
    ``fork_output`` (set by :func:`fuse_resnet` where another block follows) its output is a forked
    pair, and its input may be one."""

    fork_output = False
    stats_in_conv = False  # set by fuse_resnet: the convolutions make their BatchNorms' sums

    def forward(self, x):
        x, shortcut = _block_input(x)
        out = conv_bn_act(x, self.conv1, self.bn1, stats_in_conv=self.stats_in_conv)
        residual, residual_bn = _residual(self, shortcut)
        return conv_bn_act(out, self.conv2, self.bn2, residual=residual, residual_bn=residual_bn,
                           fork=self.fork_output, stats_in_conv=self.stats_in_conv)


class FusedBottleneck(Bottleneck):
    """torchvision's Bottleneck with its BatchNorms, add and ReLUs through :func:`bn_act`; forked
    output and input as :class:`FusedBasicBlock`'s."""

    fork_output = False
    stats_in_conv = False  # set by fuse_resnet: the convolutions make their BatchNorms' sums

    def forward(self, x):
        x, shortcut = _block_input(x)
        stats = self.stats_in_conv
        out = conv_bn_act(x, self.conv1, self.bn1, stats_in_conv=stats)
        out = conv_bn_act(out, self.conv2, self.bn2, stats_in_conv=stats)
        residual, residual_bn = _residual(self, shortcut)
        return conv_bn_act(out, self.conv3, self.bn3, residual=residual, residual_bn=residual_bn,
                           fork=self.fork_output, stats_in_conv=stats)


class FusedResNet(ResNet):
    """torchvision's ResNet with the stem's BatchNorm and ReLU through :func:`bn_act`."""

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(bn_act(self.conv1(x), self.bn1))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def fuse_resnet(model: nn.Module, stats_in_conv: bool = False) -> nn.Module:
    """``model`` (a torchvision ResNet) with its blocks' classes swapped for the fused ones, in
    place: every module, parameter and buffer keeps its name, so the state dict is unchanged. In a
    whole ResNet every block but the last forks its output (the next block reads it twice), so
    a layer's output (layer1-layer3, or a block's) is a pair of one tensor: (output, a view of it).
    ``stats_in_conv``: the blocks' convolutions make their BatchNorms' sums (:func:`conv_bn_act`;
    not the stem's, whose 3-channel input cuDNN's fused engines refuse)."""
    swaps = {ResNet: FusedResNet, BasicBlock: FusedBasicBlock, Bottleneck: FusedBottleneck}
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
            if stats_in_conv and type(module) is not FusedResNet:
                module.stats_in_conv = True
    if isinstance(model, FusedResNet):  # its blocks run one after another: layer1's first .. layer4's last
        blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
        fused = (FusedBasicBlock, FusedBottleneck)
        for block, following in zip(blocks, blocks[1:]):  # a pair only for a block that takes one
            if isinstance(block, fused):
                block.fork_output = isinstance(following, fused)
    return model


def uses_bn_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, (FusedResNet, FusedBasicBlock, FusedBottleneck)) for m in model.modules())


def uses_conv_stats(model: nn.Module) -> bool:
    """Whether ``model``'s fused blocks take their BatchNorms' sums from their convolutions."""
    return any(getattr(m, "stats_in_conv", False) for m in model.modules())
