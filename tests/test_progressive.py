"""--progressive-resize: the training crop grows from MIN to --image-size over a ramp of epochs."""

import json

import pytest

from imagenet.base.config import Config, validate
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.decode import TrainDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.samplers import SeededSampler
from imagenet.data.transforms import image_size_at, set_output_size, train_transform
from tests.helpers import tiny_run_args


def cfg(**kw):
    c = Config(**kw)
    validate(c)
    return c


def test_size_ramps_linearly_in_steps_of_8():
    c = cfg(image_size=192, progressive_resize=128, progressive_ramp="2:10", epochs=12)
    sizes = [image_size_at(e, c) for e in range(12)]
    assert sizes[:3] == [128, 128, 128] and sizes[10:] == [192, 192]
    assert all(s % 8 == 0 for s in sizes) and sizes == sorted(sizes)
    assert sizes[6] == 160  # halfway through the ramp, halfway in size


def test_default_ramp_ends_at_three_quarters_and_off_means_fixed():
    c = cfg(image_size=224, progressive_resize=160, epochs=40)
    assert image_size_at(0, c) == 160 and image_size_at(30, c) == 224 and image_size_at(29, c) < 224
    assert {image_size_at(e, cfg(image_size=224, epochs=4)) for e in range(4)} == {224}


@pytest.mark.parametrize("kw, msg", [
    (dict(progressive_resize=224), "below --image-size"),
    (dict(progressive_resize=4), "from 8 px"),
    (dict(progressive_resize=128, progressive_ramp="5:3"), "FIRST < LAST"),
    (dict(progressive_resize=128, progressive_ramp="0:99"), "FIRST < LAST"),
    (dict(progressive_resize=128, progressive_ramp="a:b"), "FIRST:LAST"),
    (dict(progressive_ramp="0:5"), "needs --progressive-resize"),
    (dict(progressive_resize=128, dummy=True), "--dummy"),
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


def test_a_run_records_the_size_of_each_epoch(digits, tmp_path, capsys):
    assert main(tiny_run_args(digits, tmp_path, "--epochs", "3", "--progressive-resize", "8",
                              "--progressive-ramp", "0:2")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["image_size"] for r in rows] == [8, 8, 16]
    assert all(r["val_samples"] == 80 for r in rows)  # validation stays at --image-size
    out = capsys.readouterr().out
    assert "training crops of 8 px" in out and "training crops of 16 px" in out


def test_sizes_never_fall_below_the_starting_size():
    c = cfg(image_size=224, progressive_resize=130, progressive_ramp="0:10", epochs=10)
    sizes = [image_size_at(e, c) for e in range(11)]
    assert min(sizes) == 130 and sizes == sorted(sizes) and sizes[-1] == 224
