"""Precision modes: the loss scaler, fp16 master-weight mechanics, parity with fp32, BN in fp32."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from imagenet.base.config import Config
from imagenet.base.wrappers import unwrap
from imagenet.precision import (AutocastPrecision,
    LossScaler,
    MasterWeightPrecision,
    Precision,
    build_precision,
    configure_tf32,
    copy_by_dtype,
    iter_norm_modules)
from tests.helpers import batches, small_net, train_steps


# -- the loss scaler -----------------------------------------------------------------------------

def test_dynamic_scaler_halves_on_overflow_and_grows_after_window():
    s = LossScaler(init_scale=1024, dynamic=True, window=3)
    s.update(overflow=True)
    assert s.scale == 512 and s.skipped_steps == 1
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 512  # window not complete
    s.update(overflow=False)
    assert s.scale == 1024 and s.clean_steps == 0
    s.update(overflow=False)
    s.update(overflow=True)  # an overflow resets the clean-step count
    assert s.scale == 512 and s.clean_steps == 0


def test_dynamic_scaler_never_goes_below_minimum():
    s = LossScaler(init_scale=4, dynamic=True, min_scale=1)
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 1


def test_static_scaler_never_changes():
    s = LossScaler(init_scale=256, dynamic=False, window=1)
    for overflow in (True, False, False, True, False):
        s.update(overflow)
    assert s.scale == 256
    assert s.skipped_steps == 2


def test_scaler_state_dict_round_trip():
    s = LossScaler(init_scale=1024, dynamic=True, window=10)
    s.update(True)
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps, t.skipped_steps) == (512, 1, 1)


# -- the master-weight trainer -------------------------------------------------------------------

def test_overflow_skips_step_and_leaves_params_and_momentum_untouched():
    prec = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 10, dynamic=True))
    model, opt, _ = train_steps(prec, small_net(), batches(2))  # two clean steps build momentum
    masters = [m.detach().clone() for m in prec.masters]
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[m]["momentum_buffer"].clone() for m in prec.masters]
    x, y = batches(1, seed=9)[0]
    prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
    next(model.parameters()).grad[0].fill_(float("inf"))  # an fp16 overflow in one gradient
    assert not prec.step(opt)
    assert prec.loss_scale == 2.0 ** 9 and prec.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(masters, prec.masters))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, opt.state[m]["momentum_buffer"]) for a, m in zip(momentum, prec.masters))
    assert all(p.grad is None for p in model.parameters())
    # and the next clean step trains again
    prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
    assert prec.step(opt)
    assert not torch.equal(masters[0], prec.masters[0])


def test_nan_gradient_is_an_overflow_too():
    prec = MasterWeightPrecision(LossScaler(init_scale=8.0, dynamic=False))
    model, opt, _ = train_steps(prec, small_net(), batches(1))
    x, y = batches(1, seed=3)[0]
    prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
    list(model.parameters())[-1].grad[0] = float("nan")
    assert not prec.step(opt)
    assert prec.loss_scale == 8.0  # static: skipped, never rescaled


def test_master_weight_mechanics_are_exact_with_an_fp32_model():
    """With the model kept in fp32 and a power-of-two scale, the masters path is bit-identical to fp32."""
    data = batches(5)
    ref, _, _ = train_steps(Precision(), small_net(), data)
    prec = MasterWeightPrecision(LossScaler(init_scale=1024.0, dynamic=False), model_dtype=torch.float32)
    got, _, stepped = train_steps(prec, small_net(), data)
    assert all(stepped)
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), name
    for a, m in zip(ref.parameters(), prec.masters):
        assert torch.equal(a, m)


def test_master_copies_are_one_dtype_per_multi_tensor_call(monkeypatch):
    """The fp16 model mixes fp16 weights and fp32 BatchNorm parameters; CUDA's multi-tensor copy
    falls back to one kernel per tensor on a mixed list, so each call must get one dtype per list,
    and together the calls must cover every parameter once, both ways."""
    calls = []
    real = torch._foreach_copy_

    def spy(dst, src, **kw):
        calls.append((list(dst), list(src)))
        return real(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    prec = MasterWeightPrecision(LossScaler(init_scale=256.0, dynamic=False))
    model, _, stepped = train_steps(prec, small_net(), batches(1))
    assert all(stepped)
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.float16, torch.float32}
    for dst, src in calls:
        assert len({t.dtype for t in dst}) == 1 and len({t.dtype for t in src}) == 1
    grads_in = [id(d) for dst, _ in calls for d in dst if any(d is m.grad for m in prec.masters)]
    model_in = [id(d) for dst, _ in calls for d in dst if any(d is p for p in params)]
    assert sorted(grads_in) == sorted(id(m.grad) for m in prec.masters)  # each master grad filled once
    assert sorted(model_in) == sorted(id(p) for p in params)  # each model parameter refreshed once


def test_copy_by_dtype_copies_every_pair():
    dst = [torch.zeros(3, dtype=torch.float16), torch.zeros(2), torch.zeros(4, dtype=torch.float16)]
    src = [torch.arange(3.0), torch.arange(2.0, dtype=torch.float16), torch.arange(4.0)]
    copy_by_dtype(dst, src)
    for d, s in zip(dst, src):
        assert d.dtype != s.dtype and torch.equal(d.float(), s.float())


def test_fp16_masters_match_fp32_within_fp16_rounding():
    """fp16 forward/backward vs fp32: the weight *updates* agree to a few fp16 ulps.

    Justification of the bound: fp16 has a unit roundoff of 2**-11 ~ 4.9e-4. Activations and
    gradients pass through ~10 rounded operations per layer, so gradients carry relative errors
    of order 1e-3..1e-2; SGD sums five such updates. We assert the update direction agrees to 5%
    (relative L2 error) and the parameters themselves to 1e-3 relative -- an fp32 model trained
    on wrong gradients (e.g. unscaled, or stale masters) misses both by orders of magnitude.
    """
    data = batches(5)
    init = small_net()
    start = [p.detach().clone() for p in init.parameters()]
    ref, _, _ = train_steps(Precision(), copy.deepcopy(init), data)
    prec = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 12, dynamic=True))
    got, _, stepped = train_steps(prec, copy.deepcopy(init), data)
    assert all(stepped)
    d_ref = torch.cat([(p.detach() - s).flatten() for p, s in zip(ref.parameters(), start)])
    d_got = torch.cat([(m.detach() - s).flatten() for m, s in zip(prec.masters, start)])
    update_err = (d_got - d_ref).norm() / d_ref.norm()
    p_ref = torch.cat([p.detach().flatten() for p in ref.parameters()])
    p_got = torch.cat([m.detach().flatten() for m in prec.masters])
    param_err = (p_got - p_ref).norm() / p_ref.norm()
    assert update_err < 0.05, float(update_err)
    assert param_err < 1e-3, float(param_err)
    # The fp16 model holds the masters rounded to fp16.
    for p, m in zip(got.parameters(), prec.masters):
        assert torch.equal(p, m.to(p.dtype))


def test_batchnorm_stays_fp32_after_conversion_and_reload():
    prec = MasterWeightPrecision(LossScaler())
    model = prec.prepare_model(small_net())
    norms = list(iter_norm_modules(model))
    assert norms
    for bn in norms:
        assert all(t.dtype == torch.float32 for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var))
    assert model[0].weight.dtype == torch.float16 and model[-1].weight.dtype == torch.float16
    state = prec.model_state_dict(model)
    assert all(v.dtype == torch.float32 for k, v in state.items() if v.is_floating_point())
    state = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    prec.load_model_state_dict(model, state)
    for bn in iter_norm_modules(model):
        assert bn.weight.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16
    # masters come back exactly, not re-derived from the rounded fp16 copy
    for name, m in zip(prec.names, prec.masters):
        assert torch.equal(m, state[name])


def test_state_dict_holds_masters_under_model_names():
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, _, _ = train_steps(prec, small_net(), batches(2))
    state = prec.model_state_dict(model)
    plain = small_net()
    plain.load_state_dict(state)  # strict: same names, fp32
    for name, m in zip(prec.names, prec.masters):
        assert torch.equal(state[name], m) and state[name].dtype == torch.float32


def test_optimizer_state_lives_with_fp32_masters():
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    _, opt, _ = train_steps(prec, small_net(), batches(2))
    for m in prec.masters:
        assert opt.state[m]["momentum_buffer"].dtype == torch.float32


# -- autocast ----------------------------------------------------------------------------------

def test_autocast_fp16_skips_overflowing_step_on_cpu():
    prec = AutocastPrecision(torch.float16, "cpu", init_scale=2.0 ** 8)
    model, opt, stepped = train_steps(prec, small_net(), batches(2))
    assert all(stepped)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1, seed=5)[0]
    prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
    next(model.parameters()).grad.fill_(float("inf"))
    assert not prec.step(opt)
    assert prec.loss_scale == 2.0 ** 7 and prec.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_autocast_bf16_trains_close_to_fp32():
    data = batches(3)
    ref, _, _ = train_steps(Precision(), small_net(), data)
    got, _, stepped = train_steps(AutocastPrecision(torch.bfloat16, "cpu"), small_net(), data)
    assert all(stepped) and got[0].weight.dtype == torch.float32  # autocast keeps fp32 weights
    a = torch.cat([p.detach().flatten() for p in ref.parameters()])
    b = torch.cat([p.detach().flatten() for p in got.parameters()])
    err = ((a - b).norm() / a.norm()).item()
    # bf16 has 8 mantissa bits (~4e-3 unit roundoff); three steps of lr 0.1 move the weights by a
    # few percent, and the updates are computed to ~1e-2, so the weights agree to ~1e-3.
    assert err < 1e-2, err
    assert math.isfinite(err)


def test_unwrap_sees_through_data_parallel():
    net = small_net()
    assert unwrap(nn.DataParallel(net)) is net


def test_masters_are_the_exact_fp32_weights_and_batchnorm_is_never_rounded():
    net = small_net()
    net[1].running_var.fill_(1.0001)  # not representable in fp16
    fp32 = {k: v.clone() for k, v in net.state_dict().items()}
    prec = MasterWeightPrecision(LossScaler())
    model = prec.prepare_model(net)
    for name, m in zip(prec.names, prec.masters):
        assert torch.equal(m, fp32[name]), name
    assert torch.equal(model[1].running_var, fp32["1.running_var"])
    assert torch.equal(model[1].weight, fp32["1.weight"])


def test_gradient_clipping_acts_on_unscaled_gradients_in_every_mode():
    """Clipping after unscaling: the masters path with a power-of-two scale clips exactly as fp32."""
    data = batches(3)

    def clipped(prec):
        model = prec.prepare_model(small_net())
        opt = torch.optim.SGD(prec.param_groups([{"params": list(model.parameters())}]), lr=1.0)
        before = [p.detach().clone() for p in getattr(prec, "masters", None) or model.parameters()]
        x, y = data[0]
        prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
        assert prec.step(opt)
        after = getattr(prec, "masters", None) or list(model.parameters())
        return torch.cat([(a.detach() - b).flatten() for a, b in zip(after, before)])

    ref = clipped(Precision(clip_norm=0.05))
    assert ref.norm().item() == pytest.approx(0.05, rel=1e-4)  # lr 1: the update is the clipped gradient
    exact = clipped(MasterWeightPrecision(LossScaler(init_scale=1024.0, dynamic=False), model_dtype=torch.float32,
                                          clip_norm=0.05))
    assert torch.equal(exact, ref)
    amp = clipped(AutocastPrecision(torch.float16, "cpu", init_scale=1024.0, clip_norm=0.05))
    assert amp.norm().item() == pytest.approx(0.05, rel=1e-3)


@pytest.mark.parametrize("flags", [{}, {"fp16": True}, {"amp": True}, {"amp": True, "amp_dtype": "bfloat16"}])
def test_build_precision_gives_every_mode_its_clip_norm(flags):
    cfg = dataclasses.replace(Config(), clip_grad_norm=0.5, **flags)
    assert build_precision(cfg, torch.device("cpu")).clip_norm == 0.5
    assert build_precision(dataclasses.replace(cfg, clip_grad_norm=None), torch.device("cpu")).clip_norm is None


# -- the step's flag ---------------------------------------------------------------------------

MODES = {
    "fp32": Precision,
    "fp16": lambda: MasterWeightPrecision(LossScaler(init_scale=256.0, dynamic=False)),
    "amp-fp16": lambda: AutocastPrecision(torch.float16, "cpu", init_scale=2.0 ** 8),
    "amp-bf16": lambda: AutocastPrecision(torch.bfloat16, "cpu"),
}


@pytest.mark.parametrize("mode", MODES)
def test_step_returns_a_constant_device_flag_when_the_outcome_is_known_on_the_host(mode):
    """Every mode returns a 0-dim bool tensor on the parameters' device; a mode that knows the
    outcome on the host returns the same tensor each time rather than copying a new one over."""
    prec = MODES[mode]()
    model, opt, stepped = train_steps(prec, small_net(), batches(3))
    for s in stepped:
        assert isinstance(s, torch.Tensor) and s.dtype == torch.bool and s.shape == () and s.device.type == "cpu"
        assert bool(s)
    assert stepped[0] is stepped[1] is stepped[2]
    if mode in ("fp16", "amp-fp16"):  # a skip: the False constant, and True stays True
        x, y = batches(1, seed=4)[0]
        prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
        next(model.parameters()).grad.fill_(float("inf"))
        skipped = prec.step(opt)
        assert skipped.dtype == torch.bool and skipped.shape == () and not bool(skipped)
        assert skipped is not stepped[0] and bool(stepped[0])


# -- TF32 flags ----------------------------------------------------------------------------------


@pytest.fixture
def tf32_flags():
    """Put the process-wide TF32 flags back as they were (legacy setters reset both APIs)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_setting_leaves_every_precision_reader_answering(tf32_flags, enabled):
    """Inductor (``--compile max-autotune``) reads the generic matmul precision; after the new
    per-backend API was set, torch refused that read ("mix of the legacy and new APIs")."""
    configure_tf32(enabled)
    assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
    assert torch.backends.cuda.matmul.allow_tf32 is enabled
    assert torch.backends.cudnn.allow_tf32 is enabled
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9 answers both ways
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if enabled else "ieee")
