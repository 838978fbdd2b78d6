"""The fused BatchNorm + add + ReLU (imagenet/kernels/fusedbn.py, its kernels and their launches in bntriton.py and
bnlaunch.py, the fused blocks in imagenet/models/fusedresnet.py; --bn-kernel triton) against torch's modules.

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the
variable is read when the kernels are defined), a layer at a time, in a whole ResNet, and
through main.py; on a GPU, compiled, each comparison in a child of its own (all at once), and
through main.py in tests/test_kernel_runs.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from imagenet.base.errors import UserError
from imagenet.models.registry import create_model, has_fused_bn, use_bn_kernels
from tests.helpers import ONE_THREAD, Children, scratch

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
# C over one block; 1-px sides; many rows; several partial results per channel (with partials=2)
LAYERS = [(2, 5, 3, 3), (3, 70, 5, 4), (2, 130, 1, 2), (4, 3, 16, 16), (2, 64, 16, 16)]


def _reference(x, bn, residual, relu, residual_bn=None) -> tuple:
    """(the output, the value the ReLU sees)."""
    if residual_bn is not None:
        residual = residual_bn(residual)
    out = bn(x)
    if residual is not None:
        out = out + residual
    return (F.relu(out) if relu else out), out


def compare_layers(device: str = "cpu", dtypes=("float32", "float16"), partials=4) -> list:
    """bn_act against BatchNorm2d (+ add) (+ ReLU) computed in float64: output, the gradients of
    the input, weight, bias and residual, the running statistics; worst relative error per case.
    ``partials`` small makes the larger layers combine several partial results (``parts``), two
    a step of the finishing kernels, so that tiles of partial results are combined too (each
    image offset by its own mean, so the tiles' means differ); None: as many as the GPU's size
    asks for, combined FINISH_P at a time."""
    from imagenet.kernels import bnlaunch
    before = bnlaunch.PARTIALS, bnlaunch.FINISH_P
    bnlaunch.PARTIALS, bnlaunch.FINISH_P = partials, (2 if partials else bnlaunch.FINISH_P)
    try:
        return _compare_layers(device, dtypes)
    finally:
        bnlaunch.PARTIALS, bnlaunch.FINISH_P = before


def _compare_layers(device: str, dtypes) -> list:
    from imagenet.kernels import bnlaunch, fusedbn
    g = torch.Generator().manual_seed(0)
    # every layer with and without the residual and the ReLU; then, after all of those (so their data
    # stay as they were), every layer's output forked: two gradients, which the backward adds itself;
    # then the residual as a shortcut BatchNorm's raw input, which the add normalises (forked or not)
    cases = [(name, shape, residual_on, relu, False, False) for name in dtypes for shape in LAYERS
             for residual_on, relu in ((False, True), (True, True), (False, False))]
    cases += [(name, shape, True, True, True, False) for name in dtypes for shape in LAYERS]
    cases += [(name, shape, True, True, fork, True) for name in dtypes for shape in LAYERS[:-1] for fork in (False, True)]
    rows = []
    for name, (n, c, h, w), residual_on, relu, fork, shortcut_bn in cases:
        dtype = getattr(torch, name)
        a, b = nn.BatchNorm2d(c).to(device), nn.BatchNorm2d(c).to(device, torch.float64)
        ra_bn, rb_bn = nn.BatchNorm2d(c).to(device), nn.BatchNorm2d(c).to(device, torch.float64)
        with torch.no_grad():
            # drawn on the CPU (the generator's device) and copied, so a GPU run tests the same values
            for bn in (a, ra_bn) if shortcut_bn else (a,):
                bn.weight.copy_(torch.empty(c).uniform_(0.5, 1.5, generator=g))
                bn.bias.copy_(torch.empty(c).uniform_(-0.5, 0.5, generator=g))
        b.load_state_dict(a.state_dict())
        rb_bn.load_state_dict(ra_bn.state_dict())
        offsets = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1) * 1.5  # per image
        x = (torch.randn(n, c, h, w, generator=g) * 2 + 1 + offsets).to(device, dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        r = (torch.randn(n, c, h, w, generator=g) * (2 if shortcut_bn else 1) - (1 if shortcut_bn else 0)).to(
            device, dtype).contiguous(memory_format=torch.channels_last)
        xa, xb = x.clone().requires_grad_(True), x.double().requires_grad_(True)
        ra = r.clone().requires_grad_(True) if residual_on else None
        rb = r.double().requires_grad_(True) if residual_on else None
        ya = fusedbn.bn_act(xa, a, ra, relu, fork=fork, residual_bn=(ra_bn, None) if shortcut_bn else None)
        yb, zb = _reference(xb, b, rb, relu, rb_bn if shortcut_bn else None)
        grad = torch.randn(yb.shape, generator=g).to(device, dtype)
        with _TwoGradientCount(fusedbn) as count:  # one backward pass, the shortcut's BatchNorm's inside it
            if fork:
                grad2 = torch.randn(yb.shape, generator=g).to(device, dtype)
                same = ya[0].data_ptr() == ya[1].data_ptr()  # one tensor twice, not a copy
                torch.autograd.backward(ya, (grad, grad2))
                yb.backward(grad.double() + grad2.double())
                ya = ya[0]
            else:
                same = True
                ya.backward(grad)
                yb.backward(grad.double())
        pairs = [(ya, yb), (xa.grad, xb.grad), (a.weight.grad, b.weight.grad), (a.bias.grad, b.bias.grad),
                 (a.running_mean, b.running_mean), (a.running_var, b.running_var)]
        if residual_on:
            pairs.append((ra.grad, rb.grad))
        if shortcut_bn:
            pairs += [(ra_bn.weight.grad, rb_bn.weight.grad), (ra_bn.bias.grad, rb_bn.bias.grad),
                      (ra_bn.running_mean, rb_bn.running_mean), (ra_bn.running_var, rb_bn.running_var)]
        err = max(float((p.double() - q).abs().max() / (q.abs().max() + 1e-6)) for p, q in pairs)
        parts = bnlaunch._layout(n * h * w, c, torch.device(device))[3]
        rows.append({"case": f"{name} {n}x{c}x{h}x{w} residual={residual_on} relu={relu} fork={fork} "
                             f"shortcut_bn={shortcut_bn}",
                     "parts": parts, "finish_steps": -(-parts // bnlaunch.FINISH_P),
                     "kernel": fusedbn.takes(x, a) and (not shortcut_bn or fusedbn.takes(r, ra_bn)),
                     "backwards": count.calls, "dtype": name, "err": err,
                     "margin": float(zb.abs().min() / zb.abs().max()) if relu else 1.0,
                     "tracked": int(a.num_batches_tracked) == int(b.num_batches_tracked)
                     and int(ra_bn.num_batches_tracked) == int(rb_bn.num_batches_tracked),
                     "layout": same and ya.is_contiguous(memory_format=torch.channels_last)
                     and xa.grad.is_contiguous(memory_format=torch.channels_last)})
    return rows


def mask_bits_against_outputs(device: str = "cpu") -> list:
    """For channel counts within one word, across two, two full ones and past a 128-channel
    program block (3, 33, 64, 130): the ReLU mask bits normalise writes, decoded as the format
    says (channel c is bit c % W of word c // W of its row, W = 32 or the channel block where
    narrower), against the output's own mask (passes where not <= 0): mismatches, words a row,
    bits set, and whether a word's sign bit (bit 31) was set."""
    from imagenet.kernels import bnlaunch
    g = torch.Generator().manual_seed(1)
    rows = []
    for c in (3, 33, 64, 130):
        x, r = (torch.randn(2, c, 3, 5, generator=g).to(device).contiguous(memory_format=torch.channels_last)
                for _ in range(2))
        mean, invstd = x.mean((0, 2, 3)), torch.rsqrt(x.var((0, 2, 3), unbiased=False) + 1e-5)
        y, bits = bnlaunch.normalise(x, r, mean, invstd, torch.ones(c, device=device), torch.zeros(c, device=device),
                                     True)
        word, ch = bnlaunch._word(c), torch.arange(c, device=device)
        decoded = (bits[:, ch // word] >> (ch % word)) & 1  # arithmetic shift, then & 1: bit 31 too
        rows.append({"c": c, "words": bits.shape[1], "set": int(decoded.sum()), "sign_bit": bool((bits < 0).any()),
                     "mismatches": int((decoded.bool() != ~(bnlaunch._rows(y) <= 0)).sum())})
    return rows


TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}  # relative to each tensor's largest value
# The ReLU's input nearest zero, relative to its largest: below this the float32 kernel and the float64
# reference may round a value to opposite sides of zero, and then both gradients are right but differ by
# the whole gradient there. The data are drawn from a seeded generator, so this holds on every machine
# once it holds on one (a case where it does not needs other data, not a looser tolerance).
MARGIN = 1e-6


def _check_layers(rows: list, several_parts: bool = True) -> None:
    assert not several_parts or any(r["finish_steps"] > 1 for r in rows), "no case combined tiles of partial results"
    near_zero = [r["case"] for r in rows if r["margin"] < MARGIN]
    assert not near_zero, f"the test's data put a ReLU input within rounding of zero: {near_zero}"
    bad = [r for r in rows if not (r["kernel"] and r["backwards"] == 1 and r["tracked"] and r["layout"]
                                   and r["err"] <= TOLERANCE[r["dtype"]])]
    assert not bad, bad


class _TwoGradientCount:
    """Counts the BatchNorm backward passes that were handed a forked output's two gradients apart
    (fusedbn.gradient_sums with ``dy2``), eager or inside a compiled graph that runs the ops' kernels."""

    def __init__(self, fusedbn):
        self.fusedbn, self.inner, self.forked, self.calls = fusedbn, fusedbn.gradient_sums, 0, 0

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            self.forked += (args[8] if len(args) > 8 else kwargs.get("dy2")) is not None
            return self.inner(*args, **kwargs)
        self.fusedbn.gradient_sums = counting
        return self

    def __exit__(self, *exc):
        self.fusedbn.gradient_sums = self.inner


def compare_models(device: str = "cpu") -> dict:
    """One training step of a fused and a plain torchvision ResNet (BasicBlock: resnet18;
    Bottleneck with downsampling: a [1, 1, 1, 1] ResNet) in float32 from the same weights and
    input, each against the plain model in float64: the worst relative error over the logits,
    every gradient and every buffer, of the fused model and of torch's own float32 modules.
    (Against float32 torch alone the comparison can mislead: on some inputs torch's CPU
    BatchNorm backward is itself percents off the float64 gradient where the kernels are not.)
    Also how many of the fused model's BatchNorm backward passes took two gradients apart (every
    block's output but the last is read by the next block's convolution and its shortcut)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    from imagenet.kernels import fusedbn
    from imagenet.models.fusedresnet import fuse_resnet
    out = {}
    for name, make in (("resnet18", lambda: create_model("resnet18", 10)),
                       ("bottleneck", lambda: ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10))):
        torch.manual_seed(0)
        plain = make().to(device).to(memory_format=torch.channels_last)
        fused = fuse_resnet(make().to(device).to(memory_format=torch.channels_last))
        fused.load_state_dict(plain.state_dict())
        exact = make().to(device, torch.float64).to(memory_format=torch.channels_last)
        exact.load_state_dict(plain.state_dict())
        # 48 px and 4 images: the last BatchNorms see 16 values a channel (2x2 each; 1x1 at 32 px)
        x = torch.randn(4, 3, 48, 48, device=device).contiguous(memory_format=torch.channels_last)
        outputs = [m(x if m is not exact else x.double()) for m in (fused, plain, exact)]
        with _TwoGradientCount(fusedbn) as count:
            outputs[0].square().mean().backward()
        for y in outputs[1:]:
            y.square().mean().backward()

        def error(m, y) -> float:
            errs = [float((y.double() - outputs[2]).abs().max() / outputs[2].abs().max())]
            for p, q in zip(m.parameters(), exact.parameters()):
                errs.append(float((p.grad.double() - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)))
            for p, q in zip(m.buffers(), exact.buffers()):
                errs.append(float((p.double() - q.double()).abs().max() / (q.double().abs().max() + 1e-12)))
            return max(errs)
        out[name] = {"err": error(fused, outputs[0]), "torch_err": error(plain, outputs[1]),
                     "same_keys": list(fused.state_dict()) == list(plain.state_dict()), "fused": has_fused_bn(fused),
                     "two_gradients": count.forked,
                     "blocks": sum(len(layer) for layer in (fused.layer1, fused.layer2, fused.layer3, fused.layer4))}
    return out


def compare_from_sums(device: str = "cpu", dtypes=("float32", "float16")) -> list:
    """bn_act with the statistics made inside the normalise from the convolutions' sums (one
    kernel) against the two kernels it replaces (statistics_from_sums, then the normalise):
    output, gradients, running statistics and batch counts, which must be the same bits; and
    whether the one-kernel path ran without the statistics' op. Layers with one and several row
    blocks and channel blocks; without a residual, with one, and with a shortcut BatchNorm (its
    eps, momentum and running statistics not the other's), forked or not."""
    import copy
    from imagenet.kernels import fusedbn
    g = torch.Generator().manual_seed(3)
    rows = []
    cl = dict(memory_format=torch.channels_last)
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for shape in ((2, 5, 3, 3), (2, 130, 1, 2), (2, 64, 16, 16), (2, 130, 8, 8)):
            for kind in ("plain", "residual", "shortcut", "shortcut, one output"):
                c = shape[1]
                x = (torch.randn(shape, generator=g) * 2 + 1).to(device, dt).contiguous(**cl)
                raw = (torch.randn(shape, generator=g) * 3 - 1).to(device, dt).contiguous(**cl)
                bn, rbn = nn.BatchNorm2d(c), nn.BatchNorm2d(c, eps=1e-3, momentum=0.3)
                for m in (bn, rbn):
                    with torch.no_grad():
                        m.weight.uniform_(0.5, 1.5, generator=g)
                        m.bias.normal_(generator=g)
                        m.running_mean.normal_(generator=g)
                        m.running_var.uniform_(0.5, 2.0, generator=g)
                        m.num_batches_tracked.fill_(7)
                bn, rbn = bn.to(device), rbn.to(device)

                def sums_of(t):
                    t32 = t.float()
                    return t32.sum((0, 2, 3)), t32.square().sum((0, 2, 3))

                dy = torch.randn(shape, generator=g).to(device, dt).contiguous(**cl)
                dy2 = torch.randn(shape, generator=g).to(device, dt).contiguous(**cl)
                results = []
                for path in ("two kernels", "one kernel"):
                    b, rb = copy.deepcopy(bn), copy.deepcopy(rbn)
                    xi = x.clone().requires_grad_(True)
                    ri = raw.clone().requires_grad_(True)
                    fork = kind == "shortcut"
                    with_bn = kind.startswith("shortcut")
                    residual = ri if kind != "plain" else None
                    residual_bn = (rb, sums_of(raw)) if with_bn else None
                    calls = []
                    if path == "two kernels":  # bn_act before the statistics moved into the normalise
                        mean, invstd = fusedbn._statistics(xi, b, sums_of(x))
                        shortcut = (rb.weight, rb.bias, *fusedbn._statistics(ri, rb, sums_of(raw))) if with_bn \
                            else (None,) * 4
                        inputs = (xi, b.weight, b.bias, residual, mean, invstd, True, *shortcut)
                        y = fusedbn._ForkedBnAct.apply(*inputs) if fork else fusedbn.bn_act_op(*inputs)[0]
                    else:
                        before = fusedbn._statistics
                        fusedbn._statistics = lambda *a: calls.append(1) or before(*a)
                        try:
                            y = fusedbn.bn_act(xi, b, residual, True, fork, sums=sums_of(x), residual_bn=residual_bn)
                        finally:
                            fusedbn._statistics = before
                    if fork:
                        torch.autograd.backward(y, (dy, dy2))
                        y = y[0]
                    else:
                        y.backward(dy)
                    grads = [xi.grad, b.weight.grad, b.bias.grad]
                    if kind != "plain":
                        grads.append(ri.grad)
                    buffers = [b.running_mean, b.running_var, b.num_batches_tracked]
                    if with_bn:
                        grads += [rb.weight.grad, rb.bias.grad]
                        buffers += [rb.running_mean, rb.running_var, rb.num_batches_tracked]
                    results.append(([y.detach()] + grads + buffers, calls))
                (a, _), (bb, calls) = results
                rows.append({"case": f"{dtype} {list(shape)} {kind}", "same": [bool(torch.equal(p, q)) for p, q in
                                                                               zip(a, bb)],
                             "count": int(bb[-1]), "statistics_ops": len(calls)})
    return rows


def overflowed_statistics(device: str = "cpu", dtypes=("float32", "float16")) -> list:
    """A batch whose channel 1 holds an inf and channel 2 a NaN (an fp16 forward that overflowed),
    through each kernel that updates the running statistics: the statistics kernel (bn_act), the
    statistics from the convolutions' sums, and those made inside the normalise. Per path: whether
    channels 1 and 2 kept their running statistics exactly, and the largest error of the other
    channels' against torch's BatchNorm given the same batch with finite values in 1 and 2."""
    import copy
    from imagenet.kernels import fusedbn
    g = torch.Generator().manual_seed(5)
    cl = dict(memory_format=torch.channels_last)
    rows = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        x = (torch.randn(2, 5, 3, 3, generator=g) * 2 + 1).to(dt)
        finite = x.clone()
        x[0, 1, 1, 1], x[1, 2, 0, 2] = float("inf"), float("nan")
        x = x.to(device).contiguous(**cl)
        bn = nn.BatchNorm2d(5)
        with torch.no_grad():
            bn.running_mean.normal_(generator=g)
            bn.running_var.uniform_(0.5, 2.0, generator=g)
        bn = bn.to(device)
        ref = copy.deepcopy(bn)
        ref(finite.to(device).float())  # channels are independent: 0, 3 and 4 are the batch's own
        sums = (x.float().sum((0, 2, 3)), x.float().square().sum((0, 2, 3)))
        for path in ("statistics", "from sums", "in the normalise"):
            b = copy.deepcopy(bn)
            if path == "statistics":
                fusedbn.bn_act(x, b, None, True)
            elif path == "from sums":
                fusedbn._statistics(x, b, sums)
            else:
                fusedbn.bn_act(x, b, None, True, sums=sums)
            kept = all(bool(torch.equal(getattr(b, k)[1:3], getattr(bn, k)[1:3])) for k in ("running_mean", "running_var"))
            others = [0, 3, 4]
            err = max(float((getattr(b, k)[others] - getattr(ref, k)[others]).abs().max())
                      for k in ("running_mean", "running_var"))
            rows.append({"case": f"{dtype} {path}", "kept": kept, "err": err,
                         "finite": bool(torch.isfinite(b.running_mean).all() and torch.isfinite(b.running_var).all())})
    return rows


def _interpreted(code: str) -> subprocess.Popen:
    """A child under Triton's interpreter that runs ``code`` after ``import tests.test_fusedbn as t``
    and prints its result as JSON."""
    return subprocess.Popen([sys.executable, "-c", "import json, sys; sys.path.insert(0, '.'); "
                             "import tests.test_fusedbn as t; " + code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, TRITON_INTERPRET="1", **ONE_THREAD))


class _Started(dict):
    """Child processes by name, started at once; ``result(name)`` waits for one (once)."""

    def __init__(self):
        super().__init__()
        self.done = {}

    def result(self, name: str, timeout: int = 900) -> subprocess.CompletedProcess:
        if name not in self.done:
            proc = self[name]
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            self.done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.done[name]

    def json(self, name: str) -> dict:
        r = self.result(name)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self):
        for proc in self.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def interpreter_runs(tmp_path_factory):
    """Every child of this module that runs the kernels under Triton's interpreter, all started at
    once: the interpreter runs one kernel program at a time in Python, so each child keeps one
    core busy (one after another they took 2 minutes of a 2-core machine's 2.5)."""
    pytest.importorskip("triton")
    with scratch(tmp_path_factory, "fusedbn_main") as out:
        runs = _Started()
        try:
            runs["layers"] = _interpreted("print(json.dumps(t.compare_layers()))")
            runs["models"] = _interpreted("print(json.dumps(t.compare_models()))")
            runs["bits"] = _interpreted("print(json.dumps(t.mask_bits_against_outputs()))")
            runs["compiled"] = _interpreted("print(json.dumps(t.compare_compiled(size=16)))")
            runs["from-sums"] = _interpreted("print(json.dumps(t.compare_from_sums()))")
            runs["overflow"] = _interpreted("print(json.dumps(t.overflowed_statistics()))")
            runs["main-fused"] = _main(out, "fused", "triton",
                                       {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", **ONE_THREAD})
            runs["main-plain"] = _main(out, "plain", "torch", {"CUDA_VISIBLE_DEVICES": "", **ONE_THREAD})
            runs.out = out
            yield runs
        finally:
            runs.stop()


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_layers_match_torch_under_the_interpreter(interpreter_runs):
    _check_layers(interpreter_runs.json("layers"))


def _check_overflow(rows: list) -> None:
    assert len(rows) == 6
    for row in rows:
        assert row["kept"] and row["finite"], row  # not folded in: the running statistics stay finite
        assert row["err"] < 1e-5, row  # the other channels move as torch's BatchNorm moves them


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_a_batch_with_inf_or_nan_leaves_those_channels_running_statistics_under_the_interpreter(interpreter_runs):
    _check_overflow(interpreter_runs.json("overflow"))


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_the_statistics_made_in_the_normalise_are_the_two_kernels_bits_under_the_interpreter(interpreter_runs):
    _check_from_sums(interpreter_runs.json("from-sums"), 2)


def _check_from_sums(rows, dtypes: int):
    assert len(rows) == 16 * dtypes, rows
    for r in rows:
        assert all(r["same"]) and r["statistics_ops"] == 0, r
        assert r["count"] == 8, r  # each BatchNorm's count moved once (from 7)


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_the_mask_bits_are_the_outputs_relu_mask_under_the_interpreter(interpreter_runs):
    rows = interpreter_runs.json("bits")
    assert [r["words"] for r in rows] == [1, 2, 2, 5]  # 4-bit words for 3 channels; 32-bit ones from 33 up
    assert all(r["mismatches"] == 0 and r["set"] > 0 for r in rows), rows
    assert any(r["sign_bit"] for r in rows), rows


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_a_fused_resnet_trains_as_torchvisions_under_the_interpreter(interpreter_runs):
    for name, r in interpreter_runs.json("models").items():
        assert r["fused"] and r["same_keys"] and r["err"] < 1e-4, (name, r)
        assert r["two_gradients"] == r["blocks"] - 1, (name, r)


def compare_compiled(device: str = "cpu", backend: str = "aot_eager", mode=None, steps: int = 1, size: int = 32) -> dict:
    """``steps`` forward and backward passes (gradients accumulating, no optimizer) of a fused
    ResNet-18 eager and of the same model under torch.compile, from the same weights and input:
    the worst relative difference over the last output, the gradients and the buffers; whether
    the compiled run kept the kernels (the ops in its graph); how often Inductor gave up CUDA
    graphs. Under reduce-overhead the first step warms up, the second records the graphs and the
    third replays them, and each parameter's gradient is copied out of the graph's memory after
    every pass (torch's own accumulation over replays reads memory the next replay overwrote:
    the trainer refuses --accum-steps under CUDA graphs). Also the compiled backward passes' count of
    BatchNorm backwards, and of those handed a forked output's two gradients apart (a replayed CUDA
    graph runs no Python, so counts none). ``size``: the images' side; 16 px under the interpreter,
    whose cost grows with the pixels, leaves the last two stages 1x1 over 4 images."""
    from torch._dynamo.utils import counters
    from imagenet.kernels import fusedbn
    from imagenet.models.fusedresnet import fuse_resnet
    torch.manual_seed(0)
    eager = fuse_resnet(create_model("resnet18", 10)).to(device).to(memory_format=torch.channels_last)
    model = fuse_resnet(create_model("resnet18", 10)).to(device).to(memory_format=torch.channels_last)
    model.load_state_dict(eager.state_dict())
    calls = []  # the ops of the graphs torch.compile traces
    x = torch.randn(4, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    if mode is None:  # the backend sees the traced graphs on their way: one trace
        compiled = torch.compile(model, backend=_counting(calls, torch._dynamo.lookup_backend(backend)))
    else:  # a mode goes to Inductor alone: the ops from a second copy's trace, run as traced
        tracer = fuse_resnet(create_model("resnet18", 10)).to(device).to(memory_format=torch.channels_last)
        torch.compile(tracer, backend=_counting(calls))(x)
        compiled = torch.compile(model, backend=backend, mode=mode)
    if mode == "reduce-overhead":
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.grad.clone()))
    skips = counters["inductor"]["cudagraph_skips"]
    outputs = []
    for m in (eager, compiled):
        with _TwoGradientCount(fusedbn) as count:
            for _ in range(steps):
                y = m(x)
                y.square().mean().backward()
        outputs.append(y.detach().clone())  # a CUDA graph's output is overwritten by its next replay
    errs = [float((outputs[1] - outputs[0]).abs().max() / outputs[0].abs().max())]
    for p, q in zip(model.parameters(), eager.parameters()):
        errs.append(float((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)))
    for p, q in zip(model.buffers(), eager.buffers()):
        errs.append(float((p.double() - q.double()).abs().max() / (q.double().abs().max() + 1e-12)))
    return {"err": max(errs), "ops": sorted(set(calls)),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
            "bn_backwards": count.calls, "two_gradients": count.forked,
            "layers": sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()),
            "shortcuts": sum(m.downsample is not None for layer in (model.layer1, model.layer2, model.layer3,
                                                                    model.layer4) for m in layer),
            "blocks": sum(len(layer) for layer in (model.layer1, model.layer2, model.layer3, model.layer4))}


def _check_two_gradients(r: dict) -> None:
    """Every pass that ran the backward's Python handed each block's output but the last its two
    gradients apart; a shortcut's BatchNorm has no backward of its own (the residual add's makes
    its gradient), so a pass runs one BatchNorm backward per layer but those."""
    per_pass = r["layers"] - r["shortcuts"]
    assert r["two_gradients"] > 0 and r["two_gradients"] * per_pass == r["bn_backwards"] * (r["blocks"] - 1), r


def _counting(calls: list, then=None):
    """A torch.compile backend that records the imagenet:: ops of each graph and runs it as traced,
    or hands it on to the backend ``then``."""
    def compile_fn(gm, example_inputs):
        calls.extend(str(n.target) for n in gm.graph.nodes if "imagenet" in str(n.target))
        return gm.forward if then is None else then(gm, example_inputs)
    return compile_fn


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested inside Inductor instead")
def test_the_kernels_inside_torch_compile_under_the_interpreter(interpreter_runs):
    """torch.compile traces the ops (their fake kernels, the autograd rule, the running
    statistics' in-place update) and gives eager's results."""
    r = interpreter_runs.json("compiled")
    assert r["err"] < 1e-5 and r["ops"] == ["imagenet.bn_act.default", "imagenet.bn_stats.default"], r
    _check_two_gradients(r)


def test_without_the_kernels_a_fused_model_is_torchvisions():
    # On a CPU without the interpreter every layer takes torch's modules: identical results.
    from imagenet.models.fusedresnet import fuse_resnet
    torch.manual_seed(0)
    plain = create_model("resnet50", 10)
    torch.manual_seed(0)
    fused = fuse_resnet(create_model("resnet50", 10))
    x = torch.randn(2, 3, 32, 32)
    ya, yb = fused(x), plain(x)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(fused.parameters(), plain.parameters()))
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert has_fused_bn(fused) and not has_fused_bn(plain)


