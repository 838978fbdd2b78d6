"""configs/: every recipe loads and validates; FFCV's recipes train at FFCV's sizes, with the lr
of FFCV's global batch."""

from pathlib import Path

import numpy as np
import pytest

from imagenet.base.config import parse_config
from imagenet.data.transforms import image_size_at, progressive_ramp, training_sizes

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
# ffcv-imagenet's rn50_configs/rn50_E_epochs.yaml and rn18_configs/: (start_ramp, end_ramp) per E
FFCV_RAMPS = {16: (11, 13), 24: (17, 20), 32: (23, 27), 40: (29, 34), 56: (41, 48), 88: (65, 76)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_loads_and_names_its_command(path):
    cfg = parse_config(["DIR", "--config", str(path)])
    assert cfg.epochs >= 1
    assert path.read_text().startswith("#"), f"{path.name} needs a header saying what it is and where it comes from"


FFCV = [p for p in CONFIGS if "-ffcv-" in p.name]


def test_ffcvs_recipes_are_here():
    assert sorted(p.name for p in FFCV) == sorted([f"resnet50-ffcv-{e}.yaml" for e in FFCV_RAMPS]
                                                  + ["resnet18-ffcv-16.yaml", "resnet18-ffcv-88.yaml"])


@pytest.mark.parametrize("path", FFCV, ids=lambda p: p.name)
def test_ffcvs_recipes_ramp_from_160_to_192_as_ffcv_does(path):
    cfg = parse_config(["DIR", "--config", str(path)])
    first, last = FFCV_RAMPS[cfg.epochs]
    assert progressive_ramp(cfg) == (first, last) and training_sizes(cfg) == [160, 192]

    def ffcv(epoch):  # train_imagenet.py's get_resolution
        if epoch <= first:
            return 160
        if epoch >= last:
            return 192
        return int(np.round(np.interp([epoch], [first, last], [160, 192])[0] / 32)) * 32
    assert [image_size_at(e, cfg) for e in range(cfg.epochs)] == [ffcv(e) for e in range(cfg.epochs)]
    assert "ffcv-imagenet" in path.read_text().splitlines()[1] + path.read_text().splitlines()[0]


@pytest.mark.parametrize("path", FFCV, ids=lambda p: p.name)
def test_the_lr_is_ffcvs_for_ffcvs_global_batch(path):
    """-b is global: FFCV's ResNet-50 runs 4,096 (512 per GPU, 8 GPUs) at 1.7, its ResNet-18 1,024 at 0.5;
    one GPU reaches 4,096 in passes of 512, FFCV's per-GPU batch (and BatchNorm's)."""
    cfg = parse_config(["DIR", "--config", str(path)])
    peak = {"resnet50": (4096, 1.7), "resnet18": (1024, 0.5)}[cfg.arch]
    assert (cfg.batch_size, cfg.lr) == peak
    assert cfg.batch_size // cfg.accum_steps in (512, 1024)
    assert (cfg.lr_schedule, cfg.warmup_epochs, cfg.lr_end, cfg.label_smoothing) == ("triangular", 2, 0, 0.1)
    assert not cfg.blurpool and cfg.val_flip and (cfg.val_crop, cfg.image_size) == (256, 192)
