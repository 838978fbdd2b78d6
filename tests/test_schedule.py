"""The learning rate's shapes (imagenet/training/schedule.py): warm-up, then step, cosine,
triangular (FFCV) or poly (MLPerf), checked at the points a recipe names, and the flags' checks."""

import math
import subprocess
import sys

import pytest

from imagenet.base.config import Config
from imagenet.training.schedule import schedule_of

N = 10  # optimizer steps an epoch


FLAGS = {"decay_epochs": "lr_decay_epochs", "power": "lr_poly_power", "step_epochs": "lr_step", "gamma": "lr_gamma"}


def lrs(schedule, lr=2.0, **kw):
    kw.setdefault("epochs", 8)
    cfg = Config(lr_schedule=schedule, lr=lr, **{FLAGS.get(k, k): v for k, v in kw.items()})
    fn = schedule_of(cfg, iters_per_epoch=N)
    return [lr * fn(it) for it in range(kw["epochs"] * N + 5 * N)]


def test_warm_up_is_linear_to_the_peak_in_every_schedule():
    for schedule in ("step", "cosine", "triangular", "poly"):
        got = lrs(schedule, warmup_epochs=2)
        assert got[0] == pytest.approx(2.0 / 20) and got[9] == pytest.approx(1.0) and got[19] == pytest.approx(2.0)


def test_triangular_is_ffcvs_straight_line_down_to_zero_at_the_last_step():
    got = lrs("triangular", warmup_epochs=2)
    assert got[20] == pytest.approx(2.0)  # the peak where warm-up ends
    assert got[50] == pytest.approx(1.0)  # half-way down: 30 of 60 decaying steps
    assert got[80] == pytest.approx(0.0) and got[85] == 0.0  # the end and past it
    steps = [a - b for a, b in zip(got[20:80], got[21:81])]
    assert max(steps) == pytest.approx(min(steps))  # one slope


def test_poly_reaches_its_end_lr_at_the_decay_epochs_and_stays():
    got = lrs("poly", warmup_epochs=2, lr_end=1e-4, decay_epochs=6, power=2)
    assert got[20] == pytest.approx(2.0)
    p = 10 / 40  # step 30: 10 of the 40 decaying steps
    assert got[30] == pytest.approx((2.0 - 1e-4) * (1 - p) ** 2 + 1e-4)
    assert got[60] == pytest.approx(1e-4) and got[79] == pytest.approx(1e-4)  # past the decay


def test_cosine_with_an_end_lr():
    got = lrs("cosine", lr_end=0.5)
    assert got[0] == pytest.approx(2.0) and got[80] == pytest.approx(0.5)
    assert got[40] == pytest.approx(0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_step_keeps_the_reference_scripts_shape():
    got = lrs("step", epochs=8, step_epochs=3, gamma=0.1)
    assert got[29] == pytest.approx(2.0) and got[30] == pytest.approx(0.2) and got[60] == pytest.approx(0.02)


def test_the_flags_reach_the_schedule():
    cfg = Config(lr=11.0, lr_schedule="poly", warmup_epochs=2, epochs=35, lr_decay_epochs=37, lr_end=1e-4,
                 lr_poly_power=2)
    fn = schedule_of(cfg, iters_per_epoch=N)
    assert 11.0 * fn(370) == pytest.approx(1e-4) and 11.0 * fn(20) == pytest.approx(11.0)


@pytest.mark.parametrize("flags, words", [
    (["--lr", "0.1", "--lr-end", "0.2"], "--lr-end"),
    (["--lr-poly-power", "0"], "--lr-poly-power"),
    (["--warmup-epochs", "3", "--lr-decay-epochs", "2"], "--lr-decay-epochs"),
])
def test_bad_schedule_flags_are_one_line_errors(flags, words):
    out = subprocess.run([sys.executable, "main.py", "--dummy", *flags], capture_output=True, text=True)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("flags, words", [
    (["--lars-eta", "0.002"], "add --optimizer lars"),
    (["--lr-end", "0.001"], "--lr-schedule step has none"),
    (["--lr-schedule", "cosine", "--lr-poly-power", "3"], "add --lr-schedule poly"),
    (["--progressive-step", "8"], "add --progressive-resize"),
])
def test_a_setting_without_its_feature_is_a_one_line_error(flags, words):
    out = subprocess.run([sys.executable, "main.py", "--dummy", *flags], capture_output=True, text=True)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


def test_settings_with_their_features_are_accepted():
    from imagenet.base.config import validate
    validate(Config(optimizer="lars", lars_eta=0.002, lr_schedule="poly", lr_poly_power=3, lr_end=1e-4,
                    progressive_resize=128, progressive_step=8, epochs=4))
