"""The ResNet stem's max-pool (3x3, stride 2, padding 1) as two Triton kernels (``--maxpool-kernel``).

Why: the backward pass of that one max-pool takes 1.83 ms of a 41.5 ms ResNet-50 step in eager
fp16 (torch's NHWC kernel) and 1.46 ms of 35.7 ms compiled (Inductor's), on one H200 at batch
256 (docs/BENCHMARKS.md), for a tensor it could write in about 0.15 ms. Both scan, for every
input pixel, the windows that may have picked it and re-derive each window's winner from a
saved index of the whole plane.

Here the forward writes the pooled values and, for each one, the position (0..8) of the
window's maximum as one byte, two output rows a program (their windows share an input row,
loaded once for both); the backward visits each window once, with the three after it in
its row and column, and writes the four input pixels at its centre's even row and column and
after them: each lies in one, two or four of those windows (stride 2 leaves no more), and adds,
in float32, the gradients of those whose byte names it. The winner is torch's: the first maximum in
row-major window order, a NaN replacing it (so a window holding NaNs passes its gradient to the
last NaN, as torch does); the sum runs over the windows in torch's order. So the gradient
equals torch's up to the rounding of a sum of at most four float32 terms.

Only channels_last CUDA tensors of that geometry take the kernels (the stem of every ResNet
here run with ``--channels-last``); anything else runs ``torch.nn.functional.max_pool2d``. The
kernels are a ``torch.library`` custom op with its own backward, so torch.compile keeps them as
they are and CUDA graphs capture them. ``TRITON_INTERPRET=1`` runs them on a CPU (tests).
"""

import os  # no "from __future__ import annotations": torch.library reads the op signatures' annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None

# Triton reads TRITON_INTERPRET when it defines the kernels; read here once too, so that takes()
# inside torch.compile reads no environment (which breaks the graph on torch before 2.5)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Programs' sizes, the fastest of a sweep on an H200 at the ResNet-50 stem's -b 256 shape (docs/BENCHMARKS.md)
FORWARD_W, FORWARD_WARPS = 32, 4  # the forward: output columns per program (of two rows), warps
BACKWARD_P, BACKWARD_WARPS = 32, 2  # the backward: windows per program, warps
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def takes(x: torch.Tensor) -> bool:
    """Whether ``x`` (the max-pool's input) goes through the kernels."""
    return (triton is not None and (x.is_cuda or _INTERPRETED) and x.dim() == 4 and x.dtype in _DTYPES
            and x.is_contiguous(memory_format=torch.channels_last) and x.shape[2] > 0 and x.shape[3] > 0)


def out_size(n: int) -> int:
    return (n - 1) // 2 + 1  # floor((n + 2 * 1 - 3) / 2) + 1


