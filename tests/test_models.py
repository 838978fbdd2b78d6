"""Tests for the architecture registry and starting weights (imagenet/models/registry.py).

CPU only and fast: real forwards run only for the four archs the brief names, on 32x32 inputs;
the 101/152-layer models are built on the ``meta`` device (the same construction code, no
weight memory or random initialisation), which keeps the whole file well under 15 s on 2 cores.
"""

import os
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torchvision

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # no install step: the tests import the package from the checkout
from imagenet.base import wrappers  # noqa: E402
from imagenet.base.config import ARCHS  # noqa: E402
from imagenet.base.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from imagenet.cli import main  # noqa: E402
from imagenet.models import registry as models

FORWARD_ARCHS = ("resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2")
# Tens of millions of parameters each: initialising them for real costs 1-2 s apiece here.
META_ARCHS = ("resnet101", "resnet152", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet101_2")


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------- registry


def test_registry_covers_the_resnet_family():
    assert set(FORWARD_ARCHS) | set(META_ARCHS) | {"resnet34"} == set(ARCHS)
    for arch in ARCHS:
        assert callable(getattr(torchvision.models, arch)), arch


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_constructs_with_num_classes(arch):
    if arch in META_ARCHS:
        with torch.device("meta"):
            model = models.create_model(arch, num_classes=7)
    else:
        model = models.create_model(arch, num_classes=7)
    assert isinstance(model, torchvision.models.ResNet)
    assert model.fc.out_features == 7
    assert model.fc.weight.shape[0] == 7 and model.fc.bias.shape == (7,)
    # Same layout as torchvision's own builder: a checkpoint of one loads into the other.
    with torch.device("meta"):
        reference = getattr(torchvision.models, arch)(weights=None, num_classes=7)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if arch in FORWARD_ARCHS:
        model.eval()
        with torch.no_grad():
            logits = model(torch.randn(1, 3, 32, 32))
        assert logits.shape == (1, 7)
        assert torch.isfinite(logits).all()


def test_unknown_arch_is_a_user_error():
    with pytest.raises(UserError, match="resnet9000.*resnet18"):
        models.create_model("resnet9000", 10)


# ---------------------------------------------------------------------------------- small stem


def test_small_stem():
    torch.manual_seed(0)
    model = models.create_model("resnet18", 7, small_stem=True)
    conv = model.conv1
    assert isinstance(conv, nn.Conv2d)
    assert conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1)
    assert conv.in_channels == 3 and conv.out_channels == 64 and conv.bias is None
    assert isinstance(model.maxpool, nn.Identity)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 16, 16)).shape == (1, 7)
    model.train()  # BatchNorm needs >1 value per channel: 16 px -> 2x2 maps at layer4 with this stem
    out = model(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 7)
    out.sum().backward()
    assert conv.weight.grad is not None and torch.isfinite(conv.weight.grad).all()


def test_small_stem_keeps_the_width_of_wider_models():
    with torch.device("meta"):  # structure only; a bottleneck forward at full resolution is slow here
        model = models.create_model("wide_resnet50_2", 7, small_stem=True)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.out_channels == model.bn1.num_features == 64
    assert isinstance(model.maxpool, nn.Identity)


def test_default_stem_is_torchvisions():
    model = models.create_model("resnet18", 7)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)


# -------------------------------------------------------------------------------- strip_prefix


def test_strip_prefix():
    t = [torch.tensor(float(i)) for i in range(6)]
    out = wrappers.strip_prefix({
        "module.conv1.weight": t[0],
        "_orig_mod.bn1.weight": t[1],
        "module._orig_mod.fc.weight": t[2],
        "_orig_mod.module.fc.bias": t[3],
        "layer1.0.conv1.weight": t[4],
        "layer1.module.weight": t[5],  # only a leading prefix is a wrapper's
    })
    assert list(out) == ["conv1.weight", "bn1.weight", "fc.weight", "fc.bias", "layer1.0.conv1.weight",
                         "layer1.module.weight"]
    for got, want in zip(out.values(), t):
        assert got is want  # values are passed through, not copied


def test_strip_prefix_round_trips_a_wrapped_model():
    model = models.create_model("resnet18", 5)
    wrapped = nn.DataParallel(model)  # keys gain "module." (DataParallel works on CPU too)
    keys = list(wrapped.state_dict())
    assert all(k.startswith("module.") for k in keys)
    assert list(wrappers.strip_prefix(wrapped.state_dict())) == list(model.state_dict())


# --------------------------------------------------------------------------- load_weights_into


