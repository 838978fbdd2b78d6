"""The Triton kernels of the fused training-mode BatchNorm + residual add + ReLU (``--bn-kernel triton``).

In a ResNet step BatchNorm, the ReLU, the residual add and their gradients are separate passes
over the activations in memory (their time per step: docs/BENCHMARKS.md). These kernels make a
layer cost the passes its arithmetic needs, over a channels_last activation seen as an [M, C]
matrix (M = N*H*W rows): forward, :func:`_partial_stats` and :func:`_finish_stats` (the
per-channel statistics: tile sums combined in a fixed order, so deterministic) and :func:`_apply`
(normalise, add, ReLU); backward, :func:`_partial_grad` and :func:`_finish_grad` (the two
per-channel gradient sums, writing the residual's gradient on the way) and :func:`_grad_input`.
Where a residual was added the forward writes the ReLU's mask as bits (:func:`_store_bits`, read
off the rounded output as torch's backward reads it); without one the backward recomputes it
from the input. :func:`_apply` may also normalise the shortcut BatchNorm's raw input as it loads
it, and make the batch's statistics itself from a convolution's per-channel sums
(:func:`_batch_statistics`, ``--bn-kernel cudnn``). Arithmetic is float32; each stored tensor is
rounded once; running statistics follow torch's rule, except that a channel whose batch statistics
are NaN/inf (an overflowed forward) keeps its running statistics.

The kernels' names are what profiles show (scripts/perf/step_matrix.py classifies them by name);
:mod:`imagenet.kernels.bnlaunch` launches them, :mod:`imagenet.kernels.fusedbn` wraps the
launches as ``torch.library`` ops. ``triton`` is None in a torch without Triton, and then no
kernel is defined.
"""

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None


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
        # A channel whose batch statistics are NaN/inf (an fp16 forward that overflowed: its step is
        # skipped) leaves its running statistics as they were; folded in, they would stay NaN for
        # good, and with them every validation after (pytorch/pytorch#88474).
        rm = tl.load(rmean_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        rv = tl.load(rvar_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        unbiased = var * M / tl.maximum(M - 1, 1)
        # The mean is the guard that counts: any inf/NaN input makes it non-finite, while the
        # variance's clamp at 0 (tl.maximum does not propagate NaN on the GPU) can hide a NaN there.
        finite = (tl.abs(mean) < float("inf")) & (unbiased < float("inf"))  # False for NaN too
        new_rm = tl.where(finite, (1.0 - momentum) * rm + momentum * mean, rm)
        new_rv = tl.where(finite, (1.0 - momentum) * rv + momentum * unbiased, rv)
        tl.store(rmean_ptr + c, new_rm.to(rmean_ptr.dtype.element_ty), mask=c_ok)
        tl.store(rvar_ptr + c, new_rv.to(rvar_ptr.dtype.element_ty), mask=c_ok)

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

