"""--accum-steps: several forward/backward passes per optimizer step, -b stays the step's batch."""

import json

import pytest
import torch
import torch.nn as nn

from imagenet.cli import main
from imagenet.parallel.distributed import DistContext
from imagenet.precision import AutocastPrecision, LossScaler, MasterWeightPrecision, Precision
from imagenet.precision.optim import build_optimizer
from imagenet.training import engine
from imagenet.training.engine import LoopOptions
from tests.helpers import assert_same_run, epoch_of, interrupt_after_step
from tests.helpers import last_checkpoint as weights
from tests.helpers import resnet18_args as args

CPU = DistContext("cpu", torch.device("cpu"), "test")
GPU = DistContext("gpu", torch.device("cuda", 0), "test")


def net():
    torch.manual_seed(0)  # no BatchNorm: its statistics are per forward pass, so only then is the math equal
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))


def data(n_images=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_images, 3, 8, 8, generator=g), torch.randint(0, 5, (n_images,), generator=g)


def run(precision, accum, micro, hold=False):
    images, targets = data()
    loader = [(images[i:i + micro], targets[i:i + micro], []) for i in range(0, len(images), micro)]
    model = precision.prepare_model(net())
    if hold:
        precision.hold_gradients(model)
        precision.held_pointers = [p.grad.data_ptr() for p in model.parameters()]
    opt = build_optimizer(precision.param_groups([{"params": list(model.parameters())}]), 0.1, 0.9, 1e-4,
                          "foreach", torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out = epoch_of(model, loader, opt, sched, precision, CPU,
                   LoopOptions(print_freq=100, accum_steps=accum, input_shape=(3, 8, 8)))
    return model, sched, out


@pytest.mark.parametrize("make", [Precision, lambda: MasterWeightPrecision(LossScaler(256, dynamic=False),
                                                                         model_dtype=torch.float32)])
def test_four_passes_of_4_equal_one_of_16(make):
    big, s_big, o_big = run(make(), accum=1, micro=16)
    small, s_small, o_small = run(make(), accum=4, micro=4)
    assert o_big.steps == o_small.steps == 2
    assert s_big.last_epoch == s_small.last_epoch == 2  # the schedule counts optimizer steps
    assert o_small.samples == 32 and o_small.loss == pytest.approx(o_big.loss, rel=1e-5)
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_last_incomplete_group_is_dropped():
    _, sched, out = run(Precision(), accum=3, micro=4)  # 8 micro-batches: 2 steps of 3, 2 left over
    assert out.steps == 2 and sched.last_epoch == 2 and out.steps_done == 6


def test_ddp_accumulates_without_all_reducing_until_the_last_pass(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(net())
        with engine._grad_sync(model, sync=False):
            assert not model.require_backward_grad_sync
        with engine._grad_sync(model, sync=True):
            assert model.require_backward_grad_sync
        # and the training loop asks for it: only the last of each group of passes all-reduces
        synced = []
        model.module.register_forward_pre_hook(lambda m, i: synced.append(model.require_backward_grad_sync))
        images, targets = data()
        loader = [(images[i:i + 4], targets[i:i + 4], []) for i in range(0, 32, 4)]
        opt = build_optimizer([{"params": list(model.parameters())}], 0.1, 0.9, 0.0, "foreach", torch.device("cpu"))
        ddp_ctx = DistContext("ddp", torch.device("cpu"), "test", backend="gloo")
        epoch_of(model, loader, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), Precision(), ddp_ctx,
                 LoopOptions(print_freq=100, accum_steps=2, input_shape=(3, 8, 8)))
        assert synced == [False, True] * 4
    finally:
        dist.destroy_process_group()


def test_trainer_resumes_an_accumulating_run_bit_exactly(digits, tmp_path):
    # -b 8 as two passes of 4: 10 optimizer steps per epoch of the 80 training digits.
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(args(digits, straight, "-j", "0", "--accum-steps", "2")) == 0
    rows = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    assert [r["steps"] for r in rows] == [10, 10] and rows[0]["train_samples"] == 80
    assert main(args(digits, resumed, "-j", "0", "--accum-steps", "2", "--epochs", "1")) == 0
    assert main(args(digits, resumed, "-j", "0", "--accum-steps", "2", "--resume", "auto")) == 0
    assert_same_run(weights(straight), weights(resumed))


def test_mid_epoch_checkpoints_fall_between_optimizer_steps(digits, tmp_path, monkeypatch):
    steps_seen = []
    interrupt_after_step(monkeypatch, 6, seen=steps_seen)
    # every 2 optimizer steps = every 4 loader batches: a save at 4 only (counting loader batches
    # would save at 2, 4 and 6)
    assert main(args(digits, tmp_path, "-j", "0", "--accum-steps", "2", "--save-every-steps", "2")) == 130
    assert steps_seen == [2, 4, 6]  # loader batches done, only at the end of a step
    assert (weights(tmp_path)["epoch"], weights(tmp_path)["step_in_epoch"]) == (0, 4)


def test_batch_that_does_not_split_is_refused(digits, tmp_path, capsys):
    assert main(args(digits, tmp_path, "-j", "0", "--accum-steps", "3")) == 2
    err = capsys.readouterr().err
    assert "--accum-steps 3 must divide" in err and "-b 6" in err


def test_the_nan_stop_counts_optimizer_steps_not_passes():
    """--max-nonfinite-steps 3 with 4 passes per step: 2 NaN steps (8 NaN passes) must not stop."""
    images, targets = data()
    images[:] = float("nan")
    loader = [(images[i:i + 4], targets[i:i + 4], []) for i in range(0, 32, 4)]
    model = net()
    opt = build_optimizer([{"params": list(model.parameters())}], 0.1, 0.9, 0.0, "foreach", torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = epoch_of(model, loader, opt, sched, Precision(), CPU,
                   LoopOptions(print_freq=1, accum_steps=4, input_shape=(3, 8, 8), max_nonfinite_steps=3))
    assert out.steps == 2
    from imagenet.base.errors import UserError
    with pytest.raises(UserError, match="NaN/inf for 3 steps"):
        epoch_of(net(), loader, opt, sched, Precision(), CPU,
                 LoopOptions(print_freq=1, accum_steps=1, input_shape=(3, 8, 8), max_nonfinite_steps=3))


@pytest.mark.parametrize("make", [Precision, lambda: MasterWeightPrecision(LossScaler(256, dynamic=False),
                                                                         model_dtype=torch.float32),
                                  lambda: AutocastPrecision(torch.bfloat16, "cpu")])
def test_held_gradients_train_bit_for_bit_as_dropped_ones(make):
    """Under CUDA graphs with --accum-steps the gradients stay in buffers of the run's, zeroed in
    place after each step (Precision.hold_gradients): the first pass adds into zeros what it would
    have lent, so the run is the same, bit for bit, and the buffers are never replaced."""
    dropped, _, _ = run(make(), accum=4, micro=4)
    precision = make()
    held, _, _ = run(precision, accum=4, micro=4, hold=True)
    for a, b in zip(dropped.parameters(), held.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is not None and not p.grad.any() for p in held.parameters())  # zeroed by the last step
    assert [p.grad.data_ptr() for p in held.parameters()] == precision.held_pointers


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "amp"])
def test_accumulation_under_cuda_graphs_follows_eager_accumulation(mode):
    """--accum-steps under --compile reduce-overhead: each pass's backward replays a CUDA graph whose
    outputs the next replay overwrites; with the gradients held, four passes of 8 a step must train
    as the eager model accumulating them does (torch stopped with "accessing tensor output of
    CUDAGraphs that has been overwritten" before, pytorch/pytorch#169545)."""
    from imagenet.models.registry import compile_model
    from imagenet.precision import AutocastPrecision as Autocast

    torch.manual_seed(1)
    images, targets = torch.randn(64, 3, 16, 16, device="cuda"), torch.randint(0, 5, (64,), device="cuda")
    loader = [(images[i:i + 8], targets[i:i + 8], []) for i in range(0, 64, 8)] * 2  # 4 steps of 4 passes
    results = {}
    for compiled in (False, True):
        precision = (MasterWeightPrecision(LossScaler(128, dynamic=False)) if mode == "fp16"
                     else Autocast(torch.float16, "cuda"))
        torch.manual_seed(0)
        model = precision.prepare_model(nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5)).cuda())
        opt = build_optimizer(precision.param_groups([{"params": list(model.parameters())}]), 0.05, 0.9, 1e-4,
                              "auto", torch.device("cuda"))
        run_model = model
        if compiled:
            run_model = compile_model(model, "reduce-overhead", "gpu")
            precision.hold_gradients(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        out = epoch_of(run_model, loader, opt, sched, precision, GPU,
                       LoopOptions(print_freq=100, accum_steps=4, input_shape=(3, 16, 16)))
        results[compiled] = out.loss, [p.detach().float().clone() for p in model.parameters()]
    (eager_loss, eager_w), (graph_loss, graph_w) = results[False], results[True]
    assert graph_loss == pytest.approx(eager_loss, rel=2e-2)
    for a, b in zip(eager_w, graph_w):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)



