"""Throughput as users see it: the steady training rate and the share of it spent waiting for input."""

import json
import time

import pytest
import torch
import torch.nn as nn

from imagenet.cli import main
from imagenet.parallel.distributed import DistContext
from imagenet.precision import Precision
from imagenet.precision.optim import build_optimizer
from imagenet.training.engine import LoopOptions
from tests.helpers import epoch_of

CPU = DistContext("cpu", torch.device("cpu"), "test")


class SlowLoader:
    """``n`` batches of 4 tiny images; batch i arrives after ``delay(i)`` seconds."""

    def __init__(self, n, delay, device="cpu"):
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(4, 3, 8, 8, generator=g).to(device),
                         torch.randint(0, 5, (4,), generator=g).to(device), []) for _ in range(n)]
        self.delay = delay

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            time.sleep(self.delay(i))
            yield batch


class Busy(nn.Module):
    """A tiny classifier that keeps the GPU busy ``matmuls`` 4096^2 products a step (about 2-3 ms
    each on an H200), queued in a few microseconds: the device's time, not the host's."""

    def __init__(self, matmuls: int):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
        self.matmuls = matmuls
        self.register_buffer("a", torch.randn(4096, 4096) / 64)

    def forward(self, x):
        with torch.no_grad():
            for _ in range(self.matmuls):
                torch.mm(self.a, self.a)
        return self.head(x)


def epoch(loader, model=None, ctx=CPU):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                   nn.Linear(8, 5))
    model.to(ctx.device)
    opt = build_optimizer([{"params": list(model.parameters())}], 0.1, 0.9, 0.0, "foreach", ctx.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    start = time.perf_counter()
    out = epoch_of(model, loader, opt, sched, Precision(), ctx, LoopOptions(print_freq=1000, input_shape=(3, 8, 8)))
    return out, time.perf_counter() - start


@pytest.mark.gpu
def test_on_a_gpu_the_wait_is_the_devices_idle_time_not_the_hosts():
    """The host waits 10 ms a batch either way. While the GPU still works through ~30 ms of
    queued steps that wait costs nothing (the host's own wait would say a quarter of the time);
    with 80 ms a batch the GPU idles most of each step."""
    gpu = DistContext("gpu", torch.device("cuda"), "test")
    torch.backends.cuda.matmul.allow_tf32 = False
    busy = Busy(12)
    out, _ = epoch(SlowLoader(40, lambda i: 0.01, device="cuda"), busy, gpu)
    seconds = out.steady.seconds
    assert out.data_wait_frac < 0.05 and seconds / 30 > 0.02, (out.data_wait_frac, seconds)
    slow, _ = epoch(SlowLoader(40, lambda i: 0.08, device="cuda"), busy, gpu)
    assert slow.data_wait_frac > 0.4, slow.data_wait_frac


def test_img_per_s_leaves_out_the_first_steps():
    # The first batch takes a second (workers starting, compilation): the steady span starts
    # after the 10 warm-up steps, so neither that second nor those images are in the rate.
    out, seconds = epoch(SlowLoader(50, lambda i: 1.0 if i == 0 else 0.0))
    images, steady_seconds, waited = out.steady.images, out.steady.seconds, out.steady.waited
    assert out.samples == 200 and images == 4 * 40
    assert steady_seconds < seconds - 0.9, (steady_seconds, seconds)
    assert out.img_per_s == pytest.approx(images / steady_seconds)
    assert out.data_wait_frac == pytest.approx(waited / steady_seconds) and waited < 0.5


def test_data_wait_frac_is_high_for_a_slow_loader():
    out, _ = epoch(SlowLoader(20, lambda i: 0.15))
    assert out.data_wait_frac > 0.6, out.data_wait_frac


def dummy_run(out, *extra):
    return main(["--dummy", "--dummy-train-size", "400", "--dummy-val-size", "8", "--dummy-classes", "5",
                 "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "1000",
                 "--epochs", "1", "--seed", "0", "--output-dir", str(out), *extra])


def test_an_input_bound_epoch_says_so_and_what_to_try(tmp_path, monkeypatch, capsys):
    from imagenet.data.synthetic import SyntheticLoader
    fast_iter = SyntheticLoader.__iter__

    def slow(self):
        for batch in fast_iter(self):
            time.sleep(0.05)
            yield batch
    monkeypatch.setattr(SyntheticLoader, "__iter__", slow)
    assert dummy_run(tmp_path) == 0
    out = capsys.readouterr().out
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["data_wait_frac"] > 0.1
    assert "=> epoch 0 was input-bound: the training loop waited for data" in out and "-j, now 0" in out, out
    assert "waiting for input" in out.splitlines()[-1]  # the summary line


def test_a_model_bound_epoch_stays_quiet(tmp_path, capsys):
    assert dummy_run(tmp_path) == 0
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["data_wait_frac"] < 0.1 and row["img_per_s"] > 0
    assert "input-bound" not in capsys.readouterr().out
