"""``--optimizer lars`` (imagenet.precision.lars, and --fp16's Triton step of it in imagenet.kernels.masterstep).

The update is held to MLPerf's rule written out below in float64, over several steps whose
learning rate changes (which tells the momentum form apart), with BatchNorm parameters and biases
excluded, a weight and a gradient of norm 0, weight decay, momentum, a parameter without a
gradient and an overflowing step: in fp32, in ``--amp`` (torch's GradScaler) and in ``--fp16``
(master weights), on torch's multi-tensor and fused kernels, and ``--fp16``'s Triton kernels under
the interpreter (compiled on a GPU). Then whole runs: resumed exactly, and a checkpoint of one
optimizer resumed with the other is a one-line error.
"""

import math

import pytest
import torch
import torch.nn as nn

from imagenet.cli import main
from imagenet.precision import AutocastPrecision, LossScaler, MasterWeightPrecision, Precision
from imagenet.precision.lars import LarsSettings
from imagenet.precision.optim import build_optimizer, param_groups
from tests.helpers import assert_same_run, digits_fixture, interpreted, last_checkpoint, small_net, tiny_run_args

CUDA = torch.cuda.is_available()
ETA, EPS, WD, MOMENTUM = 0.02, 1e-4, 5e-3, 0.9
LRS = [0.4, 0.9, 0.9, 0.6, 0.2]  # a changing rate: the momentum form matters
OVERFLOW = 2  # this step's gradients hold an inf (amp, fp16): skipped, nothing moves
SCALE = 2.0 ** 10


def reference(weights: list, steps: list, lars: list, tf_form: bool = False) -> tuple:
    """The rule in float64: ``steps`` are (lr, gradients) with None for a skipped step and for a
    tensor without a gradient. ``tf_form``: the TensorFlow reference's momentum (v = m v + lr d;
    w -= v) instead of NVIDIA's (v = m v + d; w -= lr v), to show that the test tells them apart."""
    w = [x.double().clone() for x in weights]
    v = [torch.zeros_like(x) for x in w]
    for lr, grads in steps:
        if grads is None:
            continue
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.double()
            d = g
            if lars[i]:
                wn, gn = float(w[i].norm()), float(g.norm())
                ratio = ETA * wn / (gn + WD * wn + EPS) if wn > 0 and gn > 0 else 1.0
                d = ratio * (g + WD * w[i])
            v[i] = MOMENTUM * v[i] + (lr * d if tf_form else d)
            w[i] = w[i] - (v[i] if tf_form else lr * v[i])
    return w, v


