"""Progressive resizing and validation under torch.compile: one graph per training size, one for
validation (flip-averaged with --val-flip, its last short batch padded), none after a size's
first epoch. On a CPU, IMAGENET_COMPILE_BACKEND=eager compiles with Dynamo alone (no Inductor),
which counts the graphs in seconds."""

import json

import pytest
import torch
import torch.nn as nn

from imagenet.base.config import Config
from imagenet.cli import main
from imagenet.models.evaluation import Evaluator, FixedBatch
from imagenet.models.registry import COMPILE_BACKEND_ENV
from imagenet.parallel.distributed import DistContext
from imagenet.precision import Precision
from imagenet.training.engine import LoopOptions, validate
from imagenet.training.state import build_training, wrap_training
from tests.helpers import tiny_run_args

CPU = DistContext("cpu", torch.device("cpu"), "test")


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_each_size_compiles_once_and_validation_once(digits, tmp_path, monkeypatch, capsys):
    """Epoch 0 (8 px) compiles the training graph and validation's (its 80 images in batches of
    16 and one short batch would be two shapes without the padding); epoch 1, at 8 px again,
    nothing; epoch 2 (16 px) the one new training graph."""
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")
    args = tiny_run_args(digits, tmp_path, "--epochs", "3", "--progressive-resize", "8", "--progressive-step", "8",
                         "--progressive-ramp", "1:2", "--compile", "default", "--val-flip", "-b", "24")
    assert main(args) == 0
    got = rows(tmp_path)
    assert [r["image_size"] for r in got] == [8, 8, 16]
    assert [r["compiles"] for r in got] == [2, 0, 1]
    assert all(r["val_samples"] == 80 for r in got)  # validation stays at --image-size, every image once
    out = capsys.readouterr().out
    assert "training crops of 8 px" in out and "training crops of 16 px" in out
    assert "2 training sizes, 8, 16 px" in out and "first step at 16 px done" in out
    assert "a size already compiled" not in out


def test_validation_compiled_in_a_later_epoch_is_no_recompile(digits, tmp_path, monkeypatch, capsys):
    """--eval-start 2 validates first in the last epoch, whose training size was compiled before:
    its validation graph is the run's first, not a size compiled again (no note)."""
    torch.compiler.reset()  # the shapes another test compiled in this process would count as compiled
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")
    args = tiny_run_args(digits, tmp_path, "--epochs", "3", "--eval-start", "2", "--compile", "default", "-b", "24")
    assert main(args) == 0
    assert [r["compiles"] for r in rows(tmp_path)] == [1, 0, 1]
    assert "a size already compiled" not in capsys.readouterr().out


def test_the_recompile_limit_holds_every_size():
    """13 sizes (8 px steps from 128 to 224) and torch's 8 besides: past its limit Dynamo would run the
    model uncompiled for the rest of the run."""
    import torch._dynamo.config as dynamo
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    saved = getattr(dynamo, name)
    try:
        setattr(dynamo, name, 8)
        c = Config(arch="resnet18", image_size=224, epochs=16, progressive_resize=128, progressive_ramp="0:12",
                   progressive_step=8, compile="default")
        state = build_training(c, CPU, num_classes=3, iters_per_epoch=4)
        wrap_training(state, c, CPU)
        assert getattr(dynamo, name) >= 13 + 8
    finally:
        setattr(dynamo, name, saved)


class Asymmetric(nn.Module):
    """Logits that change when the image is mirrored: the mean of its left and right halves, per channel."""

    def forward(self, x):
        w = x.shape[-1] // 2
        return torch.cat([x[..., :w].mean((2, 3)), x[..., w:].mean((2, 3))], 1)


def test_flip_averaging_means_the_logits_of_the_image_and_its_mirror():
    x = torch.randn(4, 3, 6, 6)
    net = Asymmetric()
    expected = (net(x) + net(x.flip(3))) / 2
    torch.testing.assert_close(Evaluator(net, flip=True)(x), expected)
    torch.testing.assert_close(Evaluator(net, flip=False)(x), net(x))
    assert not torch.allclose(expected, net(x))


class FakeLoader:
    """Validation batches: 10 images, 4 at a time (the last two short)."""

    def __init__(self, images, targets):
        self.batches = [(images[i:i + 4], targets[i:i + 4], []) for i in range(0, len(targets), 4)]

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def test_validation_takes_its_loss_and_accuracy_from_the_averaged_logits():
    torch.manual_seed(0)
    images, targets = torch.randn(10, 3, 6, 6), torch.randint(0, 6, (10,))
    net, criterion = Asymmetric(), nn.CrossEntropyLoss()
    got = validate(model=net, loader=FakeLoader(images, targets), criterion=criterion, precision=Precision(), ctx=CPU,
                   opts=LoopOptions(), forward=Evaluator(net, flip=True))
    mean = (net(images) + net(images.flip(3))) / 2
    assert got.loss == pytest.approx(criterion(mean, targets).item(), rel=1e-6)
    assert got.acc1 == pytest.approx(100.0 * (mean.argmax(1) == targets).float().mean().item())
    plain = validate(model=net, loader=FakeLoader(images, targets), criterion=criterion, precision=Precision(),
                     ctx=CPU, opts=LoopOptions())
    assert plain.loss == pytest.approx(criterion(net(images), targets).item(), rel=1e-6) and plain.loss != got.loss


def test_a_padded_short_batch_changes_no_logit_and_keeps_the_layout():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(5)).eval()
    x = torch.randn(3, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    seen = []

    def spy(images):
        seen.append(images)
        return net(images)
    torch.testing.assert_close(FixedBatch(spy, 8)(x), net(x))
    assert seen[0].shape[0] == 8 and seen[0].is_contiguous(memory_format=torch.channels_last)
    assert FixedBatch(spy, 3)(x).shape[0] == 3 and seen[1] is x


def test_the_evaluator_runs_dataparallels_wrapper(monkeypatch):
    """DataParallel splits validation's batch over its GPUs as it does training's: the evaluator
    runs the wrapper, not the module inside it (DDP's inner module, whose forward talks to no rank)."""
    from imagenet.parallel import distributed
    monkeypatch.setattr(distributed, "wrap", lambda model, ctx, **kw: nn.DataParallel(model))
    c = Config(arch="resnet18", image_size=16, compile="off", val_flip=True)
    state = wrap_training(build_training(c, CPU, num_classes=3, iters_per_epoch=4), c, CPU)
    assert isinstance(state.evaluator, Evaluator) and state.evaluator.net is state.model and state.evaluator.flip