def test_which_runs_choose_the_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_bn_kernels("torch", torch.device("cpu"))
    with pytest.raises(UserError, match="--bn-kernel triton needs a CUDA GPU"):
        use_bn_kernels("triton", torch.device("cpu"))


def test_launch_settings_from_the_environment(monkeypatch):
    from imagenet.kernels import bnlaunch
    monkeypatch.setattr(bnlaunch, "LAUNCH", dict(bnlaunch.LAUNCH))  # use_bn_kernels updates it in place
    monkeypatch.setattr("imagenet.models.registry.LAUNCH", bnlaunch.LAUNCH)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("IMAGENET_BN_LAUNCH", '{"stats": [2048, 8, 2], "apply": [1024, 2, 0], "grad": [4096, 4, 4, 3]}')
    assert use_bn_kernels("triton", torch.device("cpu"))
    assert bnlaunch.LAUNCH["stats"] == bnlaunch.Launch(2048, 8, 2) and bnlaunch.LAUNCH["apply"] == bnlaunch.Launch(1024, 2)
    assert bnlaunch.LAUNCH["grad"] == bnlaunch.Launch(4096, 4, 4, 3)
    for value, message in (("{stats: 1}", "is not a JSON object"), ('{"stat": [2048, 4, 4]}', "unknown phase"),
                           ('{"stats": [3000, 4, 4]}', "powers of two"), ('{"grad": [2048, 4, 0]}', "1-64 programs"),
                           ('{"apply": [1048576, 4]}', "powers of two from 256 to 16384"),
                           ('{"stats": [4096.5, 4, 4]}', "whole numbers"), ('{"apply": 5}', "is not a JSON object"),
                           ('{"stats": [4096, 4, 4, 5]}', "stages 1-4"), ('{"apply": [2048, 4, 0, 2]}', "stages 1-4"),
                           ('{"grad": [4096, 4, 4, 2, 1]}', "is not a JSON object")):
        monkeypatch.setenv("IMAGENET_BN_LAUNCH", value)
        with pytest.raises(UserError, match=message):
            use_bn_kernels("triton", torch.device("cpu"))