def test_load_weights_with_other_class_count_reinitialises_fc_only():
    torch.manual_seed(1)
    source = _state(models.create_model("resnet18", 10))
    torch.manual_seed(2)
    target = models.create_model("resnet18", 7)
    own_fc = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("fc.")}
    models.load_weights_into(target, source, "source.pth")
    after = target.state_dict()
    assert after["fc.weight"].shape == (7, 512)
    for k, v in after.items():
        if k.startswith("fc."):
            assert torch.equal(v, own_fc[k]), k  # kept the fresh classifier
        else:
            assert torch.equal(v, source[k]), k  # everything else came from the file


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_load_weights_accepts_prefixed_keys(prefix):
    torch.manual_seed(3)
    source = _state(models.create_model("resnet18", 10))
    target = models.create_model("resnet18", 10)
    models.load_weights_into(target, {prefix + k: v for k, v in source.items()}, "prefixed.pth")
    for k, v in target.state_dict().items():
        assert torch.equal(v, source[k]), k


def test_load_weights_of_same_class_count_is_exact():
    torch.manual_seed(4)
    source = _state(models.create_model("resnet50", 10))
    target = models.create_model("resnet50", 10)
    models.load_weights_into(target, source, "same.pth")
    for k, v in target.state_dict().items():
        assert torch.equal(v, source[k]), k


@pytest.mark.parametrize("src_arch, dst_arch, match", [
    ("resnet18", "resnet34", r"missing \d+ keys.*layer"),  # deeper model: keys missing
    ("resnet34", "resnet18", r"unexpected \d+ keys"),  # shallower model: keys left over
    ("resnet50", "resnext50_32x4d", r"layer1\.0\.conv\d\.weight has shape"),  # same keys, grouped convs
])
def test_load_weights_of_another_arch_is_a_user_error(src_arch, dst_arch, match):
    with torch.device("meta"):
        source = models.create_model(src_arch, 10).state_dict()
    target = models.create_model(dst_arch, 10)
    before = _state(target)
    with pytest.raises(UserError, match=match) as info:
        models.load_weights_into(target, source, "other.pth")
    assert "other.pth" in str(info.value) and "--arch" in str(info.value)
    for k, v in target.state_dict().items():  # nothing was half-loaded
        assert torch.equal(v, before[k]), k


def test_load_weights_small_stem_mismatch_is_a_user_error():
    source = _state(models.create_model("resnet18", 10, small_stem=False))
    target = models.create_model("resnet18", 10, small_stem=True)
    with pytest.raises(UserError, match=r"conv1\.weight.*--small-stem"):
        models.load_weights_into(target, source, "stem.pth")


def test_load_weights_without_num_batches_tracked():
    torch.manual_seed(5)
    source = {k: v for k, v in _state(models.create_model("resnet18", 10)).items()
              if not k.endswith("num_batches_tracked")}
    reference = models.create_model("resnet18", 10)
    reference.load_state_dict(source)  # torch itself accepts such a file
    target = models.create_model("resnet18", 10)
    models.load_weights_into(target, source, "old.pth")
    for k, v in source.items():
        assert torch.equal(target.state_dict()[k], v), k


# ---------------------------------------------------------------------------------- pretrained


