"""Mixup / CutMix: images and soft labels are mixed by the same fraction; the trainer runs with them."""

import contextlib
import json

import pytest
import torch

from imagenet.cli import main
from imagenet.data.mixing import BatchMixer
from tests.helpers import assert_same_run, digits_fixture, interrupt_after_step, last_checkpoint, resnet18_args, scratch


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 16, 16, generator=g), torch.tensor([0, 1, 2, 3])


def test_mixup_blends_images_and_labels_by_the_same_lam():
    images, targets = batch()
    mixed, soft = BatchMixer(5, mixup=0.4, seed=1)(images, targets, epoch=0, batch=0)
    lam = soft[0, 0].item()  # row 0 mixes class 0 (weight lam) with class 3 (1 - lam)
    assert soft[0, 3].item() == pytest.approx(1 - lam)
    torch.testing.assert_close(mixed[0], lam * images[0] + (1 - lam) * images[3])
    assert torch.allclose(soft.sum(1), torch.ones(4))


def test_cutmix_label_weight_is_the_pasted_area():
    images, targets = batch()
    mixed, soft = BatchMixer(5, cutmix=1.0, seed=2)(images, targets, epoch=0, batch=0)
    from_partner = (mixed[0] == images[3]).all(0) & (mixed[0] != images[0]).any(0)
    lam = soft[0, 0].item()
    assert from_partner.float().mean().item() == pytest.approx(1 - lam, abs=1e-6)


def test_label_smoothing_is_folded_into_the_soft_labels():
    images, targets = batch()
    _, soft = BatchMixer(4, mixup=0.2, label_smoothing=0.2, seed=3)(images, targets, epoch=0, batch=0)
    assert torch.allclose(soft.sum(1), torch.ones(4))
    assert soft.min().item() >= 0.2 / 4 - 1e-6


def test_the_draws_are_a_function_of_seed_rank_epoch_and_batch_alone():
    images, targets = batch()
    mixer = BatchMixer(5, mixup=0.2, cutmix=1.0, seed=7)
    global_rng = torch.get_rng_state()
    first = mixer(images, targets, epoch=1, batch=3)
    assert torch.equal(torch.get_rng_state(), global_rng)  # nothing drawn from the process's RNG
    torch.manual_seed(123)  # nor does its state matter
    assert all(torch.equal(a, b) for a, b in zip(first, mixer(images, targets, epoch=1, batch=3)))
    others = [BatchMixer(5, mixup=0.2, cutmix=1.0, seed=7, rank=1)(images, targets, epoch=1, batch=3),
              mixer(images, targets, epoch=2, batch=3), mixer(images, targets, epoch=1, batch=4)]
    assert all(not torch.equal(first[1], other[1]) for other in others)


def test_trainer_runs_with_mixup_and_cutmix(digits, tmp_path):
    assert main([digits, "-a", "resnet18", "-b", "16", "-j", "0", "--image-size", "16", "--val-resize", "16",
                 "--epochs", "1", "--mixup", "0.2", "--cutmix", "1.0", "--label-smoothing", "0.1",
                 "--output-dir", str(tmp_path)]) == 0
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["train_samples"] == 80 and row["train_loss"] == row["train_loss"]  # finite


def test_negative_mixup_is_refused(capsys):
    assert main(["--mixup", "-1"]) == 2
    assert "--mixup" in capsys.readouterr().err


# ------------------------------------------------------------------ the draws: workers and resume

few_digits = digits_fixture(4, 1)  # 40 training images: 5 steps of 8


def mixing_args(data, out, workers, *extra):
    return resnet18_args(data, out, "-j", workers, "--epochs", 1, "--mixup", 0.2, "--cutmix", 1.0, *extra)


@contextlib.contextmanager
def recorded_draws():
    """Every batch the mixer makes in this process: (soft labels, mixed images)."""
    draws, real = [], BatchMixer.__call__

    def spy(self, *a, **k):
        images, soft = real(self, *a, **k)
        draws.append((soft.clone(), images.clone()))
        return images, soft
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BatchMixer, "__call__", spy)
        yield draws


@pytest.fixture(scope="module")
def straight_runs(few_digits, tmp_path_factory):
    """One uninterrupted epoch with mixup and cutmix at -j 0 and at -j 2: (its checkpoint, its draws)."""
    with scratch(tmp_path_factory, "j0", "j2") as folders:
        runs = {}
        for workers, out in zip((0, 2), folders):
            with recorded_draws() as draws:
                assert main(mixing_args(few_digits, out, workers)) == 0
            runs[workers] = (last_checkpoint(out), draws)
        yield runs


def test_mixing_draws_the_same_with_and_without_loader_workers(straight_runs):
    """-j 0 loads in the training process, where the per-sample augmentation seeds used to
    reseed the global RNG the mixer drew from; -j 2 loads in workers."""
    (ckpt0, draws0), (ckpt2, draws2) = straight_runs[0], straight_runs[2]
    assert len(draws0) == len(draws2) == 5
    for (soft0, mixed0), (soft2, mixed2) in zip(draws0, draws2):
        assert torch.equal(soft0, soft2) and torch.equal(mixed0, mixed2)
    assert_same_run(ckpt0, ckpt2)


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_with_mixing_is_bit_exact(few_digits, straight_runs, tmp_path, monkeypatch, workers):
    """Stopped after the checkpoint at step 3 of 5 (as a kill -9 would), then resumed: the same
    draws and weights as the uninterrupted run. A DataLoader iterator takes a draw from the
    global RNG when it is made, which a resumed run does after restoring that RNG."""
    interrupt_after_step(monkeypatch, 3)
    with recorded_draws() as first:
        assert main(mixing_args(few_digits, tmp_path, workers, "--save-every-steps", 3)) == 130
    assert last_checkpoint(tmp_path)["step_in_epoch"] == 3
    monkeypatch.undo()
    with recorded_draws() as rest:
        assert main(mixing_args(few_digits, tmp_path, workers, "--resume", "auto")) == 0
    straight, draws = straight_runs[workers]
    assert len(first) == 3 and len(rest) == 2
    for (soft, mixed), (soft_s, mixed_s) in zip(first + rest, draws):
        assert torch.equal(soft, soft_s) and torch.equal(mixed, mixed_s)
    assert_same_run(straight, last_checkpoint(tmp_path))
