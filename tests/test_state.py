"""The runner's wiring: build_training's order, the training state and progress as checkpoint
halves, the checkpoint policy's cadence, and the one wiring path bench.py shares."""

import dataclasses
import io
import json
import os
import sys

import pytest
import torch

from imagenet.base import checkpoint as ckpt_io
from imagenet.base.config import Config
from imagenet.parallel.distributed import DistContext
from imagenet.precision import MasterWeightPrecision
from imagenet.training.engine import SoFar
from imagenet.training.savepolicy import CheckpointPolicy
from imagenet.training.state import Progress, build_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = DistContext("cpu", torch.device("cpu"), "test")


def cfg(**over):
    return dataclasses.replace(Config(arch="resnet18", image_size=16), **over)


def test_fp16_optimizer_updates_the_fp32_masters_and_the_model_is_fp16():
    state = build_training(cfg(fp16=True), CPU, num_classes=3, iters_per_epoch=4)
    assert isinstance(state.precision, MasterWeightPrecision)
    optimized = [p for g in state.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in optimized)
    assert {id(p) for p in optimized} == {id(m) for m in state.precision.masters}
    assert state.model.conv1.weight.dtype == torch.float16 and state.model.bn1.weight.dtype == torch.float32


def test_no_bn_weight_decay_groups_and_the_schedule_are_this_configs():
    state = build_training(cfg(no_bn_weight_decay=True, lr=0.2, warmup_epochs=1), CPU, num_classes=3,
                           iters_per_epoch=4)
    decays = sorted(g["weight_decay"] for g in state.optimizer.param_groups)
    assert decays == [0.0, 1e-4]
    assert state.lr == pytest.approx(0.2 / 4)  # the first warm-up step of four


def test_mixing_trains_on_plain_cross_entropy_and_validates_with_the_smoothing():
    plain = build_training(cfg(label_smoothing=0.1), CPU, 3, 4)
    assert plain.mixer is None and plain.train_criterion is plain.criterion
    mixed = build_training(cfg(label_smoothing=0.1, mixup=0.2), CPU, 3, 4)
    assert mixed.mixer is not None and mixed.train_criterion.label_smoothing == 0.0
    assert mixed.criterion.label_smoothing == 0.1


def test_weight_average_follows_the_config():
    assert build_training(cfg(), CPU, 3, 4).ema is None
    assert build_training(cfg(model_ema=0.99), CPU, 3, 4).ema is not None


def _one_step(state):
    x, y = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 0])
    state.model.train()
    loss = state.train_criterion(state.precision.forward(state.model, x), y)
    state.precision.backward(loss)
    state.precision.step(state.optimizer)
    state.scheduler.step()


def test_train_state_round_trips_through_its_state_dict():
    torch.manual_seed(0)
    a = build_training(cfg(fp16=True, model_ema=0.9, loss_scale="8"), CPU, 3, 4)
    _one_step(a)
    assert a.precision.skipped_steps == 0
    buffer = io.BytesIO()  # through bytes, as a checkpoint: in memory the two would share tensors
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert {"state_dict", "optimizer", "scheduler", "precision", "state_dict_ema", "ema_updates"} <= set(saved)
    torch.manual_seed(1)  # another initialisation: everything must come from the state dict
    b = build_training(cfg(fp16=True, model_ema=0.9, loss_scale="8"), CPU, 3, 4)
    b.load_state_dict(saved)
    for name, m in zip(b.precision.names, b.precision.masters):
        assert torch.equal(m, saved["state_dict"][name]), name
    assert b.scheduler.last_epoch == a.scheduler.last_epoch and b.ema.updates == a.ema.updates
    _one_step(a)
    _one_step(b)
    for pa, pb in zip(a.precision.masters, b.precision.masters):
        assert torch.equal(pa, pb)


def test_progress_state_dict_keeps_the_sums_only_mid_epoch():
    mid = Progress(2, 5, 40.0, [1.0, 2.0], run_seconds=12.5)
    assert mid.state_dict() == {"epoch": 2, "step_in_epoch": 5, "best_acc1": 40.0, "train_partial": [1.0, 2.0],
                                "run_seconds": 12.5}
    back = Progress()
    back.load_state_dict(mid.state_dict())
    assert back == mid
    end = mid.next_epoch(30.0)
    assert end == Progress(3, 0, 40.0, None, run_seconds=12.5) and "train_partial" not in end.state_dict()
    assert mid.next_epoch(50.0).best_acc1 == 50.0
    trained = mid.at_step(8, [1.0], trained=True)  # after the epoch's last step
    assert trained.state_dict()["epoch_trained"] is True and "epoch_trained" not in mid.state_dict()
    back.load_state_dict(trained.state_dict())
    assert back == trained and back.steps_done(8, 1) == 3 * 8 and mid.steps_done(8, 1) == 2 * 8 + 5
    assert not trained.at_step(0, None).trained  # --on-data-change restart-epoch, another batch size
    assert mid.next_epoch(None).best_acc1 == 40.0  # an epoch the cadence did not validate


