"""End to end on image files: the issue's command line on a small ImageFolder of rendered digits learns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_digits

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Rendered digits as an ImageFolder: 10 classes, 150 train / 20 val images each."""
    root = tmp_path_factory.mktemp("digits")
    make_digits(root, train_per_class=150, val_per_class=20)
    return root


def test_reference_command_line_trains_and_writes_outputs(digits, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "main.py", str(digits), "-a", "resnet18", "-b", "32", "--epochs", "2", "-j", "0",
           "--lr", "0.01", "--output-dir", str(out),
           # small images: a 32 px crop keeps the run to seconds on a CPU
           "--image-size", "32", "--val-resize", "32", "--min-crop-scale", "0.5", "--hflip", "0", "--seed", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " * Acc@1" in proc.stdout
    assert "Epoch: [1][" in proc.stdout
    for name in ("checkpoint.pth.tar", "model_best.pth.tar", "metrics.jsonl"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[-1]["val_samples"] == 200
    # Chance is 10%. Two short epochs at lr 0.01 gave 96.0% and 96.5% (--seed 0 and 2; torch 2.14,
    # Pillow 13); at 0.05 the first epoch diverged on some seeds (13% to 35%). Three times chance is
    # a learning model.
    assert rows[-1]["val_acc1"] >= 30.0, rows[-1]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
