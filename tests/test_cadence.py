"""--eval-every, --eval-start and --target-acc (imagenet.training.cadence): which epochs validate,
what a skipped one writes, the run's clock, the stop at a target accuracy, and resumes across both."""

import json
import time

import pytest

from imagenet.base.config import Config, parse_config
from imagenet.cli import main
from imagenet.training import cadence
from imagenet.training.engine import ValResult
from tests.helpers import digits_fixture, interrupt_after_step, last_checkpoint, tiny_run_args, assert_same_run

digits = digits_fixture(2, 1)  # 20 training images: 2 steps an epoch at -b 8
TIMING = ("run_seconds", "seconds_to_target", "img_per_s", "data_wait_frac", "train_seconds", "val_seconds",
          "epoch_seconds")


def rows(out) -> list:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def args(data, out, *extra):
    return tiny_run_args(data, out, "-b", "8", *extra)


def test_mlperfs_cadence_validates_its_epochs_3_7_to_35_and_the_last():
    cfg = Config(epochs=37, eval_every=4, eval_start=2)
    assert [e for e in range(37) if cadence.validates(cfg, e)] == [2, 6, 10, 14, 18, 22, 26, 30, 34, 36]
    assert all(cadence.validates(Config(epochs=5), e) for e in range(5))  # the default: every epoch
    assert cadence.validates(Config(epochs=5, eval_start=3, prof=2), 0)  # --prof's one epoch validates


def test_reaching_the_target_needs_a_validation():
    cfg = Config(target_acc=75.9)
    assert cadence.reached(cfg, 75.9) and not cadence.reached(cfg, 75.89) and not cadence.reached(cfg, None)
    assert not cadence.reached(Config(), 99.0)


def test_a_skipped_epoch_writes_null_validation_and_keeps_the_best(digits, tmp_path):
    assert main(args(digits, tmp_path, "--epochs", "3", "--eval-every", "2", "--eval-start", "1")) == 0
    r = rows(tmp_path)
    assert [x["val_acc1"] is not None for x in r] == [False, True, True]  # epoch 2: the last
    assert all(r[0][k] is None for k in ("val_loss", "val_acc1", "val_acc5", "val_samples"))
    assert r[0]["best_acc1"] == 0.0 and r[1]["best_acc1"] == r[1]["val_acc1"]
    assert 0 < r[0]["run_seconds"] < r[1]["run_seconds"] < r[2]["run_seconds"]
    assert all("seconds_to_target" not in x for x in r)  # no --target-acc
    assert last_checkpoint(tmp_path)["best_acc1"] == max(x["val_acc1"] for x in r[1:])


def fake_validation(monkeypatch, accs: list, seconds: float = 0.0) -> list:
    """Validation answers ``accs`` in turn (a tiny model's accuracy is no fixed target), each after
    ``seconds``; returns the list of calls made."""
    calls = []

    def validate(**kw):
        calls.append(len(calls))
        time.sleep(seconds)
        return ValResult(loss=1.0, acc1=accs[len(calls) - 1], acc5=100.0, samples=10, skipped_paths=[])
    monkeypatch.setattr("imagenet.training.runner.validate", validate)
    return calls


def test_the_run_stops_after_the_validation_that_reaches_the_target(digits, tmp_path, monkeypatch, capsys):
    calls = fake_validation(monkeypatch, [29.9, 30.0, 50.0])
    argv = args(digits, tmp_path, "--epochs", "7", "--eval-every", "2", "--target-acc", "30")
    assert main(argv) == 0
    r = rows(tmp_path)
    assert [x["epoch"] for x in r] == [0, 1, 2] and len(calls) == 2  # validated 0 and 2: stop after 2
    assert [x.get("seconds_to_target") for x in r] == [None, None, r[2]["run_seconds"]]
    assert r[2]["val_acc1"] == 30.0 and last_checkpoint(tmp_path)["epoch"] == 3
    out = capsys.readouterr().out
    assert f"--target-acc 30 reached after epoch 2 (3 counted from 1), {r[2]['run_seconds']:.1f} s" in out
    # the same command again: the checkpoint already reached the target, so nothing trains
    assert main([*argv, "--resume", "auto"]) == 0
    assert "nothing left to train: the run reached --target-acc 30" in capsys.readouterr().out
    assert len(rows(tmp_path)) == 3


def test_a_target_never_reached_says_so(digits, tmp_path, monkeypatch, capsys):
    fake_validation(monkeypatch, [10.0, 20.0])
    assert main(args(digits, tmp_path, "--epochs", "2", "--target-acc", "30")) == 0
    assert "--target-acc 30 not reached" in capsys.readouterr().out
    assert all("seconds_to_target" not in x for x in rows(tmp_path))


