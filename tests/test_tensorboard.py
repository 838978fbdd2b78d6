"""--tensorboard: the metrics.jsonl numbers as TensorBoard scalars; a clear error without the package."""

import json
import sys

import pytest

from imagenet.cli import main
from tests.helpers import tiny_run_args


def test_epoch_metrics_become_scalars(digits, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(tiny_run_args(digits, tmp_path, "--epochs", "2", "--tensorboard")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"val/val_acc1", "train/train_loss", "lr/lr", "speed/img_per_s"} <= tags
    assert not any(t.endswith(("/precision", "/mode")) for t in tags)  # strings are not scalars
    acc = events.Scalars("val/val_acc1")
    assert [e.step for e in acc] == [0, 1]
    assert [e.value for e in acc] == pytest.approx([r["val_acc1"] for r in rows])


def test_missing_package_is_a_flag_error_before_training(digits, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "1", "--tensorboard")) == 2
    err = capsys.readouterr().err
    assert "pip install tensorboard" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()
