"""--multiprocessing-distributed: the spawned workers follow every launch mode's exit contract.

The test starts the spawn path with two CPU processes over gloo (``spawn_per_gpu(cfg, run,
nprocs=2)``, what ``main`` does with one process per visible GPU), with the GPUs hidden so it
means the same on a machine that has fewer than two.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import digits_fixture, scratch

REPO = Path(__file__).resolve().parents[1]

SPAWN = """
import sys
from imagenet.base.config import parse_config
from imagenet.training.runner import run
from imagenet.parallel.spawn import spawn_per_gpu
sys.exit(spawn_per_gpu(parse_config(sys.argv[1:]), run, nprocs=2))
"""


digits = digits_fixture(8, 2)


def spawn(data, out, *extra):
    argv = [data, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16", "-p", "1",
            "--seed", "0", "--lr", "0.02", "--dist-backend", "gloo", "--multiprocessing-distributed",
            "--output-dir", str(out), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-c", SPAWN, *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def spawned(digits, tmp_path_factory):
    """Both tests' runs, started at once (each is three processes importing torch, most of its
    time): name -> (the process, its output folder)."""
    with scratch(tmp_path_factory, "preempted", "user_error") as (preempted, user_error):
        runs = {"preempted": (spawn(digits, preempted, "--epochs", "40"), preempted),
                "user-error": (spawn(digits, user_error, "--epochs", "1", "--resume",
                                     str(user_error / "missing.pth.tar")), user_error)}
        try:
            yield runs
        finally:
            for proc, _ in runs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()


def test_spawned_workers_preempted_exit_with_the_signal_and_the_resume_line(spawned):
    proc, tmp_path = spawned["preempted"]
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(r"Epoch: \[0\]\[\s*2/", line):
            proc.send_signal(signal.SIGTERM)  # to the launching process only, as `kill PID` does
            break
    else:
        pytest.fail("the run ended before its third step:\n" + "".join(lines))
    rest, _ = proc.communicate(timeout=240)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out, out
    assert out.count("run the same command with --resume auto to continue") == 1, out
    ckpt = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    assert ckpt["step_in_epoch"] > 0 or ckpt["epoch"] > 0


def test_spawned_worker_user_error_exits_2_with_one_line(spawned):
    proc, _ = spawned["user-error"]
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert "missing.pth.tar: no such file" in out, out
