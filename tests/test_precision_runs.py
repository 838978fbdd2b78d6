"""Precision modes through the whole trainer: fp16 checkpoints, exact resume, switching modes, NaN stop."""

import dataclasses
import json
import shutil

import pytest
import torch
import torchvision

from imagenet.base.config import parse_config
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.precision import LossScaler, MasterWeightPrecision, build_precision
from tests.helpers import batches, fp16_run_args, last_checkpoint, scratch, small_net, tiny_run_args, train_steps


@pytest.fixture(scope="module")
def fp16_epoch(fp16_digits, tmp_path_factory):
    """The output folder of one fp16 epoch, trained once for the tests that start from it; they
    resume in a copy (:func:`copy_of`)."""
    with scratch(tmp_path_factory, "fp16_epoch") as out:
        assert main(fp16_run_args(fp16_digits, out, "--epochs", "1")) == 0
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert rows[0]["skipped_steps"] == 1 and rows[0]["steps"] == 3, rows  # fp16_run_args: one skipped, two taken
        yield out


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def test_fp16_checkpoint_holds_fp32_masters_loadable_by_torchvision(fp16_epoch):
    ckpt = last_checkpoint(fp16_epoch)
    state = ckpt["state_dict"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    torchvision.models.resnet18(num_classes=10).load_state_dict(state)  # strict
    assert ckpt["precision"]["mode"] == "fp16" and ckpt["precision"]["scaler"]["scale"] > 0
    # the masters are not the fp16 copy: some values are not representable in fp16
    w = state["layer1.0.conv1.weight"]
    assert not torch.equal(w, w.half().float())


def test_fp16_resume_continues_bit_exactly(fp16_digits, fp16_epoch, tmp_path):
    straight, first = tmp_path / "straight", copy_of(fp16_epoch, tmp_path)
    assert main(fp16_run_args(fp16_digits, straight, "--epochs", "2")) == 0
    assert main(fp16_run_args(fp16_digits, first, "--epochs", "2", "--resume", "auto")) == 0
    a, b = last_checkpoint(straight), last_checkpoint(first)
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert a["precision"] == b["precision"]
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])


# (autocast float16 on a CPU runs fp16 convolutions at a crawl: the CPU tests use bfloat16)
@pytest.mark.parametrize("then", [[], ["--amp", "--amp-dtype", "bfloat16"]])
def test_switching_precision_between_save_and_resume(fp16_digits, fp16_epoch, tmp_path, then):
    run = copy_of(fp16_epoch, tmp_path)
    saved = last_checkpoint(run)
    assert main(tiny_run_args(fp16_digits, run, "-b", "8", "--epochs", "2", "--resume", "auto", *then)) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[1]["precision"] == (then and ("amp-bf16" if "bfloat16" in then else "amp-fp16") or "fp32")
    resumed = last_checkpoint(run)
    assert not torch.equal(resumed["state_dict"]["fc.weight"], saved["state_dict"]["fc.weight"])


def test_fp32_checkpoint_resumes_in_fp16_with_exact_masters(fp16_digits, tmp_path, monkeypatch):
    assert main(tiny_run_args(fp16_digits, tmp_path, "-b", "8", "--epochs", "1")) == 0
    saved = last_checkpoint(tmp_path)["state_dict"]
    seen = {}
    from imagenet import precision as prec_mod
    real = prec_mod.MasterWeightPrecision.load_model_state_dict

    def spy(self, model, state):
        real(self, model, state)
        seen.update({n: m.detach().clone() for n, m in zip(self.names, self.masters)})
    monkeypatch.setattr(prec_mod.MasterWeightPrecision, "load_model_state_dict", spy)
    assert main(fp16_run_args(fp16_digits, tmp_path, "--epochs", "2", "--resume", "auto")) == 0
    assert seen and all(torch.equal(seen[n], saved[n]) for n in seen)


def test_persistent_nan_loss_stops_with_a_clear_error(digits, tmp_path, capsys):
    # A learning rate of 1e30 sends the weights to inf on the first step; every loss after is NaN.
    code = main(tiny_run_args(digits, tmp_path, "--epochs", "3", "--lr", "1e30", "--max-nonfinite-steps", "3",
                              "-p", "1"))
    err = capsys.readouterr().err
    assert code == 2
    assert "NaN/inf" in err and "--max-nonfinite-steps" in err and "Traceback" not in err


def test_nan_check_can_be_disabled(digits, tmp_path):
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "1", "--lr", "1e30", "--max-nonfinite-steps", "0")) == 0


def test_bf16_on_a_gpu_without_support_is_a_clear_error(monkeypatch):
    cfg = parse_config(["--amp", "--amp-dtype", "bfloat16"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(UserError, match="bfloat16.*V100.*float16"):
        build_precision(cfg, torch.device("cuda", 0))


@pytest.mark.parametrize("flags", [["--fp16", "--loss-scale", "0"], ["--fp16", "--loss-scale", "abc"],
                                   ["--fp16", "--loss-scale", "-8"], ["--fp16", "--amp"],
                                   ["--amp", "--amp-dtype", "float8"], ["--loss-scale", "128"],
                                   ["--amp", "--loss-scale", "128"], ["--clip-grad-norm", "0"],
                                   ["--clip-grad-norm", "inf"]])
def test_bad_precision_flags_exit_2(flags, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_master_step_foreach_and_loop_agree():
    fast = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    slow = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False), foreach=False)
    train_steps(fast, small_net(), batches(3))
    train_steps(slow, small_net(), batches(3))
    assert all(torch.equal(a, b) for a, b in zip(fast.masters, slow.masters))


def test_evaluate_without_weights_is_refused(digits, tmp_path, capsys):
    assert main(tiny_run_args(digits, tmp_path, "-e")) == 2
    assert "--evaluate needs weights" in capsys.readouterr().err


def test_start_epoch_moves_the_schedule_and_config_yaml_round_trips(digits, tmp_path):
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "3", "--lr-schedule", "step", "--lr-step", "1",
                              "--start-epoch", "2")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [2]
    assert rows[0]["lr"] == pytest.approx(0.02 * 0.1 ** 2)  # the schedule at epoch 2, not at 0
    again = parse_config(["--config", str(tmp_path / "config.yaml")])
    assert dataclasses.replace(again, config=None) == parse_config(tiny_run_args(
        digits, tmp_path, "--epochs", "3", "--lr-schedule", "step", "--lr-step", "1", "--start-epoch", "2"))


@pytest.mark.parametrize("pipeline", ["fast", "classic"])
def test_augmentation_recipe_flags_train(digits, tmp_path, pipeline):
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "1", "--auto-augment", "trivialaugment", "--random-erase",
                              "0.25", "--label-smoothing", "0.1", "--data-pipeline", pipeline, "-j", "2")) == 0
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["train_samples"] == 80 and row["val_samples"] == 80


@pytest.mark.parametrize("mode,warns", [(["--fp16"], "--fp16"), (["--amp"], "--amp float16"),
                                        (["--amp", "--amp-dtype", "bfloat16"], None)])
def test_half_precision_on_a_cpu_is_named_as_slow_with_the_bf16_alternative(fp16_digits, tmp_path, capsys, mode,
                                                                             warns):
    assert main(tiny_run_args(fp16_digits, tmp_path, "-b", "8", "--epochs", "1", "--prof", "1", *mode)) == 0
    out = capsys.readouterr().out
    if warns:
        assert f"{warns} on a CPU runs about 36x slower than fp32" in out, out
        assert "--amp --amp-dtype bfloat16" in out
    else:
        assert "slower than fp32" not in out
