"""``--optimizer-impl triton``: ``--fp16``'s step in MasterStep's two kernels (imagenet.kernels.masterstep).

On a CPU the kernels run under Triton's interpreter, in a subprocess (the interpreter is chosen
when Triton defines them): their masters, momentum and weights equal, bit for bit, the same
arithmetic written in torch's float64 operations, for each option of torch's SGD; a flagged
overflow leaves everything as it was; and a whole fp16 run through MasterWeightPrecision matches
torch's four-pass step (copy, unscale, fused SGD, copy back) to rounding, with its skips. On a GPU
the compiled kernels are held to the same, within one float32 rounding of the reference.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from imagenet.base.errors import UserError
from imagenet.kernels import compiles, masterstep
from imagenet.precision import LossScaler, MasterWeightPrecision
from imagenet.precision.optim import build_optimizer, param_groups
from tests.helpers import ONE_THREAD, Children, batches, fp16_run_args, fused_or_skip, interpreted, last_checkpoint, small_net

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
# (weight dtype, lr, weight decay, momentum, dampening, nesterov, maximize); sizes cross a block
OPTIONS = [(torch.float16, 0.1, 1e-4, 0.9, 0.0, False, False), (torch.bfloat16, 0.05, 5e-5, 0.9, 0.0, True, False),
           (torch.float32, 0.3, 0.0, 0.0, 0.0, False, False), (torch.float16, 0.01, 1e-3, 0.8, 0.25, False, True),
           (torch.float16, 0.0, 1e-4, 0.9, 1.0, False, False)]  # float64s whose bits are 0 (lr, 1 - dampening)
# the last two channels_last; the 1x1 one's gradient contiguous, which lays out its memory the same
SIZES = [(3, 5), (masterstep.BLOCK + 7,), (64, 4, 3, 3), (8, 6, 1, 1)]


def reference(g, m, b, inv, lr, wd, momentum, dampening, nesterov, maximize):
    """torch's unscale and fused SGD, written out in torch's float64 operations."""
    g = g.float() * inv
    if maximize:
        g = -g
    if wd:
        g = (g.double() + wd * m.double()).float()
    if momentum:
        bd = momentum * b.double() + (1 - dampening) * g.double()
        b = bd.float()
        g = ((g.double() + momentum * bd) if nesterov else bd).float()
    m = (m.double() - lr * g.double()).float()
    return m, b


def _stepper(options, device, seed):
    """A MasterStep over weights of SIZES (the 4-D one channels_last), seeded masters, gradients
    and momentum; returns it, the weights, the masters and the momentum as they were."""
    dtype, lr, wd, momentum, dampening, nesterov, maximize = options
    gen = torch.Generator().manual_seed(seed)
    weights, masters, buffers = [], [], []
    for size in SIZES:
        layout = torch.channels_last if len(size) == 4 else torch.contiguous_format
        m, g, b = (torch.randn(size, generator=gen).to(device).contiguous(memory_format=layout) for _ in range(3))
        if size[2:] == (1, 1):  # the weight's strides differ from its gradient's on the size-1 dimensions only
            m, b = (torch.empty_strided(size, (size[1], 1, size[1], size[1]), device=device).copy_(t) for t in (m, b))
        w = nn.Parameter(m.to(dtype))
        w.grad = (g * 300).to(dtype)
        weights.append(w)
        masters.append(m)
        buffers.append(b)
    opt = torch.optim.SGD(masters, lr=lr, momentum=momentum, dampening=dampening, weight_decay=wd,
                          nesterov=nesterov, maximize=maximize)
    if momentum:
        for m, b in zip(masters, buffers):
            opt.state[m]["momentum_buffer"] = b.clone()
    return masterstep.MasterStep(opt, weights, masters), weights, masters, buffers


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` (one dtype) in steps of that dtype (0: bit for bit)."""
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(bits).long() - b.view(bits).long()).abs().max())