@pytest.fixture
def empty_torch_home(tmp_path, monkeypatch):
    """TORCH_HOME pointing at an empty folder, and any download attempt turned into a failure."""
    home = tmp_path / "torch_home"
    home.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # in case anything called torch.hub.set_dir

    def no_network(*args, **kwargs):
        raise AssertionError(f"the trainer tried to download: {args[:1]}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_network)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    return home


def _expected_weights_path(home: Path, arch: str) -> Path:
    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    return home / "hub" / "checkpoints" / os.path.basename(url)


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_pretrained_with_empty_cache_names_the_file_and_never_downloads(empty_torch_home, arch):
    expected = _expected_weights_path(empty_torch_home, arch)
    with pytest.raises(UserError) as info:
        models.pretrained_state_dict(models.pretrained_weights(arch))
    msg = str(info.value)
    assert str(expected) in msg
    assert "never downloads" in msg and "--weights" in msg
    assert not expected.exists()
    assert list(empty_torch_home.rglob("*")) == []  # not even a partial download folder


DUMMY = ["--dummy", "--dummy-train-size", "8", "--dummy-val-size", "8", "--dummy-classes", "7",
         "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "1",
         "--seed", "0"]


def test_pretrained_flag_with_empty_cache_exits_2(empty_torch_home, tmp_path, capsys):
    rc = main(DUMMY + ["--pretrained", "--epochs", "1", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == EXIT_USER_ERROR
    assert err.startswith("error: ") and err.count("\n") == 1  # one line, no traceback
    assert str(_expected_weights_path(empty_torch_home, "resnet18")) in err
    assert "never downloads" in err
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


def test_pretrained_flag_uses_the_cached_file(empty_torch_home, tmp_path, capsys):
    path = _expected_weights_path(empty_torch_home, "resnet18")
    path.parent.mkdir(parents=True)
    torch.manual_seed(6)
    imagenet_like = _state(torchvision.models.resnet18(num_classes=1000))
    torch.save(imagenet_like, path)
    assert models.pretrained_state_dict(models.pretrained_weights("resnet18")).keys() == imagenet_like.keys()
    # 1000 ImageNet classes -> 7 dummy classes: the backbone loads, the classifier starts fresh.
    rc = main(DUMMY + ["--pretrained", "-e", "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert " * Acc@1 " in out


def test_pretrained_unreadable_cache_file_is_a_user_error(empty_torch_home):
    path = _expected_weights_path(empty_torch_home, "resnet18")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"<html>captive portal</html>")
    with pytest.raises(UserError, match="could not be read"):
        models.pretrained_state_dict(models.pretrained_weights("resnet18"))


# ----------------------------------------------------- --pretrained NAME and its evaluation geometry


@pytest.fixture(scope="module")
def resnet50_hub(tmp_path_factory):
    """A torch hub cache holding ResNet-50 weights (random, of the right shapes) under the file
    names of torchvision's IMAGENET1K_V1 and V2 URLs, and a tiny ImageFolder."""
    from tests.helpers import make_digits, scratch
    with scratch(tmp_path_factory, "torch_home", "digits") as (home, data):  # 100 MB of weights
        folder = home / "hub" / "checkpoints"
        folder.mkdir(parents=True)
        torch.manual_seed(3)
        state = _state(torchvision.models.resnet50(num_classes=1000))
        weights = torchvision.models.ResNet50_Weights
        first = folder / os.path.basename(weights.IMAGENET1K_V2.url)
        torch.save(state, first)
        os.link(first, folder / os.path.basename(weights.IMAGENET1K_V1.url))
        make_digits(data, train_per_class=1, val_per_class=1)
        yield home, str(data)


def _evaluate_pretrained(hub, tmp_path, monkeypatch, capsys, *flags, data_first=True):
    home, data = hub
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    common = ["-a", "resnet50", "-b", "10", "-j", "0", "--output-dir", str(tmp_path), *flags]
    rc = main(([data] + common) if data_first else common + [data])
    out, err = capsys.readouterr()
    return rc, out, err


def test_pretrained_evaluates_at_the_weights_own_resize_and_crop(resnet50_hub, tmp_path, monkeypatch, capsys):
    # DEFAULT is IMAGENET1K_V2 (published 80.858% at resize 232 / crop 224), not the classic 256.
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained")
    assert rc == 0, err
    assert "val 224 px of 232 (IMAGENET1K_V2's own evaluation resize" in out, out
    assert "from torchvision's IMAGENET1K_V2 weights (80.858% ImageNet Acc@1 published)" in out
    assert " * Acc@1 " in out


def test_pretrained_by_name_and_the_flags_override_its_geometry(resnet50_hub, tmp_path, monkeypatch, capsys):
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained",
                                        "IMAGENET1K_V1")
    assert rc == 0, err
    assert "val 224 px of 256 (IMAGENET1K_V1's own evaluation resize" in out, out
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained",
                                        "--val-resize", "240")
    assert rc == 0, err
    assert "val 224 px of 240\n" in out, out
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained",
                                        "--image-size", "112")
    assert rc == 0, err
    assert "val 112 px of 116 (IMAGENET1K_V2's evaluation ratio 232/224 at this crop" in out, out


def test_pretrained_before_the_dataset_folder_still_means_default_weights(resnet50_hub, tmp_path, monkeypatch,
                                                                          capsys):
    # The classic script's `main.py -a resnet50 -e --pretrained DIR`: DIR is the dataset.
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained",
                                        data_first=False)
    assert rc == 0, err
    assert "IMAGENET1K_V2's own evaluation resize" in out


def test_unknown_pretrained_name_lists_the_valid_ones(resnet50_hub, tmp_path, monkeypatch, capsys):
    rc, out, err = _evaluate_pretrained(resnet50_hub, tmp_path, monkeypatch, capsys, "-e", "--pretrained",
                                        "IMAGENET1K_V9")
    assert rc == EXIT_USER_ERROR
    assert err.count("\n") == 1 and "IMAGENET1K_V1, IMAGENET1K_V2, or DEFAULT (IMAGENET1K_V2)" in err, err