def test_a_resume_across_a_skipped_validation_continues_exactly(digits, tmp_path, monkeypatch):
    straight, split = tmp_path / "straight", tmp_path / "split"
    cadence_flags = ("--epochs", "2", "--eval-start", "1")  # validates epoch 1 only
    assert main(args(digits, straight, *cadence_flags)) == 0
    interrupt_after_step(monkeypatch, 1, epoch=1)  # killed in epoch 1, after epoch 0's (unvalidated) checkpoint
    assert main(args(digits, split, *cadence_flags)) == 130
    carried = last_checkpoint(split)["run_seconds"]
    assert last_checkpoint(split)["epoch"] == 1 and carried > 0
    assert not (split / "model_best.pth.tar").exists()  # epoch 0 was not validated: no best model yet
    monkeypatch.undo()
    assert main(args(digits, split, *cadence_flags, "--resume", "auto")) == 0
    assert_same_run(last_checkpoint(straight), last_checkpoint(split))
    a, b = rows(straight), rows(split)
    assert [{k: v for k, v in x.items() if k not in TIMING} for x in a] == \
        [{k: v for k, v in x.items() if k not in TIMING} for x in b]
    assert b[0]["val_acc1"] is None and b[1]["run_seconds"] > carried  # the clock goes on from the checkpoint's


@pytest.mark.parametrize("flags, needle", [
    (["--eval-every", "0"], "--eval-every is a number of epochs, at least 1"),
    (["--eval-start", "-1"], "--eval-start is a 0-based epoch"),
    (["--target-acc", "0.759"], "--target-acc is a percentage of validation Acc@1 above 1"),
])
def test_bad_cadence_flags_are_one_line_errors(flags, needle, capsys):
    assert main(["DIR", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_the_flags_are_yaml_keys_too(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("eval-every: 4\neval-start: 2\ntarget-acc: 75.9\noptimizer: lars\nlars-eta: 0.001\n")
    cfg = parse_config(["--config", str(path)])
    assert (cfg.eval_every, cfg.eval_start, cfg.target_acc, cfg.optimizer) == (4, 2, 75.9, "lars")


def test_the_mlperf_recipe_is_nvidias_8_gpu_run():
    from pathlib import Path
    recipe = Path(__file__).resolve().parents[1] / "configs" / "resnet50-mlperf.yaml"
    cfg = parse_config(["DIR", "--config", str(recipe)])
    assert (cfg.batch_size, cfg.lr, cfg.optimizer, cfg.lars_eta, cfg.weight_decay, cfg.momentum) == \
        (3200, 11.0, "lars", 0.001, 5e-5, 0.9)
    assert (cfg.lr_schedule, cfg.lr_poly_power, cfg.lr_end, cfg.lr_decay_epochs, cfg.warmup_epochs) == \
        ("poly", 2.0, 1e-4, 37, 2)
    assert [e + 1 for e in range(cfg.epochs) if cadence.validates(cfg, e)] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 37]
    assert cfg.target_acc == 75.9 and cfg.label_smoothing == 0.1 and cfg.fp16


def test_a_resume_after_an_epochs_last_step_counts_its_validation_on_the_clock(digits, tmp_path, monkeypatch):
    """A checkpoint after an epoch's last step (--save-every-steps) trains nothing of that epoch on
    resume: the run's clock must still run through the epoch's validation, where MLPerf's stops."""
    interrupt_after_step(monkeypatch, 2, epoch=0)  # killed right after epoch 0's last step was saved
    assert main(args(digits, tmp_path, "--epochs", "1", "--save-every-steps", "2")) == 130
    carried = last_checkpoint(tmp_path)["run_seconds"]
    monkeypatch.undo()
    fake_validation(monkeypatch, [50.0], seconds=0.05)
    assert main(args(digits, tmp_path, "--epochs", "1", "--resume", "auto")) == 0
    assert rows(tmp_path)[-1]["run_seconds"] >= carried + 0.05


def test_start_epoch_keeps_the_runs_clock(digits, tmp_path):
    from imagenet.base.checkpoint import atomic_save
    assert main(args(digits, tmp_path, "--epochs", "1")) == 0
    ckpt = last_checkpoint(tmp_path)
    atomic_save(dict(ckpt, run_seconds=1000.0), str(tmp_path / "checkpoint.pth.tar"))  # a long run's reading
    assert main(args(digits, tmp_path, "--epochs", "2", "--start-epoch", "1", "--resume", "auto")) == 0
    assert rows(tmp_path)[-1]["run_seconds"] > 1000.0
