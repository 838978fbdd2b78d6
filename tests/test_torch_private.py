"""The private torch APIs of imagenet.base.torch_private still exist and behave as the trainer relies on.

Each test names the torch attribute it checks, so a torch release that changes one says which
helper to rewrite.
"""

import torch
import torch.nn as nn

from imagenet.base import torch_private as tp
from tests.helpers import fused_or_skip


def test_grad_scaler_scale_is_its_device_tensor():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert hasattr(scaler, "_scale"), "torch.amp.GradScaler._scale is gone"
    assert tp.grad_scaler_scale(scaler) is None, "torch.amp.GradScaler._scale is no longer None before scale()"
    scaler.scale(torch.ones(()))
    scale = tp.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.shape == () and scale.dtype == torch.float32, \
        f"torch.amp.GradScaler._scale is no longer a 0-dim float32 tensor: {scale!r}"
    assert float(scale) == scaler.get_scale() == 8.0, "torch.amp.GradScaler._scale no longer holds the scale"
    # The trainer reads it after update() to tell a skipped step (the scale shrank) from a taken one.
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.full((2,), float("inf"))
    scaler.step(opt)
    scaler.update()
    assert float(tp.grad_scaler_scale(scaler)) == 4.0, "torch.amp.GradScaler._scale does not follow update()"


def test_amp_update_scale_backs_off_on_overflow_and_grows_after_the_interval():
    assert hasattr(torch, "_amp_update_scale_"), "torch._amp_update_scale_ is gone"
    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    tp.amp_update_scale_(scale, tracker, torch.ones(1), 2.0, 0.5, 2)
    assert (float(scale), int(tracker)) == (4.0, 0), "torch._amp_update_scale_ no longer backs off on found_inf"
    tp.amp_update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 2)
    assert (float(scale), int(tracker)) == (4.0, 1), "torch._amp_update_scale_ no longer counts clean steps"
    tp.amp_update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 2)
    assert (float(scale), int(tracker)) == (8.0, 0), "torch._amp_update_scale_ no longer grows after the interval"


def test_amp_unscale_and_check_unscales_and_flags_inf_and_nan():
    assert hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_"), \
        "torch._amp_foreach_non_finite_check_and_unscale_ is gone"
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0)]
    found_inf = torch.zeros(1)
    tp.amp_unscale_and_check_(grads, found_inf, torch.full((1,), 0.25))
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.ones(2)), \
        "torch._amp_foreach_non_finite_check_and_unscale_ no longer multiplies by inv_scale"
    assert float(found_inf) == 0.0, "torch._amp_foreach_non_finite_check_and_unscale_ flagged finite values"
    for bad in (float("inf"), float("nan")):
        found_inf.zero_()
        tp.amp_unscale_and_check_([torch.tensor([1.0, bad])], found_inf, torch.ones(1))
        assert float(found_inf) == 1.0, f"torch._amp_foreach_non_finite_check_and_unscale_ missed {bad}"


def test_foreach_zero_zeroes_every_tensor():
    assert hasattr(torch, "_foreach_zero_"), "torch._foreach_zero_ is gone"
    tensors = [torch.ones(3), torch.ones(2, 2, dtype=torch.float16)]
    tp.foreach_zero_(tensors)
    assert all(not t.any() for t in tensors), "torch._foreach_zero_ no longer zeroes"


def test_foreach_copy_copies_across_dtypes():
    assert hasattr(torch, "_foreach_copy_"), "torch._foreach_copy_ is gone"
    dst = [torch.zeros(3, dtype=torch.float16), torch.zeros(2)]
    src = [torch.arange(3.0), torch.arange(2.0, dtype=torch.float16)]
    tp.foreach_copy_(dst, src)
    assert all(torch.equal(d.float(), s.float()) for d, s in zip(dst, src)), "torch._foreach_copy_ no longer copies"


def test_fused_optimizer_takes_found_inf_and_skips_on_it():
    p = nn.Parameter(torch.ones(3))
    foreach = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=True)
    assert not tp.takes_found_inf(foreach), "torch.optim.SGD(foreach=True)._step_supports_amp_scaling is now set"
    opt = fused_or_skip([{"params": [p]}], lr=0.5, wd=0.0)
    assert hasattr(opt, "_step_supports_amp_scaling"), "torch.optim.SGD(fused=True)._step_supports_amp_scaling is gone"
    assert tp.takes_found_inf(opt), "torch.optim.SGD(fused=True)._step_supports_amp_scaling is no longer True"
    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    p.grad = torch.ones(3)
    tp.step_skipping_on_device(opt, torch.ones(1))
    assert torch.equal(p.detach(), torch.ones(3)), "the fused SGD's step() no longer skips on optimizer.found_inf"
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(3)), \
        "the fused SGD's step() wrote its momentum despite optimizer.found_inf"
    assert opt.found_inf is None and opt.grad_scale is None
    tp.step_skipping_on_device(opt, torch.zeros(1))
    assert torch.equal(p.detach(), torch.full((3,), 0.5)), \
        "the fused SGD's step() no longer steps with optimizer.found_inf 0 and grad_scale None (gradients unscaled)"


