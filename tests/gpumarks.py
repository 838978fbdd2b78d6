"""Which tests are GPU tests: those marked ``@pytest.mark.gpu`` (``@pytest.mark.gpu(2)``: two
GPUs), and any test that skips itself without CUDA through a ``skipif`` whose reason says it needs
CUDA or a GPU. tests/conftest.py marks the second kind too and skips both where fewer GPUs are
visible, so ``pytest -m gpu`` (scripts/test_gpu.sh) runs exactly the tests a CPU run skips for
want of a GPU.
"""

import re

import pytest

NEEDS_CUDA = re.compile(r"\bneeds?\b.*\b(CUDA|GPUs?)\b")


def gpus_needed(item) -> int:
    """How many CUDA GPUs the collected test ``item`` needs; 0 for a CPU test."""
    mark = item.get_closest_marker("gpu")
    if mark is not None:
        return int(mark.args[0] if mark.args else mark.kwargs.get("count", 1))
    for skip in item.iter_markers("skipif"):
        reason = str(skip.kwargs.get("reason", ""))
        if NEEDS_CUDA.search(reason):
            return 2 if re.search(r"\b(two|2)\b", reason) else 1
    return 0


def mark_gpu_tests(items, visible_gpus) -> None:
    """Mark every GPU test among ``items`` ``gpu``, and skip those that need more GPUs than
    ``visible_gpus()`` (asked once, and only if there is a GPU test) says are here."""
    visible = None
    for item in items:
        need = gpus_needed(item)
        if not need:
            continue
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu(need))
        if visible is None:
            visible = visible_gpus()
        if visible < need:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU" if need == 1 else f"needs {need} CUDA GPUs"))


def cuda_gpus() -> int:
    """CUDA GPUs visible to this process."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
