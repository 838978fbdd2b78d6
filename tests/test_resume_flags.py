"""A resumed run trains with the optimisation flags of its own command line, not the checkpoint's."""

import json

import pytest
import torch

from imagenet.cli import main
from tests.helpers import digits_fixture, scratch


digits = digits_fixture(4, 1)  # 40 images: 5 steps of 8


def argv(data, out, *extra):
    return [data, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "100",
            "--seed", "0", "--output-dir", str(out), *extra]


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def first_epoch(digits, tmp_path_factory):
    """One epoch at --lr 0.1, momentum 0.9, weight decay 1e-4, step schedule."""
    with scratch(tmp_path_factory, "first") as out:
        assert main(argv(digits, out, "--epochs", "1", "--lr", "0.1")) == 0
        yield out


def resumed(first_epoch, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pth.tar").write_bytes((first_epoch / "checkpoint.pth.tar").read_bytes())
    (out / "metrics.jsonl").write_bytes((first_epoch / "metrics.jsonl").read_bytes())
    return out


def test_resume_with_a_new_lr_momentum_and_weight_decay_trains_with_them(digits, first_epoch, tmp_path, capsys):
    out = resumed(first_epoch, tmp_path)
    capsys.readouterr()
    assert main(argv(digits, out, "--epochs", "2", "--lr", "0.01", "--momentum", "0.5", "--wd", "0",
                     "--resume", "auto")) == 0
    printed = capsys.readouterr().out
    assert [r["lr"] for r in rows(out)] == [0.1, 0.01]
    for line in ("--lr 0.01 replaces the checkpoint's 0.1", "--momentum 0.5 replaces the checkpoint's 0.9",
                 "--weight-decay 0.0 replaces the checkpoint's 0.0001", "--epochs 2 replaces the checkpoint's 1"):
        assert f"=> resume: {line}" in printed, printed
    groups = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["momentum"], g["weight_decay"], g["initial_lr"]) for g in groups] == [(0.5, 0.0, 0.01)]


def test_resume_with_another_schedule_and_length_follows_them(digits, first_epoch, tmp_path, capsys):
    out = resumed(first_epoch, tmp_path)
    assert main(argv(digits, out, "--epochs", "3", "--lr", "0.01", "--lr-schedule", "cosine", "--resume", "auto")) == 0
    assert "=> resume: --lr-schedule cosine replaces the checkpoint's step" in capsys.readouterr().out
    lrs = [r["lr"] for r in rows(out)]
    # cosine over 3 epochs of 5 steps, continued at step 5 of 15 (then 10 of 15)
    assert lrs[0] == 0.1 and lrs[1:] == pytest.approx([0.01 * 0.75, 0.01 * 0.25])


def test_resume_with_the_same_flags_names_no_change(digits, first_epoch, tmp_path, capsys):
    out = resumed(first_epoch, tmp_path)
    assert main(argv(digits, out, "--epochs", "1", "--lr", "0.1", "--resume", "auto")) == 0  # nothing left to train
    assert "=> resume:" not in capsys.readouterr().out


@pytest.mark.parametrize("mode", [["--fp16"], ["--amp"]])
def test_resume_keeps_the_loss_scale_but_takes_the_scale_window_of_its_command_line(mode):
    """The scale itself continues; how many clean steps double it is this run's --scale-window,
    in both modes that scale dynamically (--amp's GradScaler once kept the checkpoint's)."""
    from imagenet.base.config import parse_config
    from imagenet.precision import build_precision

    def window(precision):
        scaler = precision.scaler
        return scaler.get_growth_interval() if hasattr(scaler, "get_growth_interval") else scaler.window

    cpu = torch.device("cpu")
    saved = build_precision(parse_config([*mode, "--scale-window", "1000", "--initial-loss-scale", "1024"]), cpu)
    state = saved.state_dict()
    resumed = build_precision(parse_config([*mode, "--scale-window", "7"]), cpu)
    resumed.load_state_dict(state)
    assert window(resumed) == 7
    assert resumed.loss_scale == 1024.0
