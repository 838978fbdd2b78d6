"""The training loop's own rules (imagenet/training/engine.py), on tiny networks and hand-made loaders."""

import pytest
import torch
import torch.nn as nn

from imagenet.base.errors import UserError
from imagenet.parallel.distributed import DistContext
from imagenet.precision import LossScaler, MasterWeightPrecision, Precision
from imagenet.precision.optim import build_optimizer
from imagenet.training.engine import LoopOptions
from tests.helpers import epoch_of

CPU = DistContext("cpu", torch.device("cpu"), "test")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))


def loader(n_batches, size=4, seed=1):
    """``n_batches`` seeded (images, targets, skipped) batches of ``size`` 3x8x8 images."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 5, (size,), generator=g), [])
            for _ in range(n_batches)]


def sgd(model, lr=0.1, wd=0.0):
    return build_optimizer([{"params": list(model.parameters())}], lr, 0.9, wd, "foreach", torch.device("cpu"))


# ------------------------------------------------------------------ --max-nonfinite-steps


def skipping_precision():
    """fp32 through the master-weight path with a static scale: a NaN step is skipped, so the
    weights stay finite and the steps after it are finite again."""
    return MasterWeightPrecision(LossScaler(1.0, dynamic=False), model_dtype=torch.float32)


class Counted(list):
    """A loader's batches, counting those the loop took."""

    taken = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.taken += 1
            yield batch


def nan_run(nan_steps, limit, print_freq, n_batches=6, ctx=CPU, batches=None):
    batches = Counted(loader(n_batches)) if batches is None else batches
    for images, _, _ in batches[:nan_steps]:
        images[:] = float("nan")
    precision = skipping_precision()
    model = precision.prepare_model(net())
    opt = build_optimizer(precision.param_groups([{"params": list(model.parameters())}]), 0.1, 0.9, 0.0,
                          "foreach", torch.device("cpu"))
    return epoch_of(model, batches, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), precision, ctx,
                    LoopOptions(print_freq=print_freq, input_shape=(3, 8, 8), max_nonfinite_steps=limit))


@pytest.mark.parametrize("print_freq", [1, 100])
def test_max_nonfinite_steps_n_stops_after_exactly_n_steps_in_a_row(print_freq):
    # a run of 3 that ends with the epoch counts too
    with pytest.raises(UserError, match="NaN/inf for 3 steps in a row"):
        nan_run(nan_steps=3, limit=3, print_freq=print_freq)
    with pytest.raises(UserError, match="NaN/inf for 3 steps in a row"):
        nan_run(nan_steps=6, limit=3, print_freq=print_freq)
    out = nan_run(nan_steps=2, limit=3, print_freq=print_freq)
    assert out.steps == 6 and out.skipped_steps == 2


@pytest.mark.parametrize("mode", ["cpu", "ddp"])
def test_max_nonfinite_steps_is_checked_every_step_not_at_print_time(mode, tmp_path):
    """With -p far above the epoch's steps and a limit of 3, every loss NaN: the run stops within a
    step of the third (it read the count at print time only, and trained all 20). Under DDP the
    count is the ranks' maximum (one rank here)."""
    import torch.distributed as dist
    ctx = CPU
    if mode == "ddp":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
        ctx = DistContext("ddp", torch.device("cpu"), "test", backend="gloo")
    batches = Counted(loader(20))
    try:
        with pytest.raises(UserError, match="NaN/inf for 3 steps in a row"):
            nan_run(nan_steps=20, limit=3, print_freq=1000, ctx=ctx, batches=batches)
    finally:
        if mode == "ddp":
            dist.destroy_process_group()
    assert 3 <= batches.taken <= 4


# ------------------------------------------------------------------ DDP: a rank whose batch is empty


def bn_net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5))
    with torch.no_grad():  # statistics that a batch of zeros would visibly pull (toward 0 and 0)
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    return model


EMPTY = (torch.empty(0), torch.empty(0, dtype=torch.long), ["unreadable.JPEG"])


def test_a_stand_in_batch_leaves_batchnorm_statistics_alone(tmp_path):
    """Under DDP a rank whose batch came out empty still joins the step's all-reduce, with a
    stand-in batch of zero weight: its gradient is zero, and its BatchNorm statistics must not
    move either (an all-zeros stand-in pulled them toward zero; a repeated batch counts twice)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    ddp_ctx = DistContext("ddp", torch.device("cpu"), "test", backend="gloo")
    opts = LoopOptions(print_freq=100, input_shape=(3, 8, 8))

    def buffers_after(batches):
        model = nn.parallel.DistributedDataParallel(bn_net())
        opt = sgd(model)
        epoch_of(model, batches, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                 Precision(), ddp_ctx, opts)
        return {k: v.clone() for k, v in model.module.named_buffers()}
    try:
        fresh = {k: v.clone() for k, v in bn_net().named_buffers()}
        for k, v in buffers_after([EMPTY]).items():  # the all-zeros stand-in
            assert torch.equal(v, fresh[k]), k
        good = loader(1)
        for k, v in buffers_after([*good, EMPTY]).items():  # the last good batch as the stand-in
            assert torch.equal(v, buffers_after(good)[k]), k
    finally:
        dist.destroy_process_group()
