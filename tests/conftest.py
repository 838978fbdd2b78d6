"""Shared pytest setup: the tests import the ``imagenet`` package straight from the checkout."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Real MNIST digits as a tiny ImageFolder: 10 classes, 8 train and 8 val images each."""
    from imagenet import prepare
    root = tmp_path_factory.mktemp("digits")
    prepare.export_mnist5k(str(root), limit_per_class=8)
    return str(root)
