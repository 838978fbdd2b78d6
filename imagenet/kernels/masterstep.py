"""``--fp16``'s optimizer step as two Triton kernels (``--optimizer-impl triton``): :class:`MasterStep`.

Why: torch takes four multi-tensor passes for it: the fp16 gradients copied into float32, those
unscaled and checked for inf/NaN, its fused SGD over the float32 masters, and the masters copied
back into the fp16 model: about 40 bytes moved a parameter. Here one kernel reads each gradient
for the inf/NaN check (2 bytes a parameter), and a second, unless the first found one, reads the
gradient, master and momentum and writes the master, momentum and fp16 weight (20 bytes).

The arithmetic is torch's: the gradient times the inverse loss scale in float32 (its unscale),
then its fused SGD's, in float64 as its CUDA kernel does, rounded to float32 where that kernel
rounds; the weight is the master rounded to the model's dtype. The optimizer stays a
``torch.optim.SGD``: each step reads its groups' settings (lr, momentum, dampening, weight decay,
nesterov, maximize) and updates its momentum buffers in place, so schedules and checkpoints are
unchanged. Triton has no tensor lists: the kernels find each tensor in a table of addresses, one
program per block of one tensor; the addresses are sent again when one changes (the gradients
are new tensors every step, but under CUDA graphs they come back at the same addresses), the
blocks only when the set of tensors does.
A group marked ``lars`` (:class:`~imagenet.precision.lars.Lars`, ``--optimizer lars``) needs
each tensor's norms first: there the first kernel also sums the squares of each program's block
of the master and of the unscaled gradient (4 more bytes a parameter), a third kernel, one program
a tensor, adds up its programs' sums in a fixed order (no atomics: the same answer every run) into
the tensor's trust ratio, and the update multiplies the decayed gradient by it before the momentum.
``TRITON_INTERPRET=1`` runs the kernels on a CPU (tests).
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import torch

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None

# Elements of one tensor a program, and its warps. Triton's interpreter runs programs one by one
# in Python: larger ones there keep a CPU test of ResNet-18 to seconds a step.
BLOCK = 1 << 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
WARPS = 4
TRUST_CHUNK = 1024  # programs' sums a LARS trust-ratio program adds up at once
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _bits(x: float) -> int:
    """The bits of ``x`` as a float64, as an int64 (Triton passes a Python float as float32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


if triton is not None:
    @triton.jit
    def _address(table_ptr, row, t, T, like_ptr, ALIGNED: tl.constexpr):
        # The address of tensor t's row-th tensor (rows: 0 gradient, 1 master, 2 momentum, 3
        # weight), typed as like_ptr; ALIGNED: 16-byte aligned, which lets Triton use vector
        # loads and stores.
        address = tl.load(table_ptr + row * T + t)
        if ALIGNED:
            address = tl.multiple_of(address, 16)
        return address.to(tl.pointer_type(like_ptr.dtype.element_ty))

    @triton.jit
    def _float64(bits):
        # A float64 passed as its bits. Triton types an int by its value (0, the bits of 0.0, is an
        # int32), so it is widened to int64 first.
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    @triton.jit
    def _master_check(blocks_ptr, table_ptr, numel_ptr, T, found_inf_ptr, inv_scale_ptr, sums_ptr, grad_like,
                      master_like, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, NORMS: tl.constexpr):
        # One program: block j of tensor t's gradient; sets found_inf to 1.0 if it holds an inf or NaN.
        # NORMS: also stores the block's sums of squares of the master and the unscaled gradient.
        pid = tl.program_id(0)
        t = tl.load(blocks_ptr + 2 * pid)
        j = tl.load(blocks_ptr + 2 * pid + 1)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tl.load(numel_ptr + t)
        g = tl.load(_address(table_ptr, 0, t, T, grad_like, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
        bad = tl.max(((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32), axis=0)
        tl.store(found_inf_ptr, 1.0, mask=bad > 0)
        if NORMS:
            g = g * tl.load(inv_scale_ptr)  # torch's unscale
            p = tl.load(_address(table_ptr, 1, t, T, master_like, ALIGNED) + offs, mask=mask, other=0.0)
            tl.store(sums_ptr + 2 * pid, tl.sum(p * p, axis=0))
            tl.store(sums_ptr + 2 * pid + 1, tl.sum(g * g, axis=0))

    @triton.jit(do_not_specialize=["decay_bits", "eta_bits", "eps_bits"])
    def _master_trust(first_ptr, count_ptr, sums_ptr, ratio_ptr, decay_bits, eta_bits, eps_bits,
                      CHUNK: tl.constexpr):
        # One program: tensor t. Adds up its programs' sums of squares (programs first .. first +
        # count - 1 of the check) in a fixed order and stores its LARS trust ratio (float32, as
        # imagenet.precision.lars.trust_ratios computes it).
        t = tl.program_id(0)
        first = tl.load(first_ptr + t)
        count = tl.load(count_ptr + t)
        w2 = tl.zeros([CHUNK], dtype=tl.float32)
        g2 = tl.zeros([CHUNK], dtype=tl.float32)
        for k in range(0, count, CHUNK):
            idx = k + tl.arange(0, CHUNK)
            inside = idx < count
            w2 += tl.load(sums_ptr + 2 * (first + idx), mask=inside, other=0.0)
            g2 += tl.load(sums_ptr + 2 * (first + idx) + 1, mask=inside, other=0.0)
        w = tl.sqrt(tl.sum(w2, axis=0))
        g = tl.sqrt(tl.sum(g2, axis=0))
        decay = _float64(decay_bits).to(tl.float32)
        ratio = _float64(eta_bits).to(tl.float32) * w / (g + decay * w + _float64(eps_bits).to(tl.float32))
        tl.store(ratio_ptr + t, tl.where((w > 0) & (g > 0), ratio, 1.0))

    @triton.jit(do_not_specialize=["lr_bits", "decay_bits", "momentum_bits", "undamped_bits"])
    def _master_update(blocks_ptr, table_ptr, numel_ptr, T, found_inf_ptr, inv_scale_ptr, ratio_ptr, grad_like,
                       master_like, lr_bits, decay_bits, momentum_bits, undamped_bits, BLOCK: tl.constexpr,
                       ALIGNED: tl.constexpr, DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
                       NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, LARS: tl.constexpr):
        # One program: block j of tensor t. Nothing is read or written when found_inf is set.
        t = tl.load(blocks_ptr + 2 * tl.program_id(0))
        j = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        flag = tl.load(found_inf_ptr + tl.zeros_like(offs))  # one value, as a block
        mask = (offs < tl.load(numel_ptr + t)) & (flag == 0)
        lr = _float64(lr_bits)
        g_ptr = _address(table_ptr, 0, t, T, grad_like, ALIGNED) + offs
        m_ptr = _address(table_ptr, 1, t, T, master_like, ALIGNED) + offs
        w_ptr = _address(table_ptr, 3, t, T, grad_like, ALIGNED) + offs
        g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32) * tl.load(inv_scale_ptr)  # torch's unscale
        p = tl.load(m_ptr, mask=mask, other=0.0)
        # torch's fused SGD from here: float64 arithmetic, float32 values in between.
        if MAXIMIZE:
            g = -g
        if DECAY:
            g = (g.to(tl.float64) + _float64(decay_bits) * p.to(tl.float64)).to(tl.float32)
        if LARS:  # the decayed gradient times the tensor's trust ratio, then SGD's momentum without decay
            g = g * tl.load(ratio_ptr + t)
        if MOMENTUM:
            momentum = _float64(momentum_bits)
            b_ptr = _address(table_ptr, 2, t, T, master_like, ALIGNED) + offs
            b = (momentum * tl.load(b_ptr, mask=mask, other=0.0).to(tl.float64)
                 + _float64(undamped_bits) * g.to(tl.float64))
            tl.store(b_ptr, b.to(tl.float32), mask=mask)
            if NESTEROV:
                g = (g.to(tl.float64) + momentum * b).to(tl.float32)
            else:
                g = b.to(tl.float32)
        p = (p.to(tl.float64) - lr * g.to(tl.float64)).to(tl.float32)
        tl.store(m_ptr, p, mask=mask)
        tl.store(w_ptr, p.to(w_ptr.dtype.element_ty), mask=mask)


def _blocks(numels: list, block: int) -> tuple:
    """(tensor, block of it) for every program, flattened, int64: ``block`` elements a program;
    and each tensor's first program and count of programs (int64)."""
    counts = (torch.tensor(numels, dtype=torch.int64) + block - 1) // block
    first = torch.cumsum(counts, 0) - counts
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    return torch.stack([tensor, torch.arange(int(counts.sum())) - first[tensor]], 1).reshape(-1), first, counts


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # from pinned memory: the copy does not make the host wait
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class _Launch:
    """The tensors of one optimizer group whose model weights share a dtype: their sizes and
    programs on the device (made once), and their addresses (gradient, master, momentum, weight;
    a row each), set by :meth:`point` whenever one changes."""

    def __init__(self, group: dict, dtype: torch.dtype, numels: list, device: torch.device):
        self.group, self.device, self.count = group, device, len(numels)
        self.block, self.warps = BLOCK, WARPS
        blocks, first, counts = _blocks(numels, self.block)
        self.programs = blocks.numel() // 2
        n = self.count
        sizes = _to_device(torch.cat([torch.tensor(numels, dtype=torch.int64), first, counts, blocks]), device)
        self.numels, self.first, self.counts, self.blocks = sizes[:n], sizes[n:2 * n], sizes[2 * n:3 * n], sizes[3 * n:]
        self.grad_like = torch.empty(0, dtype=dtype, device=device)  # the pointer types
        self.master_like = torch.empty(0, dtype=torch.float32, device=device)
        # LARS: each program's two sums of squares, each tensor's trust ratio (written before read)
        self.sums = torch.empty(2 * self.programs, dtype=torch.float32, device=device)
        self.ratios = torch.empty(n, dtype=torch.float32, device=device)
        self.addresses: Optional[torch.Tensor] = None
        self.aligned = False

    def point(self, rows: list) -> None:
        """Take this step's addresses: ``rows`` of gradients, masters, momentum, weights."""
        flat = [a for row in rows for a in row]
        self.aligned = all(a % 16 == 0 for a in flat)  # vector loads and stores where all are
        self.addresses = _to_device(torch.tensor(flat, dtype=torch.int64), self.device)

    @property
    def lars(self) -> bool:
        return bool(self.group.get("lars", False))

    def check(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """The inf/NaN check (and for LARS, each block's sums of squares, then each tensor's trust ratio)."""
        T, g = self.count, self.group
        _master_check[(self.programs,)](self.blocks, self.addresses, self.numels, T, found_inf, inv_scale, self.sums,
                                        self.grad_like, self.master_like, BLOCK=self.block, ALIGNED=self.aligned,
                                        NORMS=self.lars, num_warps=self.warps)
        if self.lars:
            _master_trust[(T,)](self.first, self.counts, self.sums, self.ratios, _bits(g["weight_decay"]),
                                _bits(g["eta"]), _bits(g["eps"]), CHUNK=TRUST_CHUNK, num_warps=WARPS)

    def update(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """Unscale, decay, (LARS: scale by the trust ratio,) momentum, masters and weights, unless found_inf."""
        g = self.group
        _master_update[(self.programs,)](self.blocks, self.addresses, self.numels, self.count, found_inf, inv_scale,
                                         self.ratios, self.grad_like, self.master_like, _bits(g["lr"]),
                                         _bits(g["weight_decay"]), _bits(g["momentum"]), _bits(1 - g["dampening"]),
                                         BLOCK=self.block, ALIGNED=self.aligned, DECAY=g["weight_decay"] != 0,
                                         MOMENTUM=g["momentum"] != 0, NESTEROV=bool(g["nesterov"]),
                                         MAXIMIZE=bool(g.get("maximize", False)), LARS=self.lars,
                                         num_warps=self.warps)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its span of memory (any order of dimensions): the kernels
    walk its memory, not its indices."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _same_layout(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x`` lays out its elements in memory as ``w`` does (same shape; the strides of
    dimensions of size 1 never matter, and autograd's gradients may differ there)."""
    return x.shape == w.shape and all(a == b for a, b, n in zip(x.stride(), w.stride(), w.shape) if n > 1)


class MasterStep:
    """The master-weight step of ``optimizer`` (a ``torch.optim.SGD`` over ``masters``, the float32
    copies of the model's ``weights``, in order) as the module's two kernels.

    Calling it with the overflow flag (a 1-element float32 tensor, zero) and the inverse loss
    scale (1-element float32) checks every gradient, sets the flag on an inf or NaN, and otherwise
    unscales the gradients and updates masters, momentum and weights. It answers None when it
    ran, or why this step's tensors do not fit the kernels, having launched nothing. Weights
    without a gradient this step are left alone, as torch's SGD leaves them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, weights: list, masters: list):
        self.optimizer = optimizer
        self.weights, self.masters = list(weights), list(masters)
        self.rebuilds = 0  # tables built so far (tests)
        self._key: Optional[tuple] = None
        self._plans: dict = {}  # (group, dtype, members) -> its _Launch, in launch order
        self._why: Optional[str] = None

    def _addresses(self) -> tuple:
        """The table's key: every gradient's and momentum buffer's address (0: none), and the
        optimizer's groups (``load_state_dict`` replaces them with new dicts, whose settings the
        schedule then sets; the launches hold the dicts, so an id is not reused while they do)
        with whether each has momentum (a group given momentum needs its buffers in the table)."""
        grads = tuple(0 if w.grad is None else w.grad.data_ptr() for w in self.weights)
        buffers = (self.optimizer.state.get(m, {}).get("momentum_buffer") for m in self.masters)
        groups = tuple((id(g), g["momentum"] != 0) for g in self.optimizer.param_groups)
        return grads + tuple(0 if b is None else b.data_ptr() for b in buffers) + groups

    def _build(self) -> Optional[str]:
        """The launches for this step's tensors, or why they do not fit."""
        index = {id(m): i for i, m in enumerate(self.masters)}
        plans, device = {}, self.masters[0].device
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                return "a learning rate held as a tensor"
            if group.get("lars") and group.get("maximize"):
                return "LARS does not maximize"
            by_dtype: dict = {}
            for m in group["params"]:
                i = index.get(id(m))
                if i is None:
                    return "the optimizer updates a tensor that is not a master weight"
                w = self.weights[i]
                g = w.grad
                if g is None or w.numel() == 0:
                    continue
                buf = self.optimizer.state.get(m, {}).get("momentum_buffer")
                if group["momentum"] != 0 and buf is None:
                    return "a momentum buffer is missing"
                tensors = (g, m, buf if buf is not None else m, w)
                if w.dtype not in _DTYPES or g.dtype != w.dtype or m.dtype != torch.float32 or (
                        buf is not None and buf.dtype != torch.float32):
                    return "a gradient's, weight's or master's dtype is not the kernels'"
                if any(x.device != device or not _same_layout(x, w) or not _dense(x) for x in tensors):
                    return "a parameter's gradient, weight, master or momentum differ in layout or device"
                by_dtype.setdefault(w.dtype, []).append((i, tensors))
            for dtype, members in by_dtype.items():
                # the sizes and programs stay while the same tensors step; only addresses change
                key = (id(group), dtype, tuple(i for i, _ in members))
                launch = self._plans.get(key) or _Launch(group, dtype, [x[3].numel() for _, x in members], device)
                launch.point([[x[r].data_ptr() for _, x in members] for r in range(4)])
                plans[key] = launch
        self._plans = plans
        self.rebuilds += 1
        return None

    def __call__(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> Optional[str]:
        key = self._addresses()
        if key != self._key:
            self._why = self._build()
            self._key = key
        if self._why is not None:
            return self._why
        for launch in self._plans.values():
            launch.check(found_inf, inv_scale)
        for launch in self._plans.values():
            launch.update(found_inf, inv_scale)
        return None
