"""Checkpoints that survive the fault: the one before the latest is kept, and a latest one that cannot
be read back (truncated, corrupt) gives way to it, with a warning naming both."""

import logging
import os
from pathlib import Path

import pytest
import torch

from imagenet.base import checkpoint as ckpt_io
from imagenet.base.errors import UserError
from imagenet.cli import main
from tests.helpers import digits_fixture

CKPT, PREV = ckpt_io.CHECKPOINT, ckpt_io.PREVIOUS


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def leftovers(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith(".tmp-"))


def state(epoch):
    return {"epoch": epoch, "weights": torch.full((64, 64), float(epoch))}


@pytest.fixture
def two_saves(tmp_path):
    for epoch in (1, 2):
        ckpt_io.save_checkpoint(state(epoch), str(tmp_path), is_best=False)
    return tmp_path


def truncate(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:len(data) // 2])


def flip_a_byte(path):
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor's record: torch.load would not notice
    Path(path).write_bytes(bytes(data))


def test_each_save_keeps_the_one_before(two_saves):
    assert load(two_saves / CKPT)["epoch"] == 2 and load(two_saves / PREV)["epoch"] == 1
    assert leftovers(two_saves) == []
    ckpt_io.save_checkpoint(state(3), str(two_saves), is_best=False)
    assert load(two_saves / CKPT)["epoch"] == 3 and load(two_saves / PREV)["epoch"] == 2


def test_without_hard_links_the_previous_one_is_copied(two_saves, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(ckpt_io.os, "link", no_links)
    ckpt_io.save_checkpoint(state(3), str(two_saves), is_best=False)
    assert load(two_saves / CKPT)["epoch"] == 3 and load(two_saves / PREV)["epoch"] == 2
    assert leftovers(two_saves) == []


def test_a_crash_in_the_middle_of_a_write_costs_neither_checkpoint(two_saves, monkeypatch):
    def crash(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + b"\0" * 4096)  # the start of a zip, then death
        raise KeyboardInterrupt
    monkeypatch.setattr(ckpt_io.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt_io.save_checkpoint(state(3), str(two_saves), is_best=False)
    monkeypatch.undo()
    assert load(two_saves / CKPT)["epoch"] == 2 and load(two_saves / PREV)["epoch"] == 1
    assert leftovers(two_saves) == []
    assert ckpt_io.resolve_resume("auto", str(two_saves)) == str(two_saves / CKPT)


@pytest.mark.parametrize("damage, reason", [(truncate, "truncated"), (flip_a_byte, "CRC")])
def test_resume_auto_falls_back_from_a_damaged_latest_checkpoint(two_saves, caplog, damage, reason):
    damage(two_saves / CKPT)
    with caplog.at_level(logging.WARNING, logger="imagenet"):
        assert ckpt_io.resolve_resume("auto", str(two_saves)) == str(two_saves / PREV)
    warning = caplog.text
    assert str(two_saves / CKPT) in warning and str(two_saves / PREV) in warning and reason in warning
    assert "falls back" in warning


def test_no_intact_checkpoint_is_a_user_error_naming_both(two_saves):
    truncate(two_saves / CKPT)
    flip_a_byte(two_saves / PREV)
    with pytest.raises(UserError) as e:
        ckpt_io.resolve_resume("auto", str(two_saves))
    assert str(two_saves / CKPT) in str(e.value) and str(two_saves / PREV) in str(e.value)
    assert "move the damaged" in str(e.value)


def test_a_removed_latest_checkpoint_means_start_fresh(two_saves):
    os.unlink(two_saves / CKPT)  # what a user does to start over: the previous one is not taken
    assert ckpt_io.resolve_resume("auto", str(two_saves)) is None


def test_a_restarted_process_resumes_without_resume(two_saves, tmp_path_factory, caplog):
    with caplog.at_level(logging.WARNING, logger="imagenet"):
        assert ckpt_io.resolve_resume("", str(two_saves), restarted=True) == str(two_saves / CKPT)
    assert "restarted after a failure" in caplog.text and str(two_saves / CKPT) in caplog.text
    # the output dir's progress wins over the --resume PATH the run was started from ...
    start = tmp_path_factory.mktemp("start")
    ckpt_io.save_checkpoint(state(0), str(start), is_best=False)
    assert ckpt_io.resolve_resume(str(start / CKPT), str(two_saves), restarted=True) == str(two_saves / CKPT)
    # ... which counts while the output dir has none yet; with neither, the run starts over
    empty = tmp_path_factory.mktemp("empty")
    assert ckpt_io.resolve_resume(str(start / CKPT), str(empty), restarted=True) == str(start / CKPT)
    assert ckpt_io.resolve_resume("", str(empty), restarted=True) is None
    truncate(two_saves / CKPT)
    assert ckpt_io.resolve_resume("auto", str(two_saves), restarted=True) == str(two_saves / PREV)


digits = digits_fixture(4, 1)  # 40 training images: 5 steps of 8


def test_a_truncated_latest_checkpoint_resumes_the_run_from_the_previous_one(digits, tmp_path, capsys):
    run = [digits, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "100",
           "--seed", "0", "--epochs", "1", "--save-every-steps", "2", "--output-dir", str(tmp_path)]
    assert main(run) == 0  # one epoch: saves after steps 2 and 4, and at the epoch's end
    assert (load(tmp_path / PREV)["epoch"], load(tmp_path / PREV)["step_in_epoch"]) == (0, 4)
    truncate(tmp_path / CKPT)
    capsys.readouterr()
    assert main(run + ["--resume", "auto"]) == 0  # the last step of epoch 0 again
    out = capsys.readouterr().out
    assert f"{tmp_path / CKPT} cannot be read" in out and f"falls back to the checkpoint before it, {tmp_path / PREV}" in out
    assert "continuing at epoch 0, step 4" in out
    assert load(tmp_path / CKPT)["epoch"] == 1
