"""The skip decided on the device: fused SGD reads the overflow flag, nothing waits for the host.

The GPU uses this path by default (``--optimizer-impl auto``); torch's fused SGD also runs on
the CPU, so the mechanics are proved here against the host-decided (foreach) path.
"""

import copy
import logging

import pytest
import torch
import torch.nn as nn

from imagenet.precision import AutocastPrecision, LossScaler, MasterWeightPrecision
from imagenet.precision.optim import build_optimizer, load_optimizer_state, resolve_impl, supports_found_inf
from imagenet.training.ema import ModelEma
from tests.helpers import batches, fused_or_skip, small_net

CPU = torch.device("cpu")


def run(prec, impl, data, inf_at=(), lr=0.1):
    model = prec.prepare_model(small_net())
    groups = prec.param_groups([{"params": list(model.parameters())}])
    opt = fused_or_skip(groups, lr=lr) if impl == "fused" else build_optimizer(groups, lr, 0.9, 1e-4, impl, CPU)
    stepped = []
    for i, (x, y) in enumerate(data):
        prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
        if i in inf_at:
            next(model.parameters()).grad[0].fill_(float("inf"))
        stepped.append(prec.step(opt))
    return model, opt, stepped


def test_auto_is_fused_on_cuda_only():
    assert resolve_impl("auto", torch.device("cuda")) == "fused"
    assert resolve_impl("auto", CPU) == "foreach"
    groups = [{"params": [nn.Parameter(torch.zeros(2))]}]
    assert not supports_found_inf(build_optimizer(groups, 0.1, 0.9, 0.0, "auto", CPU))
    opt = fused_or_skip([{"params": [nn.Parameter(torch.zeros(2))]}])
    assert supports_found_inf(opt)


def test_device_decided_steps_match_the_host_decided_ones_including_skips():
    """Same data, overflows at steps 0 (before any momentum exists) and 3: same masters, scale,
    counters, momentum. The first-step skip is the case torch's fused SGD gets wrong on its own
    (it would keep uninitialised momentum buffers)."""
    data = batches(6)
    host = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 10, dynamic=True, window=2))
    dev = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 10, dynamic=True, window=2))
    _, opt_h, st_h = run(host, "foreach", data, inf_at=(0, 3))
    _, opt_d, st_d = run(dev, "fused", data, inf_at=(0, 3))
    assert all(isinstance(s, torch.Tensor) and s.dtype == torch.bool and s.shape == () for s in st_h + st_d)
    assert [bool(s) for s in st_h] == [False, True, True, False, True, True]
    assert [bool(s) for s in st_d] == [bool(s) for s in st_h]
    assert dev.scaler.state_dict() == host.scaler.state_dict()
    assert dev.skipped_steps == 2 and dev.loss_scale == host.loss_scale
    for a, b in zip(host.masters, dev.masters):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(host.masters, dev.masters):
        torch.testing.assert_close(opt_h.state[a]["momentum_buffer"], opt_d.state[b]["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7)


def test_device_decided_overflow_leaves_weights_and_momentum_untouched():
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, opt, _ = run(prec, "fused", batches(2))
    masters = [m.detach().clone() for m in prec.masters]
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[m]["momentum_buffer"].clone() for m in prec.masters]
    x, y = batches(1, seed=7)[0]
    prec.backward(nn.functional.cross_entropy(prec.forward(model, x), y))
    list(model.parameters())[-1].grad[0] = float("nan")
    assert not bool(prec.step(opt))
    assert prec.loss_scale == 256 and prec.skipped_steps == 1  # static: skipped, never rescaled
    assert all(torch.equal(a, b) for a, b in zip(masters, prec.masters))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, opt.state[m]["momentum_buffer"]) for a, m in zip(momentum, prec.masters))


def test_skips_on_the_device_are_logged_when_read_not_per_step(caplog):
    prec = MasterWeightPrecision(LossScaler(init_scale=2.0 ** 10, dynamic=True))
    with caplog.at_level(logging.INFO, logger="imagenet.precision"):
        run(prec, "fused", batches(3), inf_at=(0, 1))
        assert "overflow" not in caplog.text  # nothing read yet: the steps never waited
        assert prec.skipped_steps == 2
    assert "2 step(s) skipped" in caplog.text and "loss scale now 256" in caplog.text


def test_scaler_state_round_trips_through_the_device():
    s = LossScaler(init_scale=64, dynamic=True, window=3)
    s.attach(CPU)
    for flag in (0.0, 0.0, 1.0, 0.0):
        s.update_on_device(torch.tensor([flag]))
    assert (s.scale, s.clean_steps, s.skipped_steps) == (32, 1, 1)
    t = LossScaler()
    t.attach(CPU)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps, t.skipped_steps) == (32, 1, 1)
    t.scale = 8  # a static --loss-scale on the command line wins over the file
    assert float(t.scale_loss(torch.tensor(1.0))) == 8.0


