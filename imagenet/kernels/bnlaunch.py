"""How the fused BatchNorm's Triton kernels (:mod:`imagenet.kernels.bntriton`) are launched.

:data:`LAUNCH` holds each phase's settings (tile, warps, programs per multiprocessor, pipeline
stages), filled from scripts/perf/bn_kernel_sweep.py's fastest rows; ``IMAGENET_BN_LAUNCH``
overrides them (:func:`launch_override`). The geometry follows from them: a program takes a block
of up to 128 channels and a tile's worth of rows; a reduction splits the rows into enough
partial ranges that every multiprocessor gets its programs, then combines them in order.

Each phase is one host function that allocates its outputs and launches its kernels, on
channels_last tensors seen as [N*H*W, C] matrices without a copy: :func:`statistics` and
:func:`statistics_from_sums` (the batch's mean and 1/std, the running statistics updated),
:func:`normalise` and :func:`normalise_from_sums` (normalise, add, ReLU, the ReLU's mask as bits:
:func:`mask_bits`), :func:`gradient_sums` and :func:`input_gradients` (the backward). A shortcut
BatchNorm that the residual add applies itself travels as a :class:`Shortcut`; statistics still
as a convolution's sums as :class:`Sums`. scripts/perf/bn_kernel_sweep.py times these functions.
"""

import json
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import bntriton
from .bntriton import triton


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
MASK_NONE, MASK_FROM_BITS, MASK_FROM_INPUT = 0, 1, 2  # the backward's ReLU mask



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


def to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def mask_kind(relu: bool, has_res: bool) -> int:
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
    bntriton._partial_stats[(parts, triton.cdiv(c, block_c))](_rows(x), pmean, pm2, m, c, rows, BLOCK_M=block_m,
                                                     BLOCK_C=block_c, STAGES=launch.stages, num_warps=launch.warps)
    finish_c = min(FINISH_C, triton.next_power_of_2(c))
    bntriton._finish_stats[(triton.cdiv(c, finish_c),)](pmean, pm2, mean, invstd, running_mean, running_var,
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
    with_bits = mask_kind(relu, residual is not None) == MASK_FROM_BITS
    bits = mask_bits(x) if with_bits else x.new_empty(0, dtype=torch.int32)
    xs = _rows(x)
    sc = shortcut or Shortcut(weight, bias, mean, invstd)  # unread without a shortcut BatchNorm
    st = sums or Sums(mean, invstd, mean, invstd, mean, 0.0, 0.0)  # unread without sums
    rst = res_sums or st  # unread without both
    bntriton._apply[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
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
    bntriton._partial_grad[(parts, triton.cdiv(c, block_c))](
        dys, _rows(dy2) if dy2 is not None else dys, bits if mask == MASK_FROM_BITS else xs, xs,
        _rows(g) if keep_g else xs, _rows(shortcut[0]) if shortcut is not None else xs,
        shortcut[1].mean if shortcut is not None else mean, mean, invstd, weight, bias, psg, psgx, psgr, m, c, rows,
        bits.shape[-1] if mask == MASK_FROM_BITS else 0, TWO_GRADS=dy2 is not None, MASK=mask, KEEP_G=keep_g,
        RES_BN=shortcut is not None, BLOCK_M=block_m, BLOCK_C=block_c, WORD=_word(c), STAGES=launch.stages,
        num_warps=launch.warps)
    finish_c = min(FINISH_C, triton.next_power_of_2(c))
    bntriton._finish_grad[(triton.cdiv(c, finish_c),)](psg, psgx, invstd, sg, sgx, dw, db, c, parts,
                                              BLOCK_P=FINISH_P, BLOCK_C=finish_c)
    sums_r = None
    if shortcut is not None:
        sc = shortcut[1]
        sgr, dw_r, db_r = torch.empty_like(sgx), torch.empty_like(sc.weight), torch.empty_like(sc.bias)
        # its sum of g is this layer's: sg is written again with the same values
        bntriton._finish_grad[(triton.cdiv(c, finish_c),)](psg, psgr, sc.invstd, sg, sgr, dw_r, db_r, c, parts,
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
    bntriton._grad_input[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
        dys, _rows(dy2) if dy2 is not None else dys, bits if mask == MASK_FROM_BITS else xs, xs, _rows(dx), mean,
        invstd, weight, bias, sg, sgx, m, c, bits.shape[-1] if mask == MASK_FROM_BITS else 0,
        TWO_GRADS=dy2 is not None, MASK=mask, BLOCK_M=block_m, BLOCK_C=block_c, WORD=_word(c),
        num_warps=launch.warps)
    return dx



def statistics_from_sums(sums: torch.Tensor, squares: torch.Tensor, count: int, running_mean: torch.Tensor,
                         running_var: torch.Tensor, momentum: float, eps: float,
                         batches: Optional[torch.Tensor] = None) -> tuple:
    """The batch's per-channel (mean, 1/std) in float32 from the per-channel sum and sum of squares
    of ``count`` values each; updates the running statistics in place, and ``batches`` as
    :func:`statistics` does."""
    c = sums.shape[0]
    mean, invstd = torch.empty_like(sums), torch.empty_like(sums)
    block_c = min(triton.next_power_of_2(c), 128)
    bntriton._stats_from_sums[(triton.cdiv(c, block_c),)](sums, squares, mean, invstd, running_mean, running_var,
                                                 batches if batches is not None else mean, count, c, eps, momentum,
                                                 COUNT=batches is not None, BLOCK_C=block_c)
    return mean, invstd