def test_checkpoint_policy_saves_every_k_optimizer_steps_with_the_progress(tmp_path):
    c = cfg(output_dir=str(tmp_path), save_every_steps=2, accum_steps=2)
    state = build_training(c, CPU, 3, 4)
    policy = CheckpointPolicy(c, CPU, ["a", "b", "c"])
    hook = policy.step_hook(state, Progress(1, 0, 10.0), batches=8)
    path = tmp_path / ckpt_io.CHECKPOINT
    hook(2, lambda: pytest.fail("no save after one optimizer step"))
    assert not path.exists()
    hook(4, lambda: SoFar([4.0], ["train/a/bad.JPEG"]))  # 4 loader batches = 2 optimizer steps of 2 passes
    saved = ckpt_io.read_checkpoint(str(path))
    assert (saved["epoch"], saved["step_in_epoch"], saved["best_acc1"], saved["train_partial"]) == (1, 4, 10.0, [4.0])
    assert saved["skipped_partial"] == ["train/a/bad.JPEG"]
    assert saved["classes"] == ["a", "b", "c"] and saved["config"]["save_every_steps"] == 2
    assert "epoch_trained" not in saved
    hook(8, lambda: SoFar([8.0], []))  # the epoch's last: its training is done
    assert ckpt_io.read_checkpoint(str(path))["epoch_trained"] is True
    assert CheckpointPolicy(cfg(output_dir=str(tmp_path)), CPU, []).step_hook(state, Progress(), 8) is None


def test_the_first_epoch_writes_model_best_even_at_zero_accuracy(tmp_path):
    policy = CheckpointPolicy(cfg(output_dir=str(tmp_path)), CPU, [])
    assert policy.is_best(0.0, Progress())
    (tmp_path / ckpt_io.BEST).write_bytes(b"")
    assert not policy.is_best(0.0, Progress()) and policy.is_best(1.0, Progress(best_acc1=0.5))


def test_bench_builds_the_step_through_the_trainers_wiring(monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    import bench
    built = []
    real = bench.build_training
    monkeypatch.setattr(bench, "build_training", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    ns = dict(arch="resnet18", batch_size=4, image_size=16, optimizer_impl="foreach", compile="off",
              no_cudnn_benchmark=False, num_classes=3, ddp_bucket_mb=0, ddp_bucket_view=False, dp_impl="persistent",
              tune_kernels=False, maxpool_kernel="auto", bn_kernel="torch", optimizer="lars", blurpool=False)
    step = bench.build_step(type("Args", (), ns)(), "fp16", False, CPU)
    step(torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0]))
    (state,) = built
    assert isinstance(state.precision, MasterWeightPrecision)
    optimized = [p for g in state.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimized} == {id(m) for m in state.precision.masters}
    assert state.optimizer.param_groups[0]["lr"] == 0.01
    assert [g["lars"] for g in state.optimizer.param_groups] == [True, False]  # bench.py --optimizer lars


def test_a_row_lost_between_the_checkpoint_and_metrics_jsonl_comes_back_on_resume(digits, tmp_path):
    """A run killed after an epoch's checkpoint but before its metrics row: resuming writes the
    row from the checkpoint, once, and no row of another run's checkpoint."""
    from imagenet.cli import main
    from tests.helpers import resnet18_args
    out = tmp_path / "run"
    assert main(resnet18_args(digits, out, "-j", 0, "--epochs", 1)) == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("")  # as if the run died right after the checkpoint
    assert main(resnet18_args(digits, out, "-j", 0, "--epochs", 2, "--resume", "auto")) == 0
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1] and (out / "metrics.jsonl").read_text().splitlines()[0] == rows[0]
    other = tmp_path / "other"
    assert main(resnet18_args(digits, other, "-j", 0, "--epochs", 3, "--resume", out / "checkpoint.pth.tar")) == 0
    assert [json.loads(line)["epoch"] for line in (other / "metrics.jsonl").read_text().splitlines()] == [2]