def _nhwc_empty(n: int, c: int, h: int, w: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty_strided((n, c, h, w), (h * w * c, 1, w * c, c), dtype=dtype, device=device)


if triton is not None:
    # The kernels below ran compiled on an H200 (tests/test_maxpool.py, docs/BENCHMARKS.md).
    @triton.jit
    def _pooled_input(x_ptr, row, ih, iw, c, w_ok, c_ok, C, H, W):
        # Input row ih of image row ``row`` (n * H + ih), columns iw, as float32: -inf outside the
        # image (the max-pool's padding).
        inside = w_ok & (iw >= 0) & (iw < W) & (ih >= 0) & (ih < H)
        return tl.load(x_ptr + (row.to(tl.int64) * W * C + (iw * C)[:, None] + c[None, :]),
                       mask=inside[:, None] & c_ok[None, :], other=float("-inf")).to(tl.float32)

    @triton.jit
    def _take(v, best, arg, k: tl.constexpr):
        take = (v > best) | (v != v)  # strictly greater: the first maximum wins; NaN always
        return tl.where(take, v, best), tl.where(take, k, arg)

    @triton.jit
    def _stem_maxpool_forward(x_ptr, y_ptr, idx_ptr, C, H, W, OH, OW, BLOCK_W: tl.constexpr,
                              BLOCK_C: tl.constexpr):
        # One program: output rows oh and oh + 1 (oh even) of image n, BLOCK_W columns x BLOCK_C
        # channels, NHWC. Their windows cover input rows 2oh-1 .. 2oh+3; row 2oh+1 is the last of
        # row oh's windows and the first of row oh+1's, so it is loaded once for both (15 loads
        # for two rows, not 18). Each window takes its rows and columns in row-major order.
        pairs = (OH + 1) // 2
        n = tl.program_id(0) // pairs
        oh = (tl.program_id(0) % pairs) * 2
        ow = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        w_ok = ow < OW
        c_ok = c < C
        # The centre is always inside the image; a window of -inf only (never after BN + ReLU)
        # keeps it, where torch may name another of its pixels.
        best0 = tl.full((BLOCK_W, BLOCK_C), float("-inf"), tl.float32)
        arg0 = tl.full((BLOCK_W, BLOCK_C), 4, tl.int32)
        best1 = tl.full((BLOCK_W, BLOCK_C), float("-inf"), tl.float32)
        arg1 = tl.full((BLOCK_W, BLOCK_C), 4, tl.int32)
        for r in tl.static_range(5):
            ih = oh * 2 - 1 + r
            for kw in tl.static_range(3):
                v = _pooled_input(x_ptr, n * H + ih, ih, ow * 2 - 1 + kw, c, w_ok, c_ok, C, H, W)
                if r <= 2:
                    best0, arg0 = _take(v, best0, arg0, r * 3 + kw)
                if r >= 2:
                    best1, arg1 = _take(v, best1, arg1, (r - 2) * 3 + kw)
        out = (n * OH + oh).to(tl.int64) * OW * C + (ow * C)[:, None] + c[None, :]
        ok = w_ok[:, None] & c_ok[None, :]
        tl.store(y_ptr + out, best0.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(idx_ptr + out, arg0.to(tl.int8), mask=ok)
        ok1 = ok & (oh + 1 < OH)
        tl.store(y_ptr + out + OW * C, best1.to(y_ptr.dtype.element_ty), mask=ok1)
        tl.store(idx_ptr + out + OW * C, arg1.to(tl.int8), mask=ok1)

    @triton.jit
    def _window(g_ptr, idx_ptr, n, k, j, c, p_ok, c_ok, C, OH, OW):
        # Window (k, j)'s winner bytes and gradient (float32); -1 and 0 outside the output.
        ok = p_ok & (k < OH) & (j < OW)
        offs = ((n * OH + k) * OW + j).to(tl.int64) * C
        m = ok[:, None] & c_ok[None, :]
        won = tl.load(idx_ptr + offs[:, None] + c[None, :], mask=m, other=-1).to(tl.int32)
        g = tl.load(g_ptr + offs[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        return won, g

    @triton.jit
    def _store_pixel(dx_ptr, acc, n, ih, iw, c, p_ok, c_ok, C, H, W):
        ok = p_ok & (ih < H) & (iw < W)
        out = ((n * H + ih) * W + iw).to(tl.int64) * C
        tl.store(dx_ptr + out[:, None] + c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=ok[:, None] & c_ok[None, :])

    @triton.jit
    def _stem_maxpool_backward(g_ptr, idx_ptr, dx_ptr, windows, C, H, W, OH, OW, BLOCK_P: tl.constexpr,
                               BLOCK_C: tl.constexpr):
        # One program: BLOCK_P windows (n, k, j) x BLOCK_C channels, NHWC; it writes the four
        # input pixels (2k + a, 2j + b), a, b in {0, 1}. Window k covers rows 2k-1 .. 2k+1, so
        # row 2k lies in window k only (at kh = 1) and row 2k+1 in windows k (kh = 2) and k+1
        # (kh = 0); likewise for columns. The four windows (k, j), (k, j+1), (k+1, j), (k+1, j+1)
        # are loaded once for the four pixels (a program per pixel loaded each up to four times),
        # and each pixel adds, in float32 and in torch's order (the earlier window first), the
        # gradients of those whose byte names it (kh * 3 + kw).
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        p_ok = p < windows
        c_ok = c < C
        j = p % OW
        k = (p // OW) % OH
        n = p // (OW * OH)
        w00, g00 = _window(g_ptr, idx_ptr, n, k, j, c, p_ok, c_ok, C, OH, OW)
        w01, g01 = _window(g_ptr, idx_ptr, n, k, j + 1, c, p_ok, c_ok, C, OH, OW)
        w10, g10 = _window(g_ptr, idx_ptr, n, k + 1, j, c, p_ok, c_ok, C, OH, OW)
        w11, g11 = _window(g_ptr, idx_ptr, n, k + 1, j + 1, c, p_ok, c_ok, C, OH, OW)
        zero = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
        _store_pixel(dx_ptr, zero + tl.where(w00 == 4, g00, 0.0), n, 2 * k, 2 * j, c, p_ok, c_ok, C, H, W)
        _store_pixel(dx_ptr, zero + tl.where(w00 == 5, g00, 0.0) + tl.where(w01 == 3, g01, 0.0),
                     n, 2 * k, 2 * j + 1, c, p_ok, c_ok, C, H, W)
        _store_pixel(dx_ptr, zero + tl.where(w00 == 7, g00, 0.0) + tl.where(w10 == 1, g10, 0.0),
                     n, 2 * k + 1, 2 * j, c, p_ok, c_ok, C, H, W)
        _store_pixel(dx_ptr, zero + tl.where(w00 == 8, g00, 0.0) + tl.where(w01 == 6, g01, 0.0)
                     + tl.where(w10 == 2, g10, 0.0) + tl.where(w11 == 0, g11, 0.0),
                     n, 2 * k + 1, 2 * j + 1, c, p_ok, c_ok, C, H, W)


def _channel_block(c: int) -> int:
    return min(triton.next_power_of_2(c), 64)


def pool_like(x: torch.Tensor) -> tuple:
    """Empty (pooled values, winner bytes) for a max-pool of ``x``, channels_last."""
    n, c, h, w = x.shape
    oh, ow = out_size(h), out_size(w)
    return _nhwc_empty(n, c, oh, ow, x.dtype, x.device), _nhwc_empty(n, c, oh, ow, torch.int8, x.device)


@torch.library.custom_op("imagenet::stem_maxpool", mutates_args=())
def stem_maxpool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled values, winner byte per value) of a channels_last NCHW tensor; both channels_last."""
    x = x.contiguous(memory_format=torch.channels_last)  # the kernel reads dense NHWC; a no-op when it is
    n, c, h, w = x.shape
    y, idx = pool_like(x)
    oh, ow = y.shape[2:]
    if x.numel():
        block_c = _channel_block(c)
        grid = (n * triton.cdiv(oh, 2), triton.cdiv(ow, FORWARD_W), triton.cdiv(c, block_c))
        _stem_maxpool_forward[grid](x, y, idx, c, h, w, oh, ow, BLOCK_W=FORWARD_W, BLOCK_C=block_c,
                                    num_warps=FORWARD_WARPS)
    return y, idx


@stem_maxpool.register_fake
def _(x):
    return pool_like(x)


@torch.library.custom_op("imagenet::stem_maxpool_backward", mutates_args=())
def stem_maxpool_backward(grad: torch.Tensor, idx: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The input's gradient from the output's and the forward's winner bytes."""
    grad = grad.contiguous(memory_format=torch.channels_last)  # a no-op: _backward_rule made it so
    idx = idx.contiguous(memory_format=torch.channels_last)  # as the forward wrote it: a no-op
    n, c, oh, ow = idx.shape
    dx = _nhwc_empty(n, c, height, width, grad.dtype, grad.device)
    if dx.numel():
        windows, block_c = n * oh * ow, _channel_block(c)
        _stem_maxpool_backward[(triton.cdiv(windows, BACKWARD_P), triton.cdiv(c, block_c))](
            grad, idx, dx, windows, c, height, width, oh, ow, BLOCK_P=BACKWARD_P, BLOCK_C=block_c,
            num_warps=BACKWARD_WARPS)
    return dx


@stem_maxpool_backward.register_fake
def _(grad, idx, height, width):
    n, c = idx.shape[:2]
    return _nhwc_empty(n, c, height, width, grad.dtype, grad.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.size = inputs[0].shape[2:]


def _backward_rule(ctx, grad, _grad_idx):
    (idx,) = ctx.saved_tensors
    # channels_last where torch.compile sees it: Inductor then writes the gradient in that layout
    # in the kernel that makes it, instead of the op copying one of another layout
    grad = grad.contiguous(memory_format=torch.channels_last)
    return stem_maxpool_backward(grad, idx, ctx.size[0], ctx.size[1])


stem_maxpool.register_autograd(_backward_rule, setup_context=_setup_context)


class StemMaxPool(nn.MaxPool2d):
    """``nn.MaxPool2d(3, 2, 1)`` whose channels_last inputs go through the kernels above."""

    def __init__(self):
        super().__init__(kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(x):
            return stem_maxpool(x)[0]
        return F.max_pool2d(x, 3, 2, 1)


def is_stem_pool(module: nn.Module) -> bool:
    """Whether ``module`` is a max-pool the kernels compute exactly (3x3, stride 2, padding 1)."""
    def pair(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    return (type(module) is nn.MaxPool2d and pair(module.kernel_size) == (3, 3) and pair(module.stride) == (2, 2)
            and pair(module.padding) == (1, 1) and pair(module.dilation) == (1, 1) and not module.ceil_mode
            and not module.return_indices)