def _main(out, name: str, kernel: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "main.py", "--dummy", "-a", "resnet18", "--epochs", "1", "-b", "8",
                             "--image-size", "32", "--val-resize", "32", "--dummy-train-size", "24",
                             "--dummy-val-size", "8", "--dummy-classes", "4", "-j", "0", "--seed", "0",
                             "--channels-last", "--bn-kernel", kernel, "--optimizer-impl", "foreach",
                             "--output-dir", str(out / name)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))


@pytest.mark.skipif(CUDA, reason="a GPU is here: tests/test_kernel_runs.py runs main.py with the compiled kernels")
def test_main_with_the_kernels_trains_like_torchs_modules_under_the_interpreter(interpreter_runs):
    """Three steps through main.py, fused and plain, from the same seed: the same training loss
    to 1%, torchvision's state dict. (Not the same weights to rounding: at 8 images a step the
    small BatchNorms make training this chaotic that torch's own float32 modules are 5% off a
    float64 run after two steps, 20% after three, and the kernels as far: tests/test_fusedbn.py's
    one-step comparisons against float64 are the exact check.)"""
    fused = interpreter_runs.result("main-fused", timeout=600)
    assert fused.returncode == 0, fused.stderr[-3000:]
    assert "BatchNorm + add + ReLU fused in Triton" in fused.stdout
    plain = interpreter_runs.result("main-plain", timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = interpreter_runs.out
    rows = [json.loads(open(out / name / "metrics.jsonl").readline()) for name in ("fused", "plain")]
    assert rows[0]["steps"] == rows[1]["steps"] == 3
    assert rows[0]["train_loss"] == pytest.approx(rows[1]["train_loss"], rel=1e-2)
    a = torch.load(out / "fused" / "checkpoint.pth.tar", weights_only=False)["state_dict"]
    create_model("resnet18", 4).load_state_dict(a)


def test_main_refuses_the_kernels_where_they_cannot_run(tmp_path):
    runs = _Started()  # both at once: each child's time is mostly importing torch
    try:
        runs["cpu"] = _main(tmp_path, "cpu", "triton", {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"})
        runs["bad"] = _main(tmp_path, "bad", "triton", {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
                                                        "IMAGENET_BN_LAUNCH": "stats=4096"})
        r = runs.result("cpu", timeout=600)
        assert r.returncode == 2 and "--bn-kernel triton needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
        r = runs.result("bad", timeout=600)
        assert r.returncode == 2 and "IMAGENET_BN_LAUNCH='stats=4096' is not a JSON object" in r.stderr, \
            r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    finally:
        runs.stop()


# ---------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
RESNET50_LAYERS = [(256, 64, 112, 112), (256, 256, 56, 56), (256, 2048, 7, 7)]


def compare_resnet50_layers() -> list:
    """ResNet-50's largest layers at batch 256, fp16 with fp32 parameters as --fp16 runs them,
    against torch's BatchNorm + add + ReLU in float32: per layer, the worst relative error of the
    output, the parameters' gradients and the running variance, and how many input gradients are
    off by more than 2% of the largest."""
    from imagenet.kernels import fusedbn
    rows = []
    for shape in RESNET50_LAYERS:
        torch.manual_seed(0)
        a, b = nn.BatchNorm2d(shape[1]).cuda(), nn.BatchNorm2d(shape[1]).cuda()
        x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        r = torch.randn_like(x)
        xa, xb = x.clone().requires_grad_(True), x.float().requires_grad_(True)
        ya, yb = fusedbn.bn_act(xa, a, r), F.relu(b(xb) + r.float())
        grad = torch.randn_like(ya)
        ya.backward(grad)
        yb.backward(grad.float())
        err = max(float((p.float() - q).abs().max() / q.abs().max())
                  for p, q in ((ya, yb), (a.weight.grad, b.weight.grad), (a.bias.grad, b.bias.grad),
                               (a.running_var, b.running_var)))
        off = int(((xa.grad.float() - xb.grad).abs() > 2e-2 * xb.grad.abs().max()).sum())
        rows.append({"shape": list(shape), "err": err, "off": off, "numel": x.numel()})
        del x, r, xa, xb, ya, yb, grad
        torch.cuda.empty_cache()
    return rows


def _on_gpu(code: str, tf32: bool = True) -> list:
    """A child's command line: ``code`` run after ``import tests.test_fusedbn as t`` (TF32 off
    unless ``tf32``), its result printed as JSON."""
    off = "" if tf32 else "torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False; "
    return [sys.executable, "-c", "import json, sys, torch; sys.path.insert(0, '.'); import tests.test_fusedbn as t; "
            + off + code]


@pytest.fixture(scope="module")
def kernel_runs(tmp_path_factory):
    """Every GPU comparison of this module in a child of its own, all started at once: Triton
    compiles each variant of a kernel (dtype, block sizes, flags) on its first launch, one after
    another in a process (about 50 variants a dtype), and Inductor compiles a ResNet-18 for each
    compile mode; side by side they take the time of the slowest."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "4"))
    with scratch(tmp_path_factory, "fusedbn_gpu") as out:
        runs = Children(out)
        try:
            for dtype in ("float32", "bfloat16"):
                code = f"print(json.dumps(t.compare_layers('cuda', ({dtype!r},), None)))"
                runs.start(f"layers-{dtype}", _on_gpu(code), env)
            runs.start("layers-float16", _on_gpu("print(json.dumps([t.compare_layers('cuda', ('float16',), None), "
                                                 "t.compare_layers('cuda', ('float16',), 4)]))"), env)
            runs.start("models", _on_gpu("print(json.dumps(t.compare_models('cuda')))", tf32=False), env)
            for mode in ("default", "reduce-overhead"):
                runs.start(f"inductor-{mode}", _on_gpu(f"print(json.dumps(t.compare_compiled('cuda', 'inductor', "
                                                       f"{mode!r}, steps=3)))", tf32=False), env)
            runs.start("resnet50-layers", _on_gpu("print(json.dumps(t.compare_resnet50_layers()))"), env)
            runs.start("from-sums", _on_gpu("print(json.dumps(t.compare_from_sums('cuda', ('float16', "
                                            "'bfloat16', 'float32'))))"), env)
            runs.start("overflow", _on_gpu("print(json.dumps(t.overflowed_statistics('cuda')))"), env)
            yield runs
        finally:
            runs.stop()


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_compiled_kernels_match_torch_on_the_gpu(kernel_runs, dtype):
    """As many partial results as the GPU's size asks for; in float16 also four, combined two a
    step of the finishing kernels (tiles of partial results)."""
    rows = kernel_runs.json(f"layers-{dtype}")
    if dtype == "float16":
        rows, few_partials = rows
        _check_layers(few_partials)
    _check_layers(rows, several_parts=False)


@gpu
def test_kernels_match_torch_on_resnet50_sized_layers(kernel_runs):
    """The input's gradient everywhere but where the ReLU's mask flips: an output within fp16's
    rounding of zero (a few of the 10^8 values) is zero on one side and not on the other, so its
    gradient differs by the whole incoming gradient there. (Their speed: scripts/perf/bn_kernel_sweep.py.)"""
    rows = kernel_runs.json("resnet50-layers")
    assert [row["shape"] for row in rows] == [list(shape) for shape in RESNET50_LAYERS]
    for row in rows:
        assert row["err"] < 2e-2 and row["off"] <= 1e-6 * row["numel"], row


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_kernels_inside_inductor_give_the_eager_results(kernel_runs, mode):
    r = kernel_runs.json(f"inductor-{mode}")
    assert r["cudagraph_skips"] == 0, r
    assert r["err"] < 1e-3 and r["ops"] == ["imagenet.bn_act.default", "imagenet.bn_stats.default"], r
    _check_two_gradients(r)


@gpu
def test_a_fused_resnet_trains_as_torchvisions_on_the_gpu(kernel_runs):
    for name, r in kernel_runs.json("models").items():
        assert r["fused"] and r["same_keys"] and r["err"] < 1e-3, (name, r)
        assert r["two_gradients"] == r["blocks"] - 1, (name, r)


@gpu
def test_the_statistics_made_in_the_normalise_are_the_two_kernels_bits_on_the_gpu(kernel_runs):
    _check_from_sums(kernel_runs.json("from-sums"), 3)


@gpu
def test_a_batch_with_inf_or_nan_leaves_those_channels_running_statistics_on_the_gpu(kernel_runs):
    _check_overflow(kernel_runs.json("overflow"))
