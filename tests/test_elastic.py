"""A dead rank is survived: ``python -m multiproc --max-restarts N`` restarts the group, which resumes
from the newest checkpoint by itself, and the run ends as an uninterrupted one would, bit for bit.

Two CPU ranks over gloo; one run is killed with SIGKILL twice, at random steps (the seed is in
every failure message: ELASTIC_TEST_SEED=<seed> repeats the same steps).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import digits_fixture, scratch

REPO = Path(__file__).resolve().parents[1]
EVERY = 3  # --save-every-steps: a failure may cost at most this many steps
STEPS = 8  # per epoch: 70 training images, global batch 8 (the last 6 dropped)

digits = digits_fixture(7, 1)
LINE = re.compile(r"Epoch: \[(\d+)\]\[\s*(\d+)/\d+\]")


def launcher(data, out, *flags, stdout=subprocess.PIPE):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "multiproc", "--nproc-per-node", "2", "--grace-period", "5",
           "--log-dir", str(out / "logs"), *flags, "main.py", data, "-a", "resnet18", "-b", "8", "-j", "0",
           "--image-size", "16", "--val-resize", "16", "-p", "1", "--seed", "0", "--lr", "0.02",
           "--epochs", "2", "--dist-backend", "gloo", "--save-every-steps", str(EVERY),
           "--output-dir", str(out)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)


def weights(out):
    return torch.load(Path(out) / "checkpoint.pth.tar", map_location="cpu", weights_only=True)


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
    checkpoint."""
    with scratch(tmp_path_factory, "straight") as out:
        with open(out / "launcher.log", "w") as log:
            proc = launcher(digits, out, stdout=log)

        def result():
            proc.wait(timeout=300)
            assert proc.returncode == 0, (out / "launcher.log").read_text()
            return weights(out)
        try:
            yield result
        finally:
            if proc.poll() is None:
                proc.terminate()  # the launcher passes it on to its ranks
                proc.wait(timeout=60)


def test_two_kills_are_survived_and_the_weights_match_an_uninterrupted_run(digits, straight, tmp_path):
    seed = int(os.environ.get("ELASTIC_TEST_SEED", time.time_ns() % 100000))
    rng = random.Random(seed)
    # (epoch, step line after which to kill, rank): rank 1 in epoch 0, then rank 0 (the writer) in epoch 1
    kills = [(0, rng.randrange(1, STEPS - 2), 1), (1, rng.randrange(1, STEPS - 2), 0)]
    proc = launcher(digits, tmp_path, "--max-restarts", "3")
    lines, printed, resumed_at = [], {}, []
    attempt = killed = 0
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
    # At most EVERY steps of work lost per failure: the restarted group's first step is no earlier
    # than EVERY before the last one done (the step printed last, plus one) in the same epoch.
    assert killed == 2 and len(resumed_at) == 2, why
    for attempt, (epoch, first) in enumerate(resumed_at):
        last_epoch, last = printed[attempt]
        assert epoch == last_epoch and first % EVERY == 0, why
        assert (last + 1) - first <= EVERY, why
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [0, 1], why  # one row per epoch
    assert [r["restarts"] for r in rows] == [1, 2], why
    assert rows[-1]["train_samples"] == 8 * STEPS
    ckpt, straight = weights(tmp_path), straight()
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, ckpt["state_dict"][key]), f"{key} differs; {why}"
    for a, b in zip(straight["optimizer"]["state"].values(), ckpt["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"]), why
