"""A dead rank is survived: ``python -m multiproc --max-restarts N`` restarts the group, which resumes
from the newest checkpoint by itself, and the run ends as an uninterrupted one would, bit for bit.

Two CPU ranks over gloo; one run is killed with SIGKILL twice: rank 0 right after the checkpoint
of the first epoch's last step (the step after which the ranks' BatchNorm statistics are averaged),
then rank 1 at a random step of the second epoch (the seed is in every failure message:
ELASTIC_TEST_SEED=<seed> repeats the same step). A plain ``--resume auto`` from the last step's
checkpoint must end the same way.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import digits_fixture, scratch

REPO = Path(__file__).resolve().parents[1]
EVERY = 4  # --save-every-steps: a failure costs at most this many steps; a divisor of STEPS: the last step saves
STEPS = 8  # per epoch: 70 training images, global batch 8 (the last 6 dropped)

digits = digits_fixture(7, 1)
LINE = re.compile(r"Epoch: \[(\d+)\]\[\s*(\d+)/\d+\]")


# main.py, in which rank 0 of a launch's first attempt copies the checkpoint written after the
# first epoch's last step to last_step.pth.tar next to it and, with argv[1] == "kill", then dies
# by SIGKILL (before the epoch's own checkpoint); else it copies that one too, to epoch_end.pth.tar.
LAST_STEP = r'''
import os
import shutil
import signal
import sys

sys.path.insert(0, os.getcwd())
from imagenet.cli import main
from imagenet.training import runner

real, kill, steps, out = runner.train_one_epoch, sys.argv[1] == "kill", int(sys.argv[2]), sys.argv[3]
first = os.environ["RANK"] == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def copy(name):
    shutil.copy(os.path.join(out, "checkpoint.pth.tar"), os.path.join(out, "copying"))
    os.replace(os.path.join(out, "copying"), os.path.join(out, name))


def train_one_epoch(**k):
    on_step = k["on_step"]

    def hook(done, sums):
        on_step(done, sums)  # rank 0 writes the step's checkpoint
        if first and (k["progress"].epoch, done) == (0, steps):
            copy("last_step.pth.tar")
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
    if first and k["progress"].epoch == 1:
        copy("epoch_end.pth.tar")
    return real(**dict(k, on_step=hook))


runner.train_one_epoch = train_one_epoch
sys.exit(main(sys.argv[4:]))
'''


def launcher(data, out, *flags, stdout=subprocess.PIPE, driver=None, trainer=()):
    """Two ranks, 2 epochs, a checkpoint every EVERY steps, a weight average; ``flags`` go to the
    launcher, ``trainer`` to main.py, last; ``driver``: "copy" or "kill" runs LAST_STEP in place of
    main.py."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    script = ["main.py"]
    if driver is not None:
        (out / "last_step.py").write_text(LAST_STEP)
        script = [str(out / "last_step.py"), driver, str(STEPS), str(out)]
    cmd = [sys.executable, "-m", "multiproc", "--nproc-per-node", "2", "--grace-period", "5",
           "--log-dir", str(out / "logs"), *flags, *script, data, "-a", "resnet18", "-b", "8", "-j", "0",
           "--image-size", "16", "--val-resize", "16", "-p", "1", "--seed", "0", "--lr", "0.02",
           "--epochs", "2", "--dist-backend", "gloo", "--save-every-steps", str(EVERY), "--model-ema", "0.9",
           "--output-dir", str(out), *trainer]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)


def weights(out):
    return torch.load(Path(out) / "checkpoint.pth.tar", map_location="cpu", weights_only=True)


def assert_same_run(a, b, why):
    """Weights, BatchNorm statistics, the weight average's and the momentum buffers, bit for bit."""
    for part in ("state_dict", "state_dict_ema"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), f"{part}: {key} differs; {why}"
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(x["momentum_buffer"], y["momentum_buffer"]), why


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the training process of global rank ``rank``, a child of the launcher."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"\nPPid:\t{launcher_pid}\n" in status and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no child of {launcher_pid} has RANK={rank}")


@pytest.fixture(scope="module")
def straight(digits, tmp_path_factory):
    """The uninterrupted run, started here and left running beside the test's (every rank is one
    thread, and much of a run is starting processes): ``straight()`` waits for it and gives its
    checkpoint and the folder, where last_step.pth.tar and epoch_end.pth.tar are the checkpoints of
    the first epoch's last step and of its end."""
    with scratch(tmp_path_factory, "straight") as out:
        with open(out / "launcher.log", "w") as log:
            proc = launcher(digits, out, stdout=log, driver="copy")

        def result():
            proc.wait(timeout=300)
            assert proc.returncode == 0, (out / "launcher.log").read_text()
            return weights(out), out
        try:
            yield result
        finally:
            if proc.poll() is None:
                proc.terminate()  # the launcher passes it on to its ranks
                proc.wait(timeout=60)