def test_scale_stays_within_its_bounds_on_the_device():
    s = LossScaler(init_scale=2.0, dynamic=True, window=1, min_scale=1.0, max_scale=4.0)
    s.attach(CPU)
    for _ in range(3):
        s.update_on_device(torch.tensor([1.0]))
    assert s.scale == 1.0
    for _ in range(5):
        s.update_on_device(torch.tensor([0.0]))
    assert s.scale == 4.0


def test_amp_with_a_fused_optimizer_decides_on_the_device():
    data = batches(3)
    results = {}
    for impl in ("foreach", "fused"):
        prec = AutocastPrecision(torch.float16, "cpu", init_scale=2.0 ** 10)
        results[impl] = run(prec, impl, data, inf_at=(1,)) + (prec,)
    (m_h, _, st_h, p_h), (m_d, _, st_d, p_d) = results["foreach"], results["fused"]
    assert all(isinstance(s, torch.Tensor) and s.dtype == torch.bool and s.shape == () for s in st_h + st_d)
    assert [bool(s) for s in st_h] == [True, False, True] and [bool(s) for s in st_d] == [True, False, True]
    assert p_d.skipped_steps == p_h.skipped_steps == 1 and p_d.loss_scale == p_h.loss_scale
    for a, b in zip(m_h.parameters(), m_d.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_weight_average_ignores_a_step_flagged_as_skipped_on_the_device():
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, _, _ = run(prec, "fused", batches(1))
    ema, ref = ModelEma(model, prec, decay=0.5), ModelEma(model, prec, decay=0.5)
    start = [p.detach().clone() for p in ema.model.parameters()]
    with torch.no_grad():
        for m in prec.masters:
            m.add_(1.0)
    ema.update(torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(ema.model.parameters(), start))
    ema.update(torch.tensor(True))
    ref.updates = 1  # the clock counts the skipped step too
    ref.update(torch.tensor(True))  # one step, no skip before it
    assert ema.updates == ref.updates == 2
    for a, b in zip(ema.model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)  # the skip left the average exactly as it was


def test_resume_keeps_this_runs_optimizer_implementation():
    p = [nn.Parameter(torch.randn(3))]
    saved = build_optimizer([{"params": p}], 0.1, 0.9, 0.0, "foreach", CPU)
    p[0].grad = torch.ones(3)
    saved.step()
    fused = fused_or_skip([{"params": [nn.Parameter(p[0].detach().clone())]}])
    load_optimizer_state(fused, saved.state_dict())
    assert fused.param_groups[0]["fused"] and supports_found_inf(fused)
    back = build_optimizer([{"params": [nn.Parameter(torch.randn(3))]}], 0.1, 0.9, 0.0, "foreach", CPU)
    load_optimizer_state(back, fused.state_dict())
    assert not back.param_groups[0].get("fused")


def test_weight_average_keeps_finite_statistics_when_a_skipped_step_left_nan_in_batchnorm():
    """An overflowing fp16 forward can leave NaN in BatchNorm's running statistics; the step is
    skipped, and the average must not take the NaN in (NaN * 0 is still NaN)."""
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, _, _ = run(prec, "fused", batches(1))
    ema = ModelEma(model, prec, decay=0.5)
    before = [b.clone() for b in ema.model.buffers() if b.is_floating_point()]
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    bn.running_var.fill_(float("nan"))
    ema.update(torch.tensor(False))
    after = [b for b in ema.model.buffers() if b.is_floating_point()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_resume_into_the_other_memory_layout_gives_buffers_the_parameters_strides():
    conv = nn.Conv2d(3, 4, 3)
    saved = build_optimizer([{"params": list(conv.parameters())}], 0.1, 0.9, 0.0, "foreach", CPU)
    for p in conv.parameters():
        p.grad = torch.ones_like(p)
    saved.step()
    cl = copy.deepcopy(conv).to(memory_format=torch.channels_last)
    fused = fused_or_skip([{"params": list(cl.parameters())}])
    load_optimizer_state(fused, saved.state_dict())
    for p in cl.parameters():
        buf = fused.state[p]["momentum_buffer"]
        assert buf.stride() == p.stride() and torch.equal(buf, saved.state[next(
            q for q, r in zip(conv.parameters(), cl.parameters()) if r is p)]["momentum_buffer"])


def test_auto_falls_back_to_foreach_where_fused_sgd_is_missing(monkeypatch):
    real = torch.optim.SGD

    def no_fused(*a, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(*a, **kw)

    monkeypatch.setattr(torch.optim, "SGD", no_fused)
    monkeypatch.setattr("imagenet.precision.optim.resolve_impl", lambda impl, device: "fused" if impl == "auto" else impl)
    opt = build_optimizer([{"params": [nn.Parameter(torch.zeros(2))]}], 0.1, 0.9, 0.0, "auto", CPU)
    assert not supports_found_inf(opt) and opt.param_groups[0]["foreach"]
    from imagenet.base.errors import UserError
    with pytest.raises(UserError, match="--optimizer-impl fused cannot run"):
        build_optimizer([{"params": [nn.Parameter(torch.zeros(2))]}], 0.1, 0.9, 0.0, "fused", CPU)