def compare(device="cpu") -> dict:
    """The kernels against :func:`reference` for each of OPTIONS, an overflow's skip, and a whole
    fp16 run against torch's step; the largest differences found (float32 steps, values)."""
    out = {"options": [], "skip": [], "rebuilds": []}
    inv = torch.tensor([2.0 ** -7], device=device)
    for k, options in enumerate(OPTIONS):
        step, weights, masters, buffers = _stepper(options, device, seed=k)
        before = [m.clone() for m in masters]
        found = torch.zeros(1, device=device)
        assert step(found, inv) is None
        dtype, lr, wd, momentum, dampening, nesterov, maximize = options
        worst = [0, 0, 0]
        for w, m, m0, b0 in zip(weights, masters, before, buffers):
            em, eb = reference(w.grad, m0, b0, inv, lr, wd, momentum, dampening, nesterov, maximize)
            worst[0] = max(worst[0], _ulps(m, em))
            worst[1] = max(worst[1], _ulps(step.optimizer.state[m]["momentum_buffer"], eb) if momentum else 0)
            worst[2] = max(worst[2], _ulps(w.detach(), m.to(dtype)))  # the weight: the master rounded
        out["options"].append(worst + [float(found)])
        # an inf in one gradient: the flag is set and nothing moves
        masters_before = [m.clone() for m in masters]
        weights_before = [w.detach().clone() for w in weights]
        weights[1].grad[5] = float("nan") if k % 2 else float("inf")
        found.zero_()
        assert step(found, inv) is None
        out["skip"].append([float(found), all(torch.equal(a, b) for a, b in zip(masters, masters_before)),
                            all(torch.equal(w.detach(), b) for w, b in zip(weights, weights_before))])
        step(found.zero_(), inv)
        out["rebuilds"].append(step.rebuilds)  # same addresses: one table
        weights[0].grad = weights[0].grad.clone()  # a new gradient tensor: a new table
        step(found.zero_(), inv)
        out["rebuilds"].append(step.rebuilds)
    out["resumed"] = _after_load_state_dict(device)
    out["momentum"] = _momentum_switched_on(device)
    out["run"] = _run_against_torch(device)
    return out


def _momentum_switched_on(device) -> str:
    """A group given momentum after its table was made (no buffers yet): the kernels decline."""
    step, _, _, _ = _stepper(OPTIONS[2], device, seed=8)
    step(torch.zeros(1, device=device), torch.ones(1, device=device))
    step.optimizer.param_groups[0]["momentum"] = 0.9
    return step(torch.zeros(1, device=device), torch.ones(1, device=device))


def _after_load_state_dict(device) -> int:
    """``optimizer.load_state_dict`` (a resume) replaces the group dicts, and the schedule then sets
    the new ones' lr: the kernels take it (no momentum, so no buffer's address changes either)."""
    options = OPTIONS[2]
    step, weights, masters, _ = _stepper(options, device, seed=7)
    inv = torch.ones(1, device=device)
    step(torch.zeros(1, device=device), inv)
    step.optimizer.load_state_dict(step.optimizer.state_dict())
    step.optimizer.param_groups[0]["lr"] = 0.7
    before = [m.clone() for m in masters]
    step(torch.zeros(1, device=device), inv)
    args = options[2:]
    return max(_ulps(m, reference(w.grad, m0, m0, inv, 0.7, *args)[0]) for w, m, m0 in zip(weights, masters, before))


def _train(one_pass, device, data):
    prec = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 10, dynamic=True, window=2), one_pass=one_pass)
    model = prec.prepare_model(small_net().to(device).to(memory_format=torch.channels_last))
    groups = prec.param_groups(param_groups(model, 1e-4, exempt_norm_and_bias=True))
    opt = build_optimizer(groups, 0.1, 0.9, 1e-4, "fused", torch.device(device))
    stepped = []
    for i, (x, y) in enumerate(data):
        prec.backward(nn.functional.cross_entropy(prec.forward(model, x.to(device)), y.to(device)))
        if i in (0, 3):  # overflows: before any momentum exists, and later
            next(model.parameters()).grad[0, 0, 0, 0] = float("inf")
        if i == 2:
            model[-1].bias.grad = None  # a parameter without a gradient this step stays where it is
        stepped.append(bool(prec.step(opt)))
    return prec, opt, stepped


def _run_against_torch(device) -> dict:
    data = batches(6)
    torch_run, kernel_run = _train(False, device, data), _train(True, device, data)
    (a, opt_a, st_a), (b, opt_b, st_b) = torch_run, kernel_run
    masters = max(float((x - y).abs().max()) for x, y in zip(a.masters, b.masters))
    buffers = max(float((opt_a.state[x]["momentum_buffer"] - opt_b.state[y]["momentum_buffer"]).abs().max())
                  for x, y in zip(a.masters, b.masters))
    weights = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.params, b.params))
    return {"stepped": [st_a, st_b], "scaler": [a.scaler.state_dict(), b.scaler.state_dict()],
            "masters": masters, "buffers": buffers, "weights": weights,
            "used": b._stepper is not None and b._stepper.rebuilds > 0, "torch_used": a._stepper is None}