# ------------------------------------------------------------------ unreadable images inside a group

EMPTY = (torch.empty(0), torch.empty(0, dtype=torch.long), ["unreadable.JPEG"])


def run_on(loader, accum):
    model = net()
    opt = build_optimizer([{"params": list(model.parameters())}], 0.1, 0.9, 1e-4, "foreach", torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out = epoch_of(model, loader, opt, sched, Precision(), CPU,
                   LoopOptions(print_freq=100, accum_steps=accum, input_shape=(3, 8, 8)))
    return model, sched, out


@pytest.mark.parametrize("accum", [1, 2])
def test_a_group_of_unreadable_batches_still_advances_the_schedule(accum):
    """No images, no optimizer step; but the schedule is a function of the step index (a resumed
    run computes it so), or every later step of the run would take the learning rate of the one before."""
    images, targets = data()
    loader = [(images[i:i + 4], targets[i:i + 4], []) for i in range(0, 32, 4)]
    loader[2:4] = [EMPTY, EMPTY]  # with --accum-steps 2: the second group
    _, sched, out = run_on(loader, accum)
    groups = len(loader) // accum
    assert sched.last_epoch == groups
    assert out.steps == groups - (2 if accum == 1 else 1)


def test_a_partly_unreadable_group_weighs_the_images_it_has():
    """A group's step follows the mean loss over the images the group has, as one batch of them
    would: a micro-batch missing images, or missing altogether, does not shrink the step."""
    images, targets = data(24)
    parts = [(images[i:i + 4], targets[i:i + 4], []) for i in range(0, 24, 4)]
    short = (images[20:22], targets[20:22], ["a.JPEG", "b.JPEG"])  # 2 of its 4 images unreadable
    accumulated = [parts[0], parts[1], EMPTY, parts[3], parts[4], short]
    whole = [(images[:8], targets[:8], []), (images[12:16], targets[12:16], []),
             (torch.cat([images[16:20], images[20:22]]), torch.cat([targets[16:20], targets[20:22]]), [])]
    a, _, out = run_on(accumulated, accum=2)
    b, _, _ = run_on(whole, accum=1)
    assert out.samples == 18
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_trainer_keeps_the_schedule_when_a_whole_group_is_unreadable(digits, tmp_path):
    """The real folder, loader and runner: the first optimizer step's 8 images (2 passes of 4)
    are unreadable files, so the epoch takes 9 optimizer steps, and its schedule ten."""
    import shutil
    from pathlib import Path

    from imagenet.data.images.folder import SafeImageFolder
    from imagenet.data.samplers import SeededSampler
    root = tmp_path / "data"
    shutil.copytree(digits, root)
    train = SafeImageFolder(str(root / "train"))
    first = [idx for idx, _seed in SeededSampler(train, 1, 0, seed=0)][:8]  # --seed 0, epoch 0
    for idx in first:
        Path(train.samples[idx][0]).write_bytes(b"")
    out = tmp_path / "out"
    assert main(args(root, out, "-j", "0", "--accum-steps", "2", "--epochs", "1", "--max-bad-fraction", "0.1",
                     "--lr-schedule", "cosine")) == 0
    row = json.loads(open(out / "metrics.jsonl").readline())
    assert row["skipped_images"] == 8 and row["train_samples"] == 72 and row["steps"] == 9
    assert weights(out)["scheduler"]["last_epoch"] == 10
    assert row["lr_end"] == pytest.approx(0.0, abs=1e-12)  # cosine to zero at the end of the run


def test_accumulation_is_accepted_in_every_compile_mode():
    from imagenet.base.config import Config, validate
    for mode in ("off", "default", "reduce-overhead", "max-autotune"):
        validate(Config(arch="resnet18", accum_steps=2, compile=mode))


def test_running_out_of_gpu_memory_names_accum_steps(monkeypatch, capsys):
    """A global batch too large for one GPU (MLPerf's -b 3200 in one pass) is a one-line error naming
    the fix, not torch's traceback."""
    from imagenet.training import runner

    def out_of_memory(cfg, env=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(runner, "run", out_of_memory)
    assert main(["--dummy", "-b", "3200"]) == 2
    err = capsys.readouterr().err
    assert "ran out of memory with -b 3200 (--accum-steps 1)" in err and "--accum-steps N" in err
    assert "Traceback" not in err