def gradient_steps(shapes: list, overflow: bool, seed: int = 0) -> list:
    """(lr, gradients) per step: seeded, each tensor its own size of gradient (so the trust ratios
    differ); one weight tensor's gradient 0 at step 1, the classifier's bias without one at step 3,
    and with ``overflow`` an inf at step OVERFLOW."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for k, lr in enumerate(LRS):
        grads = [torch.randn(shape, generator=gen) * 10.0 ** (i % 3 - 1) for i, shape in enumerate(shapes)]
        if k == 1:
            grads[0] = torch.zeros(shapes[0])
        if k == 3:
            grads[-1] = None
        if k == OVERFLOW and overflow:
            grads[1] = grads[1].clone()
            grads[1].view(-1)[0] = float("inf")
        steps.append((lr, grads))
    return steps


def _model() -> nn.Module:
    model = small_net()
    with torch.no_grad():
        model[3].weight.zero_()  # a weight of norm 0: trust ratio 1 on the first step
    return model


def run_lars(mode: str, impl: str, device: str = "cpu") -> dict:
    """Five steps of LARS in ``mode`` (fp32, amp, fp16, fp16-triton) on ``impl`` (foreach, fused)
    against :func:`reference`: the largest relative differences of weights and momentum, and the
    same for the TensorFlow form (which should be far)."""
    model = _model().to(device)
    weights = [p.detach().double().cpu().clone() for p in model.parameters()]
    precision = {"fp32": lambda: Precision(),
                 "amp": lambda: AutocastPrecision(torch.float16, device, init_scale=SCALE),
                 "fp16": lambda: MasterWeightPrecision(LossScaler(init_scale=SCALE, dynamic=True, window=1000)),
                 "fp16-triton": lambda: MasterWeightPrecision(LossScaler(init_scale=SCALE, dynamic=True, window=1000),
                                                              one_pass=True)}[mode]()
    model = precision.prepare_model(model)
    params = list(model.parameters())
    groups = precision.param_groups(param_groups(model, WD, exempt_norm_and_bias=False, lars=True))
    optimizer = build_optimizer(groups, LRS[0], MOMENTUM, WD, impl, torch.device(device),
                                lars=LarsSettings(ETA, EPS))
    lars = [p.ndim > 1 for p in params]
    overflow = mode != "fp32"  # fp32 has no overflow check: an inf would reach the weights
    steps = gradient_steps([p.shape for p in params], overflow)
    seen, stepped = [], []
    for k, (lr, grads) in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr
        scale = 1.0
        if mode == "amp":
            precision.scaler.scale(torch.ones((), device=device))  # makes the scaler's device scale
            scale = precision.scaler.get_scale()
        elif mode.startswith("fp16"):
            scale = precision.scaler.scale
        seen.append([None if g is None else (g * scale).to(p.dtype) for p, g in zip(params, grads)])
        for p, g in zip(params, seen[-1]):
            p.grad = None if g is None else g.to(device, copy=True)  # the step scales gradients in place
        stepped.append(bool(precision.step(optimizer)))
    # the reference sees the gradients as the optimizer received them: rounded to the model's dtype, unscaled
    ref_steps = [(lr, None if k == OVERFLOW and overflow else [None if g is None else g.double() / s for g in grads])
                 for k, ((lr, _), grads, s) in enumerate(zip(steps, seen, _scales(mode)))]
    masters = precision.masters if mode.startswith("fp16") else params
    out = {"stepped": stepped}
    for name, tf_form in (("ours", False), ("tf", True)):
        ref_w, ref_v = reference(weights, ref_steps, lars, tf_form)
        out[name] = [max(_rel(m, r) for m, r in zip(masters, ref_w)),
                     max(_rel(optimizer.state[m]["momentum_buffer"], r) for m, r in zip(masters, ref_v))]
    out["used_kernels"] = mode == "fp16-triton" and precision._stepper is not None
    return out


def _scales(mode: str) -> list:
    """The loss scale of each step: a dynamic scale halves after the overflow."""
    if mode == "fp32":
        return [1.0] * len(LRS)
    return [SCALE if k <= OVERFLOW else SCALE / 2 for k in range(len(LRS))]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.detach().double().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _check(r: dict, tol: float = 2e-6) -> None:
    assert r["ours"][0] <= tol and r["ours"][1] <= tol, r
    assert r["tf"][0] > 100 * tol, r  # the reference's momentum form is another update


@pytest.mark.parametrize("mode", ["fp32", "amp", "fp16"])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_the_update_follows_the_rule_in_float64(mode, impl):
    if impl == "fused":
        try:
            build_optimizer([{"params": [nn.Parameter(torch.zeros(1))]}], 0.1, 0.9, 0.0, "fused", torch.device("cpu"))
        except Exception as e:
            pytest.skip(f"fused SGD does not run on this CPU build: {e}")
    r = run_lars(mode, impl)
    _check(r)
    overflowed = mode != "fp32"
    assert r["stepped"] == [True, True, not overflowed, True, True]


def test_bn_and_biases_take_plain_sgd_without_decay_and_weights_lars():
    groups = param_groups(small_net(), WD, exempt_norm_and_bias=False, lars=True)
    assert [(g["lars"], g["weight_decay"], len(g["params"])) for g in groups] == [(True, WD, 3), (False, 0.0, 5)]
    assert all(p.ndim > 1 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])
    opt = build_optimizer(groups, 0.1, 0.9, WD, "foreach", torch.device("cpu"), lars=LarsSettings(ETA, EPS))
    assert opt.param_groups[1]["eta"] == ETA  # every group saves the same keys, so a resume fits


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_fp16_kernels_follow_the_rule_under_the_interpreter():
    pytest.importorskip("triton")
    r = interpreted("test_lars", "run_lars('fp16-triton', 'fused')")
    assert r["used_kernels"], r
    _check(r)
    assert r["stepped"] == [True, True, False, True, True]


@pytest.mark.gpu
def test_fp16_kernels_follow_the_rule_on_the_gpu():
    r = run_lars("fp16-triton", "fused", "cuda")
    assert r["used_kernels"], r
    _check(r, tol=1e-5)  # float32 sums in another order than torch's norms, and fp32 rounding
    assert r["stepped"] == [True, True, False, True, True]


# ------------------------------------------------------------------------------------------ whole runs

digits = digits_fixture(2, 1)  # 20 training images: 2 steps an epoch at -b 8
LARS_RUN = ("-b", "8", "--optimizer", "lars", "--lr", "2", "--lars-eta", "0.01", "--weight-decay", "5e-4")


def test_a_resumed_lars_run_continues_exactly(digits, tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_run_args(digits, straight, "--epochs", "2", *LARS_RUN)) == 0
    assert main(tiny_run_args(digits, split, "--epochs", "1", *LARS_RUN)) == 0
    assert main(tiny_run_args(digits, split, "--epochs", "2", "--resume", "auto", *LARS_RUN)) == 0
    a, b = last_checkpoint(straight), last_checkpoint(split)
    assert_same_run(a, b)
    assert [g["lars"] for g in a["optimizer"]["param_groups"]] == [True, False]
    capsys.readouterr()
    # the other optimizer on this checkpoint: one line naming both and the way out
    assert main(tiny_run_args(digits, split, "--epochs", "3", "--resume", "auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--optimizer lars" in err[0] and "--optimizer sgd" in err[0] and "--weights" in err[0], err[0]


def test_an_sgd_checkpoint_resumed_with_lars_is_refused(digits, tmp_path, capsys):
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "1", "-b", "8")) == 0
    capsys.readouterr()
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "2", "--resume", "auto", *LARS_RUN)) == 2
    line = capsys.readouterr().err.strip()
    assert "trained with --optimizer sgd" in line and "asks for --optimizer lars" in line, line
    assert "resume with --optimizer sgd" in line


@pytest.mark.parametrize("flag, value, needle", [("--lars-eta", "0", "--lars-eta must be a positive number"),
                                                 ("--lars-eps", "-1", "--lars-eps must be 0 or more"),
                                                 ("--optimizer", "adam", "invalid choice: 'adam'")])
def test_bad_lars_flags_are_one_line_errors(flag, value, needle, capsys):
    assert main(["DIR", flag, value]) == 2
    assert needle in capsys.readouterr().err


def test_the_trust_ratio_is_one_where_a_norm_is_zero():
    from imagenet.precision.lars import trust_ratios
    w = [torch.zeros(3), torch.ones(4), torch.ones(2)]
    g = [torch.ones(3), torch.zeros(4), torch.full((2,), 3.0)]
    r = trust_ratios(w, g, 0.1, LarsSettings(0.01, 0.0))
    expected = 0.01 * math.sqrt(2) / (3 * math.sqrt(2) + 0.1 * math.sqrt(2))
    assert r.tolist()[:2] == [1.0, 1.0] and r[2].item() == pytest.approx(expected, rel=1e-6)