def _check(r: dict, ulps: int, bf16_steps: int) -> None:
    for k, (masters, buffers, rounded, found) in enumerate(r["options"]):
        assert masters <= ulps and buffers <= ulps, (k, r["options"][k])
        assert rounded <= (bf16_steps if OPTIONS[k][0] == torch.bfloat16 else 0), (k, r["options"][k])
        assert found == 0.0, (k, r["options"][k])
    assert all(s == [1.0, True, True] for s in r["skip"]), r["skip"]
    assert r["rebuilds"] == [1, 2] * len(OPTIONS), r["rebuilds"]
    assert r["resumed"] <= ulps, r["resumed"]
    assert "momentum buffer is missing" in r["momentum"], r["momentum"]
    run = r["run"]
    assert run["used"] and run["torch_used"]
    assert run["stepped"][0] == run["stepped"][1] == [False, True, True, False, True, True], run["stepped"]
    assert run["scaler"][0] == run["scaler"][1]
    assert run["masters"] <= 1e-6 and run["buffers"] <= 1e-5 and run["weights"] <= 1e-3, run


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    # Triton's interpreter truncates float32 to bfloat16 where GPUs round to nearest: a step apart at most.
    _check(interpreted("test_masterstep", "compare()"), ulps=0, bf16_steps=1)


@pytest.mark.gpu
def test_compiled_kernels_match_torch_on_the_gpu():
    _check(compare("cuda"), ulps=1, bf16_steps=0)


def test_a_step_that_does_not_fit_says_why_and_launches_nothing():
    # On a CPU without the interpreter a launch would fail: these answer before any.
    weights = [nn.Parameter(torch.zeros(2, 3, 4, 5, dtype=torch.float16))]
    weights[0].grad = torch.zeros(2, 3, 4, 5, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    masters = [torch.zeros(2, 3, 4, 5)]
    found = torch.zeros(1)
    step = masterstep.MasterStep(torch.optim.SGD(masters, lr=0.1), weights, masters)
    assert "layout" in step(found, torch.ones(1))  # a gradient in another memory order than its weight
    weights[0].grad = torch.zeros_like(weights[0])
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)  # no momentum buffer yet
    assert "momentum buffer" in masterstep.MasterStep(opt, weights, masters)(found, torch.ones(1))
    assert float(found) == 0.0


@pytest.mark.skipif(compiles.available(), reason="the kernels can run here")
def test_asking_for_the_kernels_without_them_is_a_clear_error():
    with pytest.raises(UserError, match="--optimizer-impl triton needs Triton and a CUDA GPU"):
        build_optimizer([{"params": [torch.zeros(2, requires_grad=True)]}], 0.1, 0.9, 0.0, "triton",
                        torch.device("cpu"))


@pytest.mark.skipif(CUDA, reason="a GPU is here: the GPU runs use the compiled kernels")
def test_main_trains_with_the_kernels(fp16_digits, tmp_path):
    """``main.py --fp16 --optimizer-impl triton`` (under the interpreter, in a subprocess) against
    the same run on torch's fused SGD: the same skips and loss scale, no fallback, and weights
    close but not equal. The kernels round as torch's CUDA kernel does (float64 arithmetic); its
    CPU kernel rounds in float32, and one float32 step of a master can move its fp16 weight by one
    fp16 step, which this tiny ResNet-18 (BatchNorm over 8 values at 1x1) amplifies, so a step
    apart the runs are close, not equal; equal would mean the kernels never ran."""
    pytest.importorskip("triton")
    fused_or_skip([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    children, runs = Children(tmp_path / "logs"), {}
    try:
        for impl in ("fused", "triton"):  # both at once: the interpreter's run keeps one core busy
            args = fp16_run_args(fp16_digits, tmp_path / impl, "--epochs", "1", "--optimizer-impl", impl)
            children.start(impl, [sys.executable, "main.py", *args],
                           dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **ONE_THREAD))
        for impl in ("fused", "triton"):
            r = children.result(impl, timeout=300)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            assert "runs torch's kernels" not in r.stdout + r.stderr
            runs[impl] = (last_checkpoint(tmp_path / impl), json.loads(open(tmp_path / impl / "metrics.jsonl").readline()))
    finally:
        children.stop()
    (a, row_a), (b, row_b) = runs["fused"], runs["triton"]
    assert row_a["skipped_steps"] == row_b["skipped_steps"] and row_a["loss_scale"] == row_b["loss_scale"]
    assert 0 < row_b["skipped_steps"] < row_b["steps"], row_b
    assert b["optimizer"]["param_groups"][0]["fused"]  # the kernels keep a fused optimizer's state
    weights = [k for k, v in a["state_dict"].items() if k.endswith("weight") and v.dim() == 4]
    assert any(not torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in weights)
    for k in weights:
        torch.testing.assert_close(a["state_dict"][k], b["state_dict"][k], rtol=0, atol=0.05, msg=k)