def test_pretrained_yaml_key_takes_a_bool_or_a_name(tmp_path):
    from imagenet.base.config import parse_config
    for value, expected in (("true", "DEFAULT"), ("false", None), ("IMAGENET1K_V1", "IMAGENET1K_V1")):
        (tmp_path / "r.yaml").write_text(f"pretrained: {value}\n")
        assert parse_config(["--config", str(tmp_path / "r.yaml")]).pretrained == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_every_pretrained_weight_set_evaluates_bilinear_antialiased(arch):
    """The validation pipelines resize bilinearly with antialiasing (PIL's filter), and the
    default crop is 224: every weight set's evaluation transform does the same, so its resize is
    the one number to follow."""
    from torchvision.transforms import InterpolationMode
    for weights in torchvision.models.get_model_weights(arch):
        preset = weights.transforms()
        assert preset.interpolation == InterpolationMode.BILINEAR and preset.antialias, weights
        assert preset.crop_size == [224], weights
        resolved = models.pretrained_weights(arch, weights.name)
        assert (resolved.resize, resolved.crop) == (preset.resize_size[0], preset.crop_size[0])


# ----------------------------------------------------------------------------------- padded stem


def test_the_stem_convolution_is_padded_and_keeps_its_state_dict():
    from imagenet.models import stem
    model = models.create_model("resnet18", num_classes=5)
    assert type(model.conv1) is stem.PaddedStemConv and model.conv1.weight.shape == (64, 3, 7, 7)
    assert list(model.state_dict()) == list(torchvision.models.resnet18(num_classes=5).state_dict())
    small = models.create_model("resnet18", num_classes=5, small_stem=True)
    assert type(small.conv1) is nn.Conv2d  # the small stem's convolution was not measured: left as torch's
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert stem.takes(x, model.conv1) is None  # a CPU float32 input: the plain convolution
    if torch.cuda.is_available():
        model.cuda()
        assert stem.takes(x.cuda().half(), model.conv1) is None  # half input, float32 weights, no autocast
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert stem.takes(x.cuda(), model.conv1) is torch.bfloat16  # --amp: autocast's dtype


def test_the_padded_stem_gives_the_convolutions_output_and_weight_gradient(monkeypatch):
    # The padded path, forced on a CPU in float64: the fourth channel adds exact zeros.
    from imagenet.models import stem
    conv = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False).double()
    padded = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False).double()
    padded.load_state_dict(conv.state_dict())
    stem.pad_stem(nn.Module())  # a model without conv1: nothing to do
    holder = nn.Module()
    holder.conv1 = padded
    stem.pad_stem(holder)
    monkeypatch.setattr(stem, "takes", lambda x, c: torch.float64)
    x = torch.randn(2, 3, 19, 18, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y, y_ref = padded(x), conv(x)
    assert y.shape == y_ref.shape and torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert padded.weight.grad.shape == (8, 3, 7, 7)
    assert torch.allclose(padded.weight.grad, conv.weight.grad, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_padded_stem_matches_cudnns_own_padding_on_the_gpu(dtype):
    from imagenet.models import stem
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False).cuda().to(dtype)
    conv = conv.to(memory_format=torch.channels_last)
    padded = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False).cuda().to(dtype)
    padded = padded.to(memory_format=torch.channels_last)
    padded.load_state_dict(conv.state_dict())
    holder = nn.Module()
    holder.conv1 = padded
    stem.pad_stem(holder)
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    assert stem.takes(x, padded)
    y, y_ref = padded(x), conv(x)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    scale = y_ref.float().abs().max()
    # the same sums; cuDNN may pick another algorithm for 4 channels than for its own padded 3
    assert (y.float() - y_ref.float()).abs().max() <= 1e-3 * scale
    wscale = conv.weight.grad.float().abs().max()
    assert (padded.weight.grad.float() - conv.weight.grad.float()).abs().max() <= 1e-2 * wscale  # fp16 sums of 8,192
    assert padded.weight.grad.shape == conv.weight.shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_padded_stem_under_autocast_matches_cudnns_own_padding_on_the_gpu(dtype):
    # --amp: a float32 model and image; the padded path casts both to autocast's dtype first
    from imagenet.models import stem
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False).cuda()
    conv = conv.to(memory_format=torch.channels_last)
    padded = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False).cuda()
    padded = padded.to(memory_format=torch.channels_last)
    padded.load_state_dict(conv.state_dict())
    holder = nn.Module()
    holder.conv1 = padded
    stem.pad_stem(holder)
    x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=dtype):
        assert stem.takes(x, padded) is dtype
        y, y_ref = padded(x), conv(x)
    assert y.dtype == y_ref.dtype == dtype
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    scale = y_ref.float().abs().max()
    assert (y.float() - y_ref.float()).abs().max() <= 1e-3 * scale
    assert padded.weight.grad.dtype == torch.float32 and padded.weight.grad.shape == conv.weight.shape
    wscale = conv.weight.grad.abs().max()
    assert (padded.weight.grad - conv.weight.grad).abs().max() <= 1e-2 * wscale
