"""SLURM without setup: ``srun python main.py ...`` (one task per GPU) needs no MASTER_ADDR/PORT, and
SIGUSR1 (``#SBATCH --signal=USR1@120``) stops like SIGTERM: checkpoint, exit status 138."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from imagenet.base.config import parse_config
from imagenet.base.errors import UserError
from imagenet.base import launchenv
from tests.helpers import digits_fixture

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("gpu[7]", ["gpu7"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),  # no padding: widths grow
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),  # padding of the lower bound
    ("gpu[01-02],cpu[1-2],login", ["gpu01", "gpu02", "cpu1", "cpu2", "login"]),
    ("node-a,node-b", ["node-a", "node-b"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("nid00[1-2].cluster.org", ["nid001.cluster.org", "nid002.cluster.org"]),
    (" gpu[1-2] ", ["gpu1", "gpu2"]),
])
def test_nodelist_expands_as_scontrol_show_hostnames(nodelist, hosts):
    assert launchenv.expand_nodelist(nodelist) == hosts
    assert launchenv.first_node(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "gpu[01-", "gpu01]", "gpu[[1]]", "gpu[a-b]", "gpu[3-1]", "gpu[1-]",
                                      "a,,b", "gpu[]"])
def test_malformed_nodelists_are_refused(nodelist):
    with pytest.raises(ValueError):
        launchenv.expand_nodelist(nodelist)


def slurm_env(rank=0, **extra):
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    env.update(extra)
    return env


def test_srun_tasks_find_the_first_node_and_a_port_from_the_job_id():
    denv = launchenv.distributed_env(parse_config(["--dist-backend", "gloo"]), slurm_env(rank=1))
    assert (denv["rank"], denv["world_size"], denv["local_rank"]) == (1, 2, 1)
    assert launchenv.slurm_master(slurm_env(rank=1)) == ("gpu07", str(10000 + 123456 % 20000))
    # The step's node list (srun -w) wins over the job's; MASTER_* set by hand win over both.
    assert launchenv.slurm_master(slurm_env(SLURM_STEP_NODELIST="gpu08"))[0] == "gpu08"
    assert launchenv.slurm_master(slurm_env(MASTER_ADDR="10.0.0.9", MASTER_PORT="4242")) == ("10.0.0.9", "4242")


@pytest.mark.parametrize("extra, message", [
    ({"SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST='gpu[07-' is not a SLURM node list"),
    ({"SLURM_JOB_ID": ""}, "no SLURM_JOB_ID"),
    ({"SLURM_JOB_NODELIST": ""}, "no SLURM_JOB_NODELIST"),
])
def test_slurm_environment_errors_name_the_variable_and_the_fix(extra, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        launchenv.slurm_master(slurm_env(**extra))
    assert "MASTER_" in str(e.value)


def test_restart_count_comes_from_the_elastic_agent():
    assert launchenv.restart_count({}) == 0
    assert launchenv.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2


digits = digits_fixture(12, 1)  # 120 training images: 15 steps of 8


def free_slurm_job_id() -> int:
    """A job id whose derived port nothing listens on."""
    rng = random.Random()
    for _ in range(50):
        job = rng.randrange(1, 10 ** 6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", launchenv.SLURM_PORT_BASE + job % launchenv.SLURM_PORT_SPAN))
            except OSError:
                continue
        return job
    pytest.skip("no free port in the SLURM range")


def srun(data, out, job, *extra):
    """What ``srun -n 2 python main.py ...`` starts: two tasks with SLURM's variables, no MASTER_*."""
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE",
                                                                                    "LOCAL_RANK")}
        # SLURM writes host names; a compressed list of loopback addresses stands in for them here
        env.update(slurm_env(rank, SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_JOB_ID=str(job)),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, "main.py", data, "-a", "resnet18", "-b", "8", "-j", "1", "--image-size", "16",
               "--val-resize", "16", "-p", "1", "--seed", "0", "--lr", "0.02", "--epochs", "1",
               "--dist-backend", "gloo", "--output-dir", str(out), *extra]
        # a session each: the signal goes to every process of the task, data workers included, as
        # SLURM sends it
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    return procs


def finish(procs, timeout=180):
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def test_srun_tasks_train_together_and_sigusr1_checkpoints_for_a_requeue(digits, tmp_path):
    # The requeued job, the same command with --resume auto, resumes as tests/test_preemption.py checks.
    job = free_slurm_job_id()
    procs = srun(digits, tmp_path, job)
    head = []
    for line in procs[0].stdout:
        head.append(line)
        if re.match(r"Epoch: \[0\]\[\s*2/", line):
            for p in procs:
                os.killpg(p.pid, signal.SIGUSR1)
            break
    outs = finish(procs)
    out = "".join(head) + outs[0]
    assert [p.returncode for p in procs] == [128 + signal.SIGUSR1] * 2, outs
    assert "SLURM task environment" in out and "rank 0 of 2" in out, out
    assert "stopped by SIGUSR1" in out and "--resume auto" in out, out
    assert "Traceback" not in out + outs[1], outs
    ckpt = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["step_in_epoch"] < 15 and len(ckpt["rng_per_rank"]) == 2

