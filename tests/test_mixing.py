"""Mixup / CutMix: images and soft labels are mixed by the same fraction; the trainer runs with them."""

import json

import pytest
import torch

from imagenet.cli import main
from imagenet.data.mixing import BatchMixer


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 16, 16, generator=g), torch.tensor([0, 1, 2, 3])


def test_mixup_blends_images_and_labels_by_the_same_lam():
    images, targets = batch()
    torch.manual_seed(1)
    mixed, soft = BatchMixer(5, mixup=0.4)(images, targets)
    lam = soft[0, 0].item()  # row 0 mixes class 0 (weight lam) with class 3 (1 - lam)
    assert soft[0, 3].item() == pytest.approx(1 - lam)
    torch.testing.assert_close(mixed[0], lam * images[0] + (1 - lam) * images[3])
    assert torch.allclose(soft.sum(1), torch.ones(4))


def test_cutmix_label_weight_is_the_pasted_area():
    images, targets = batch()
    torch.manual_seed(2)
    mixed, soft = BatchMixer(5, cutmix=1.0)(images, targets)
    from_partner = (mixed[0] == images[3]).all(0) & (mixed[0] != images[0]).any(0)
    lam = soft[0, 0].item()
    assert from_partner.float().mean().item() == pytest.approx(1 - lam, abs=1e-6)


def test_label_smoothing_is_folded_into_the_soft_labels():
    images, targets = batch()
    torch.manual_seed(3)
    _, soft = BatchMixer(4, mixup=0.2, label_smoothing=0.2)(images, targets)
    assert torch.allclose(soft.sum(1), torch.ones(4))
    assert soft.min().item() >= 0.2 / 4 - 1e-6


def test_trainer_runs_with_mixup_and_cutmix(digits, tmp_path):
    assert main([digits, "-a", "resnet18", "-b", "16", "-j", "0", "--image-size", "16", "--val-resize", "16",
                 "--epochs", "1", "--mixup", "0.2", "--cutmix", "1.0", "--label-smoothing", "0.1",
                 "--output-dir", str(tmp_path)]) == 0
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["train_samples"] == 80 and row["train_loss"] == row["train_loss"]  # finite


def test_negative_mixup_is_refused(capsys):
    assert main(["--mixup", "-1"]) == 2
    assert "--mixup" in capsys.readouterr().err
