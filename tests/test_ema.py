"""--model-ema: the average follows the fp32 weights, is validated, checkpointed and resumed exactly."""

import json

import pytest
import torch
import torchvision

from imagenet.cli import main
from imagenet.precision import LossScaler, MasterWeightPrecision, Precision
from imagenet.training.ema import ModelEma
from tests.helpers import batches, small_net, tiny_run_args, train_steps


def test_average_follows_the_weights_with_the_warmed_up_decay():
    prec = Precision()
    model = prec.prepare_model(small_net())
    ema = ModelEma(model, prec, decay=0.5)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(torch.tensor(True))  # first update: d = min(0.5, 2/11)
    d = 2 / 11
    for e, s in zip(ema.model.parameters(), start):
        torch.testing.assert_close(e, d * s + (1 - d) * (s + 1))


def test_fp16_average_follows_the_fp32_masters_not_the_rounded_copy():
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, opt, _ = train_steps(prec, small_net(), batches(1))
    ema = ModelEma(model, prec, decay=0.9)
    for e, m in zip(ema.model.parameters(), prec.masters):
        assert e.dtype == torch.float32 and torch.equal(e, m)
    assert all(b.dtype == torch.float32 for b in ema.model.buffers() if b.is_floating_point())


def test_a_step_skipped_on_the_host_leaves_the_average_exactly_as_it_was():
    """The foreach (host-decided) fp16 path returns its constant False flag on an overflow; the
    average's weights and statistics, masked by it on the device, do not move, and the clock
    counts the step."""
    prec = MasterWeightPrecision(LossScaler(init_scale=256, dynamic=False))
    model, opt, stepped = train_steps(prec, small_net(), batches(1))
    ema = ModelEma(model, prec, decay=0.5)
    ema.update(stepped[0])
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    x, y = batches(1, seed=6)[0]
    prec.backward(torch.nn.functional.cross_entropy(prec.forward(model, x), y))
    next(model.parameters()).grad.fill_(float("inf"))
    skipped = prec.step(opt)
    ema.update(skipped)
    assert not bool(skipped) and ema.updates == 2
    # (BatchNorm's num_batches_tracked follows the model's forwards, skipped or not)
    changed = [k for k, v in ema.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert changed == [], changed


def argv(data, out, *extra):
    return [data, "-a", "resnet18", "-b", "16", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "100",
            "--seed", "0", "--lr", "0.02", "--model-ema", "0.9", "--output-dir", str(out), *extra]


def test_average_is_validated_checkpointed_and_resumed_exactly(digits, tmp_path, capsys):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(argv(digits, straight, "--epochs", "2")) == 0
    assert "(weight average)" in capsys.readouterr().out
    row = json.loads(open(straight / "metrics.jsonl").readlines()[-1])
    assert {"val_acc1_ema", "val_acc5_ema", "val_loss_ema"} <= set(row)
    assert main(argv(digits, resumed, "--epochs", "1")) == 0
    assert main(argv(digits, resumed, "--epochs", "2", "--resume", "auto")) == 0
    a = torch.load(straight / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(resumed / "checkpoint.pth.tar", weights_only=True)
    assert a["ema_updates"] == b["ema_updates"] > 0
    for k, v in a["state_dict_ema"].items():
        assert torch.equal(v, b["state_dict_ema"][k]), k
    torchvision.models.resnet18(num_classes=10).load_state_dict(a["state_dict_ema"])


@pytest.mark.parametrize("decay", ["0", "1", "1.5"])
def test_bad_decay_is_refused(decay, capsys):
    assert main(["--model-ema", decay]) == 2
    assert "--model-ema" in capsys.readouterr().err


def test_the_average_never_changes_the_trained_weights(digits, tmp_path):
    """The average is an observer: with and without --model-ema (validated every epoch) the
    trained model follows the same trajectory, bit for bit on the CPU."""
    plain, averaged = tmp_path / "plain", tmp_path / "ema"
    assert main(tiny_run_args(digits, plain, "--epochs", "2")) == 0  # the same run, without --model-ema
    assert main(argv(digits, averaged, "--epochs", "2")) == 0
    a = torch.load(plain / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    b = torch.load(averaged / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
