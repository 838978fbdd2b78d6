"""The package's layering (``.importlinter``, import-linter's contracts) holds, and the check
can fail: a planted upward import and a planted cycle each break it.

Layers, top to bottom: cli | launch (launch imports nothing else of the package); training; data | parallel | models | precision (independent of
each other); kernels; base. Inside ``data``: loaders; prefetch | dataorder | probe; shards;
gpu | images; the shared modules; decode, with gpu and shards independent of each other. Inside
``kernels``: the fused BatchNorm's ops (fusedbn) over their launches (bnlaunch, beside convstats)
over their Triton kernels (bntriton). Inside ``launch``: agent; group | flags; gpus. Inside
``data.shards``: writer; journal; files | dataset | remote | tarwrite; index; lease. Each package's ``__init__`` docstring says what it may import.
"""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / ".importlinter"
PACKAGES = ("base", "kernels", "models", "precision", "data", "data/images", "data/shards", "data/gpu", "parallel",
            "training", "launch")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the ``imagenet`` package found under ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root))
    script = ("import sys; from importlinter.cli import lint_imports; "
              "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, show_timings=False, "
              "verbose=False))")
    return subprocess.run([sys.executable, "-c", script, str(CONFIG)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_layering_contracts_are_kept():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 kept, 0 broken" in r.stdout, r.stdout


@pytest.fixture
def package_copy(tmp_path):
    shutil.copytree(REPO / "imagenet", tmp_path / "imagenet", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    path = root / "imagenet" / module
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_an_upward_import_breaks_the_layers(package_copy):
    _plant(package_copy, "base/metrics.py", "from ..training import engine  # planted")
    r = _lint(package_copy)
    assert r.returncode != 0
    assert "imagenet.base.metrics -> imagenet.training.engine" in r.stdout, r.stdout


def test_an_import_between_independent_packages_breaks_the_layers(package_copy):
    _plant(package_copy, "data/mixing.py", "from ..parallel import distributed  # planted")
    r = _lint(package_copy)
    assert r.returncode != 0
    assert "imagenet.data.mixing -> imagenet.parallel.distributed" in r.stdout, r.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("data/gpu/jpeg.py", "from ..shards import index  # planted", "imagenet.data.gpu.jpeg -> imagenet.data.shards.index"),
    ("data/shards/dataset.py", "from ..gpu import jpeg  # planted",
     "imagenet.data.shards.dataset -> imagenet.data.gpu.jpeg"),
    ("data/images/folder.py", "from ..gpu import choice  # planted",
     "imagenet.data.images.folder -> imagenet.data.gpu.choice"),
    ("data/decode.py", "from .images import folder  # planted", "imagenet.data.decode -> imagenet.data.images.folder"),
    ("kernels/bntriton.py", "from . import bnlaunch  # planted", "imagenet.kernels.bntriton -> imagenet.kernels.bnlaunch"),
    ("kernels/bnlaunch.py", "from . import fusedbn  # planted", "imagenet.kernels.bnlaunch -> imagenet.kernels.fusedbn"),
    ("kernels/bnlaunch.py", "from . import convstats  # planted",
     "imagenet.kernels.bnlaunch -> imagenet.kernels.convstats"),
    ("launch/gpus.py", "from . import group  # planted", "imagenet.launch.gpus -> imagenet.launch.group"),
    ("data/shards/files.py", "from . import journal  # planted",
     "imagenet.data.shards.files -> imagenet.data.shards.journal"),
    ("launch/flags.py", "from ..base import errors  # planted", "imagenet.launch.flags -> imagenet.base.errors"),
], ids=["gpu-to-shards", "shards-to-gpu", "images-to-gpu", "shared-to-images", "kernels-to-launches",
        "launches-to-ops", "launches-to-convstats", "launch-gpus-to-group", "shards-files-to-journal",
        "launch-to-the-trainer"])
def test_an_import_inside_a_package_against_its_contracts_breaks_them(package_copy, module, line, broken):
    _plant(package_copy, module, line)
    r = _lint(package_copy)
    assert r.returncode != 0
    assert broken in r.stdout, r.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(package_copy):
    # engine -> state is no upward import (both are training), but runner already imports engine,
    # and engine importing runner closes a cycle.
    _plant(package_copy, "training/engine.py", "from . import runner  # planted")
    r = _lint(package_copy)
    assert r.returncode != 0
    assert "no import cycles between the modules of a package BROKEN" in r.stdout, r.stdout


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_its_job_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((REPO / "imagenet" / package / "__init__.py").read_text()))
    assert doc and "May import:" in doc, f"imagenet/{package}/__init__.py needs a docstring with 'May import:'"
    # every module of the package is named in it
    modules = sorted(p.stem for p in (REPO / "imagenet" / package).glob("*.py") if p.stem != "__init__")
    missing = [m for m in modules if f"``{m}``" not in doc]
    assert not missing, f"imagenet/{package}/__init__.py does not describe {missing}"