def test_two_kills_are_survived_and_the_weights_match_an_uninterrupted_run(digits, straight, tmp_path):
    seed = int(os.environ.get("ELASTIC_TEST_SEED", time.time_ns() % 100000))
    rng = random.Random(seed)
    # rank 0 (the writer) kills itself after the checkpoint of epoch 0's last step; then, after the
    # restart, (epoch, step line after which to kill, rank): rank 1 in epoch 1
    kills = [None, (1, rng.randrange(1, STEPS - 2), 1)]
    proc = launcher(digits, tmp_path, "--max-restarts", "3", driver="kill")
    lines, printed, resumed_at = [], {}, []
    attempt, killed = 0, 1
    try:
        for line in proc.stdout:
            lines.append(line)
            # The launcher's line comes after every line of the attempt before (its ranks have
            # exited by then), a late step line of a surviving rank included.
            if line.startswith("multiproc: restart "):
                attempt += 1
                continue
            m = LINE.match(line)
            if not m:
                continue
            epoch, step = int(m.group(1)), int(m.group(2))
            if len(resumed_at) < attempt:  # the first step line after a restart
                resumed_at.append((epoch, step))
            printed[attempt] = (epoch, step)
            if killed == attempt < len(kills) and (epoch, step) == kills[killed][:2]:
                os.kill(rank_pid(proc.pid, kills[killed][2]), signal.SIGKILL)
                killed += 1
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    why = f"ELASTIC_TEST_SEED={seed}, kills (epoch, step, rank) {kills}:\n{out}"
    assert proc.returncode == 0, why
    assert "rank 1 exited with status 137" in out and "rank 0 exited with status 137" in out, why
    assert out.count("killed by SIGKILL") == 2, why
    assert "restart 1 of 3: starting 2 processes" in out and "restart 2 of 3" in out, why
    assert out.count("restarted after a failure in the process group") >= 2, why  # which checkpoint
    assert f"continuing at epoch 0, step {STEPS}" in out, why  # the last step's checkpoint
    # At most EVERY steps of work lost per failure: the restarted group's first step is no earlier
    # than EVERY before the last one done (the step printed last, plus one) in the same epoch; after
    # the first kill, the group goes on with the next epoch.
    assert killed == 2 and len(resumed_at) == 2, why
    assert printed[0] == (0, STEPS - 1) and resumed_at[0] == (1, 0), why
    last_epoch, last = printed[1]
    epoch, first = resumed_at[1]
    assert epoch == last_epoch and first % EVERY == 0, why
    assert (last + 1) - first <= EVERY, why
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [0, 1], why  # one row per epoch
    assert [r["restarts"] for r in rows] == [1, 2], why
    assert rows[-1]["train_samples"] == 8 * STEPS
    assert_same_run(straight()[0], weights(tmp_path), why)


def test_a_resume_from_an_epochs_last_step_matches_an_uninterrupted_run(digits, straight, tmp_path):
    """The checkpoint of an epoch's last step holds the ranks' averaged BatchNorm statistics (the
    weight average's too): a run resumed there trains no more of that epoch, so it could not
    average them again. A plain --resume auto from it (no kill) ends the epoch as the uninterrupted
    run did."""
    out = straight()[1]
    last, end = (torch.load(out / name, map_location="cpu", weights_only=True)
                 for name in ("last_step.pth.tar", "epoch_end.pth.tar"))
    assert (last["epoch"], last["step_in_epoch"], end["epoch"]) == (0, STEPS, 1)
    assert_same_run(end, last, "the epoch's end changed what its last step's checkpoint holds")
    shutil.copy(out / "last_step.pth.tar", tmp_path / "checkpoint.pth.tar")
    with open(tmp_path / "launcher.log", "w") as log:
        proc = launcher(digits, tmp_path, stdout=log, trainer=("--epochs", "1", "--resume", "auto"))
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher passes it on to its ranks
            proc.wait(timeout=60)
    out = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 0, out
    assert f"continuing at epoch 0, step {STEPS}" in out, out
    assert_same_run(end, weights(tmp_path), out)
