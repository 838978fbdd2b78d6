"""BatchNorm running statistics that an overflowing forward pass made NaN/inf: validation says so.

torch's BatchNorm folds a batch's statistics into its running ones even when the forward pass
overflowed and the step was skipped (pytorch/pytorch#88474), and NaN stays NaN: every later
validation is NaN while the training loss looks fine. Our kernels leave such a channel's running
statistics as they were (tests/test_fusedbn.py); on torch's path the run says what happened."""

import json

import torch
import torchvision

from imagenet.base.config import parse_config
from imagenet.base.wrappers import unwrap
from imagenet.models.evaluation import nonfinite_statistics


def test_the_layers_with_nan_or_inf_running_statistics_are_named():
    model = torchvision.models.resnet18(num_classes=10)
    assert nonfinite_statistics(model) == []
    with torch.no_grad():
        model.layer1[0].bn1.running_var[3] = float("nan")
        model.layer2[0].downsample[1].running_mean[0] = float("inf")
    assert nonfinite_statistics(model) == ["layer1.0.bn1", "layer2.0.downsample.1"]
    assert nonfinite_statistics(torch.nn.Linear(2, 2)) == []


def test_a_run_whose_running_statistics_went_nan_says_so_before_validating(digits, tmp_path, monkeypatch, capfd):
    from imagenet.training import runner

    real = runner.train_one_epoch

    def overflowing(*, state, **kw):  # as an overflowing forward pass on torch's BatchNorm leaves them
        result = real(state=state, **kw)
        with torch.no_grad():
            unwrap(state.model).layer1[0].bn2.running_var.fill_(float("nan"))
        return result

    monkeypatch.setattr(runner, "train_one_epoch", overflowing)
    runner.run(parse_config([digits, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16",
                             "--val-resize", "16", "--epochs", "1", "--output-dir", str(tmp_path)]))
    out, err = capfd.readouterr()
    warned = [line for line in (out + err).splitlines() if "BatchNorm layer" in line]
    assert len(warned) == 1 and "layer1.0.bn2" in warned[0] and "NaN/inf" in warned[0], warned
    row = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert row["val_loss"] != row["val_loss"]  # NaN: what the warning explains
    monkeypatch.undo()  # evaluating the checkpoint saved after it (NaN statistics and all) says the same
    runner.run(parse_config([digits, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize",
                             "16", "-e", "--resume", str(tmp_path / "checkpoint.pth.tar"),
                             "--output-dir", str(tmp_path / "eval")]))
    out, err = capfd.readouterr()
    assert any("layer1.0.bn2" in line and "NaN/inf" in line for line in (out + err).splitlines()), out + err
