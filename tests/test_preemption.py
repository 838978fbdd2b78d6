"""Preemption and mid-epoch resume: SIGTERM -> checkpoint -> --resume auto continues bit-exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from imagenet.cli import main
from tests.helpers import assert_same_run, interrupt_after_step, make_digits, scratch
from tests.helpers import last_checkpoint as weights
from tests.helpers import resnet18_args as args

REPO = Path(__file__).resolve().parents[1]
COSINE = ("--lr-schedule", "cosine")  # a rate that changes every step: a resume point shows in it


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    make_digits(root, train_per_class=12, val_per_class=12)  # 120 train images: 15 steps of 8
    return str(root)


def signal_when(proc, prefix):
    """Read the run's output until a line starts with ``prefix``, then SIGTERM it; returns when."""
    for line in proc.stdout:
        if line.startswith(prefix):
            proc.send_signal(signal.SIGTERM)
            return time.monotonic()
    pytest.fail(f"the run ended before printing {prefix!r}")


@pytest.fixture(scope="module")
def straight(digits, tmp_path_factory):
    with scratch(tmp_path_factory, "straight") as out:
        assert main(args(digits, out, *COSINE)) == 0
        yield dict(weights(out), _dir=str(out))


def test_mid_epoch_checkpoint_resumes_bit_exactly(digits, straight, tmp_path, monkeypatch):
    # Stop the first run right after a mid-epoch checkpoint at step 5 of epoch 1, as a kill -9 would.
    interrupt_after_step(monkeypatch, 5, epoch=1)
    assert main(args(digits, tmp_path, *COSINE, "--save-every-steps", "5")) == 130
    ckpt = weights(tmp_path)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 5)
    monkeypatch.undo()
    assert main(args(digits, tmp_path, *COSINE, "--resume", "auto")) == 0
    assert_same_run(straight, weights(tmp_path))
    # the resumed epoch reports the whole epoch, as the straight run does: `lr` is the rate at its
    # first step, not at the resume point
    straight_rows = [json.loads(x) for x in open(Path(straight["_dir"]) / "metrics.jsonl")]
    resumed_rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert straight_rows[-1]["lr"] > straight_rows[-1]["lr_end"]
    for key in ("lr", "lr_end", "train_samples", "train_loss", "train_acc1", "train_acc5"):
        assert resumed_rows[-1][key] == pytest.approx(straight_rows[-1][key], rel=1e-9), key


def test_sigterm_writes_a_checkpoint_and_resume_matches_a_straight_run(digits, straight, tmp_path):
    cmd = [sys.executable, "main.py", *args(digits, tmp_path, *COSINE)]
    # the same thread count as the in-process straight run: float sums must happen in one order
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent = signal_when(proc, "Epoch: [0][ 3/")  # epoch 0 is under way
    out = proc.communicate(timeout=60)[0]
    assert time.monotonic() - sent < 60
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "--resume auto" in out
    ckpt = weights(tmp_path)
    assert ckpt["epoch"] == 0 and 0 < ckpt["step_in_epoch"] < 15
    assert main(args(digits, tmp_path, *COSINE, "--resume", "auto")) == 0
    assert_same_run(straight, weights(tmp_path))


def test_sigterm_through_multiproc_stops_every_rank_with_a_checkpoint(digits, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "multiproc", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
           "main.py", *args(digits, tmp_path, "--dist-backend", "gloo", "--epochs", "20")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent = signal_when(proc, "Epoch: [0][ 2/")
    out = proc.communicate(timeout=90)[0]
    assert time.monotonic() - sent < 60
    assert proc.returncode != 0
    assert "stopped by SIGTERM" in out, out
    ckpt = weights(tmp_path)
    assert ckpt["step_in_epoch"] > 0 and len(ckpt["rng_per_rank"]) == 2


def test_sigterm_to_the_whole_process_group_spares_the_workers_until_the_checkpoint(digits, tmp_path):
    """What a scheduler does (SLURM signals every process of the job): the DataLoader workers get
    SIGTERM too. They must outlive the last step and the checkpoint, then end with the run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "main.py", *args(digits, tmp_path, "--epochs", "20")]  # -j 2: two workers
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("Epoch: [0][ 3/"):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    out = proc.communicate(timeout=90)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "killed by signal" not in out, out
    assert weights(tmp_path)["step_in_epoch"] > 0
    time.sleep(1)
    try:
        os.killpg(proc.pid, 0)  # nothing of the run is left behind
        leftover = True
    except ProcessLookupError:
        leftover = False
    assert not leftover


def test_a_worker_that_got_sigterm_ends_by_itself_after_the_grace_period():
    script = ("import os, signal, time\n"
              "from imagenet.data import loaders as data\n"
              "data.WORKER_TERM_GRACE = 1\n"
              "signal.signal(signal.SIGALRM, lambda *_: None)\n"  # the parent's handler, inherited by a fork
              "data.worker_signals(0)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "print('alive after SIGTERM', flush=True)\n"
              "time.sleep(30)\n")
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "alive after SIGTERM" in r.stdout
    assert r.returncode == -signal.SIGALRM and time.monotonic() - start < 20
