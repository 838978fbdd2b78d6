"""--progressive-resize: the training crop grows from MIN to --image-size over a ramp of epochs."""

import json

import numpy as np
import pytest

from imagenet.base.config import Config, validate
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.decode import TrainDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.samplers import SeededSampler
from imagenet.data.transforms import image_size_at, set_output_size, train_transform, training_sizes
from tests.helpers import assert_same_run, digits_fixture, interrupt_after_step, last_checkpoint, resnet18_args


def cfg(**kw):
    c = Config(**kw)
    validate(c)
    return c


def test_size_ramps_linearly_in_steps_of_8():
    c = cfg(image_size=192, progressive_resize=128, progressive_ramp="2:10", epochs=12, progressive_step=8)
    sizes = [image_size_at(e, c) for e in range(12)]
    assert sizes[:3] == [128, 128, 128] and sizes[10:] == [192, 192]
    assert all(s % 8 == 0 for s in sizes) and sizes == sorted(sizes)
    assert sizes[6] == 160  # halfway through the ramp, halfway in size


def test_default_ramp_ends_at_three_quarters_and_off_means_fixed():
    c = cfg(image_size=224, progressive_resize=160, epochs=40, progressive_step=8)
    assert image_size_at(0, c) == 160 and image_size_at(30, c) == 224 and image_size_at(28, c) < 224
    assert {image_size_at(e, cfg(image_size=224, epochs=4)) for e in range(4)} == {224}


@pytest.mark.parametrize("kw, msg", [
    (dict(progressive_resize=224), "below --image-size"),
    (dict(progressive_resize=4), "from 8 px"),
    (dict(progressive_resize=128, progressive_ramp="5:3"), "FIRST < LAST"),
    (dict(progressive_resize=128, progressive_ramp="0:99"), "FIRST < LAST"),
    (dict(progressive_resize=128, progressive_ramp="a:b"), "FIRST:LAST"),
    (dict(progressive_ramp="0:5"), "needs --progressive-resize"),
    (dict(progressive_resize=128, progressive_step=0), "--progressive-step"),
])
def test_bad_values_are_refused(kw, msg):
    with pytest.raises(UserError, match=msg):
        validate(Config(image_size=224, epochs=10, **kw))


def test_the_size_travels_with_each_key_to_the_dataset(digits):
    for transform, loader in ((TrainDecoder(32, 0.5, 0.5), path_identity), (train_transform(32, 0.5, 0.5), None)):
        ds = SafeImageFolder(f"{digits}/train", transform, **({"loader": loader} if loader else {}))
        sampler = SeededSampler(ds, 1, 0, seed=0)
        sampler.set_image_size(16)
        key = next(iter(sampler))
        assert len(key) == 3 and key[2] == 16
        image, _, bad = ds[key]
        assert bad is None and sorted(image.shape)[-2:] == [16, 16]
        assert sorted(ds[key[:2] + (32,)][0].shape)[-2:] == [32, 32]


def test_classic_and_fast_transforms_resize():
    t = train_transform(32, 0.5, 0.5)
    set_output_size(t, 24)
    assert t.transforms[0].size == (24, 24)
    d = TrainDecoder(32, 0.5, 0.5)
    set_output_size(d, 24)
    assert d.size == 24


def test_sizes_never_fall_below_the_starting_size():
    c = cfg(image_size=224, progressive_resize=130, progressive_ramp="0:10", epochs=10)
    sizes = [image_size_at(e, c) for e in range(11)]
    assert min(sizes) == 130 and sizes == sorted(sizes) and sizes[-1] == 224


def ffcv_size(epoch: int, min_res: int, max_res: int, start_ramp: int, end_ramp: int) -> int:
    """FFCV's rule (ffcv-imagenet train_imagenet.py, get_resolution), restated."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    return int(np.round(np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0] / 32)) * 32


@pytest.mark.parametrize("lo, hi, epochs, first, last", [
    (160, 192, 16, 11, 13), (160, 192, 88, 65, 76), (160, 192, 24, 17, 20), (128, 224, 30, 3, 27),
    (96, 256, 40, 0, 33), (160, 224, 7, 1, 6)])
def test_step_32_gives_ffcvs_sizes(lo, hi, epochs, first, last):
    """The default step rounds as FFCV does: to the nearest multiple of 32, halves to even (its
    16-epoch ResNet-50: 12 epochs at 160, then 192 from epoch 12, where the line is at 176)."""
    c = cfg(image_size=hi, progressive_resize=lo, progressive_ramp=f"{first}:{last}", epochs=epochs)
    assert [image_size_at(e, c) for e in range(epochs)] == [ffcv_size(e, lo, hi, first, last) for e in range(epochs)]


def test_the_sizes_of_a_run_are_its_compiled_shapes():
    c = cfg(image_size=192, progressive_resize=160, progressive_ramp="11:13", epochs=16)
    assert training_sizes(c) == [160, 192] and [image_size_at(e, c) for e in (11, 12)] == [160, 192]
    assert training_sizes(cfg(image_size=224, epochs=3)) == [224]
    fine = cfg(image_size=224, progressive_resize=128, progressive_ramp="0:12", epochs=16, progressive_step=8)
    assert training_sizes(fine) == list(range(128, 232, 8))  # 13 sizes: 13 compiles


def test_the_synthetic_batch_takes_each_size():
    import torch

    from imagenet.data.synthetic import SyntheticDataset, SyntheticLoader
    loader = SyntheticLoader(SyntheticDataset(16, 4, 24), batch=8, samples=16, drop_last=True,
                             device=torch.device("cpu"), channels_last=False)
    loader.sampler.set_image_size(16)
    images, targets, _ = next(iter(loader))
    assert images.shape == (8, 3, 16, 16) and targets.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


few_digits = digits_fixture(4, 1)  # 40 training images: 5 steps of 8


def ramp_args(data, out, *extra):
    """Two epochs of 5 steps at 8 and 12 px: the second on the ramp to 16 px."""
    return resnet18_args(data, out, "--epochs", 2, "--progressive-resize", 8, "--progressive-step", 4,
                         "--progressive-ramp", "0:2", "-j", 0, *extra)


def test_a_run_resumed_mid_ramp_ends_as_an_uninterrupted_one(few_digits, tmp_path, monkeypatch):
    """Stopped after step 3 of epoch 1 (12 px, on the ramp) and resumed: the same sizes per epoch and
    the same weights, bit for bit, as the run that never stopped."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(ramp_args(few_digits, straight)) == 0
    interrupt_after_step(monkeypatch, 3, epoch=1)
    assert main(ramp_args(few_digits, resumed, "--save-every-steps", 3)) == 130
    assert last_checkpoint(resumed)["epoch"] == 1 and last_checkpoint(resumed)["step_in_epoch"] == 3
    monkeypatch.undo()
    assert main(ramp_args(few_digits, resumed, "--resume", "auto")) == 0
    sizes = [[json.loads(line)["image_size"] for line in open(out / "metrics.jsonl")] for out in (straight, resumed)]
    assert sizes == [[8, 12]] * 2
    assert_same_run(last_checkpoint(straight), last_checkpoint(resumed))