def test_set_last_lr_is_what_get_last_lr_answers():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    assert hasattr(scheduler, "_last_lr"), "torch.optim.lr_scheduler.LRScheduler._last_lr is gone"
    tp.set_last_lr(scheduler, [0.025])
    assert scheduler.get_last_lr() == [0.025], \
        "torch.optim.lr_scheduler.LRScheduler.get_last_lr() no longer answers _last_lr"
    state = scheduler.state_dict()
    assert state.get("_last_lr") == [0.025], "torch.optim.lr_scheduler.LRScheduler._last_lr is no longer saved"



def test_inductor_tune_kernels_turns_on_coordinate_descent_tuning():
    import torch._inductor.config as inductor
    assert hasattr(inductor, "coordinate_descent_tuning"), \
        "torch._inductor.config.coordinate_descent_tuning is gone: --tune-kernels would do nothing"
    before = inductor.coordinate_descent_tuning
    try:
        tp.inductor_tune_kernels()
        assert inductor.coordinate_descent_tuning is True
    finally:
        inductor.coordinate_descent_tuning = before


def test_shared_bytes_is_a_writable_shared_memory_tensor():
    assert hasattr(torch.UntypedStorage, "_new_shared"), "torch.UntypedStorage._new_shared is gone"
    x = tp.shared_bytes(10)
    assert x.is_shared() and x.dtype == torch.uint8 and x.shape == (10,), \
        "torch.UntypedStorage._new_shared no longer makes a shared storage of n bytes"
    x.fill_(7)
    assert x.sum() == 70


def test_shutdown_workers_ends_a_loaders_persistent_workers():
    import multiprocessing

    from torch.utils.data import DataLoader
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert getattr(loader, "_iterator", None) is not None, "DataLoader._iterator (persistent workers) is gone"
    assert hasattr(loader._iterator, "_shutdown_workers"), "the DataLoader iterator's _shutdown_workers is gone"
    assert multiprocessing.active_children()
    tp.shutdown_workers(loader)
    assert multiprocessing.active_children() == [], "DataLoader._iterator._shutdown_workers() left workers running"
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]  # a later epoch starts new ones
    tp.shutdown_workers(loader)
    tp.shutdown_workers(DataLoader(list(range(4))))  # no workers: nothing to do


def _compiled(fn):
    """``fn`` compiled for static shapes by Dynamo alone (no Inductor: fast on a CPU). Dynamo keeps
    its graphs per code object: each test passes a function of its own."""
    return torch.compile(fn, backend="eager", dynamic=False)


def test_compiled_graphs_counts_each_new_shape_once():
    fn, before = _compiled(lambda x: x * x), tp.compiled_graphs()
    fn(torch.ones(2))
    fn(torch.ones(3))
    assert tp.compiled_graphs() - before == 2, 'torch._dynamo.utils.counters["stats"]["unique_graphs"] no longer counts'
    fn(torch.ones(2))
    assert tp.compiled_graphs() - before == 2, 'counters["stats"]["unique_graphs"] counts a shape compiled before'


def test_raise_recompile_limit_lets_dynamo_compile_every_shape():
    import torch._dynamo.config as dynamo
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    assert hasattr(dynamo, name), "torch._dynamo.config has neither recompile_limit nor cache_size_limit"
    saved = getattr(dynamo, name)
    try:
        setattr(dynamo, name, 2)
        assert tp.raise_recompile_limit(5) == 5 and tp.raise_recompile_limit(3) == 5  # never lowered
        fn, before = _compiled(lambda x: x + 1), tp.compiled_graphs()
        for n in range(1, 6):
            fn(torch.ones(n))
        assert tp.compiled_graphs() - before == 5, f"torch._dynamo.config.{name} no longer bounds the graphs"
        fn(torch.ones(6))  # the sixth shape is past the limit: Dynamo runs it uncompiled
        assert tp.compiled_graphs() - before == 5, f"torch._dynamo.config.{name} is no longer the limit"
    finally:
        setattr(dynamo, name, saved)
