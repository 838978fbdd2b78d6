"""main.py end to end on one GPU, for tests/test_gpu_runs.py: the runs, started at once as
processes of their own (each spends most of its time compiling), and what they train on.
tests/conftest.py starts them with the session (``training_runs``) where a selected test uses
them, so that they compile beside the tests that run before theirs.

* ``one``: one process, fp32 (TF32 off: the runs compared with it then differ only in the order
  of their additions), with the speed defaults the plain command takes on a GPU;
* ``two``: the same command as two DDP processes sharing the GPU: gloo, and SLURM's task
  variables, under which a task that sees one GPU takes ``cuda:0``;
* ``two-fp16``: those two processes with ``--fp16``;
* ``amp``: one process, ``--amp --compile default``, on synthetic data;
* ``sizes``: one process, ``--fp16`` with the speed defaults (CUDA graphs), on synthetic data whose
  size grows from 32 to 64 px in its last epoch (``--progressive-resize``), validated flip-averaged.
"""

import json
import os
import random
import re
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

from imagenet.models.registry import create_model
from tests.helpers import Children, photo

STEPS, BATCH, SIZE, CLASSES, LR = 5, 32, 32, 4, 0.002
RUNNING_LOSS = re.compile(r"^Epoch: \[0\]\[\s*\d+/\d+\].*\tLoss \S+ \((\S+)\)", re.M)  # the epoch's mean so far


def paired_folder(root: Path, seed: int = 0) -> None:
    """STEPS global batches of training images, BATCH each, in pairs of identical pixels that a
    two-process run's ranks read at the same step, at the same place in their batches; the class
    folders cut the pairs' positions in the order apart, so most pairs have two labels."""
    n = STEPS * BATCH
    order = list(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed))
    pair = [0] * n
    for k in range(n // 2):
        pair[order[2 * k]] = pair[order[2 * k + 1]] = k
    ranks = [list(DistributedSampler(range(n), num_replicas=2, rank=r, shuffle=True, seed=seed)) for r in (0, 1)]
    assert all(pair[a] == pair[b] for a, b in zip(*ranks)), "the sampler no longer interleaves the ranks"
    per_class = n // CLASSES
    assert sum(a // per_class != b // per_class for a, b in zip(*ranks)) > n // 4, "too few pairs differ in label"
    for i in range(n):
        folder = root / "train" / f"c{i // per_class}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(SIZE, SIZE, seed=1000 + pair[i]).save(folder / f"{i:04d}.png")
    for c in range(CLASSES):
        (root / "val" / f"c{c}").mkdir(parents=True)
        photo(SIZE, SIZE, seed=5000 + c).save(root / "val" / f"c{c}" / "0.png")


def _env(**extra) -> dict:
    """This environment on one GPU (the first visible), without any launcher's variables."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in launcher}
    env.update(CUDA_VISIBLE_DEVICES=(os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0],
               NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")  # six processes compile at once
    return dict(env, **extra)


def _train(data: Path, init: Path, out: Path, *extra) -> list:
    return [sys.executable, "main.py", str(data), "-a", "resnet18", "-b", str(BATCH), "--image-size", str(SIZE),
            "--val-resize", str(SIZE), "--min-crop-scale", "1", "--hflip", "0", "--epochs", "1", "-j", "1",
            "-p", "1", "--seed", "0", "--lr", str(LR), "--weights", str(init), "--output-dir", str(out), *extra]


class Runs:
    """The started runs (``Children``) and their output folders."""

    def __init__(self, root: Path, children: Children, init: Path):
        self.root, self.children, self.init = root, children, init

    def output(self, name: str) -> str:
        """A finished process's stdout; it must have succeeded."""
        r = self.children.result(name, timeout=400)
        text = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in text, f"{name}: exit {r.returncode}\n{text[-4000:]}"
        return r.stdout

    def row(self, run: str) -> dict:
        rows = [json.loads(line) for line in open(self.root / run / "metrics.jsonl")]
        assert len(rows) == 1, rows
        return rows[0]

    def losses(self, name: str) -> list:
        return [float(v) for v in RUNNING_LOSS.findall(self.output(name))]

    def updates(self, run: str, keys=None) -> torch.Tensor:
        """The trained weights and biases less the ones the run started from, end to end."""
        start = torch.load(self.init, weights_only=True)
        end = torch.load(self.root / run / "checkpoint.pth.tar", map_location="cpu", weights_only=True)["state_dict"]
        keys = keys or [k for k in start if k.endswith(("weight", "bias"))]
        return torch.cat([(end[k].float() - start[k].float()).flatten() for k in keys])


def _rendezvous_ports(n: int) -> list:
    """``n`` distinct ports free now, below Linux's ephemeral range (from 32768), where no other
    process's connections can take them before the runs' rank 0 listens on them."""
    ports = []
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free port in 20000-31999")


def start(root: Path) -> Runs:
    """Make the data and the starting weights under ``root`` and start every run; returns at once."""
    data, init = root / "pairs", root / "init.pth"
    paired_folder(data)
    torch.manual_seed(0)
    torch.save(create_model("resnet18", CLASSES).state_dict(), init)
    ports = _rendezvous_ports(2)
    children = Children(root / "logs")
    children.start("one", _train(data, init, root / "one", "--no-tf32"), _env())
    for name, port, extra in (("two", ports.pop(), ["--no-tf32"]),
                              ("two-fp16", ports.pop(), ["--fp16", "--initial-loss-scale", "1024"])):
        for rank in (0, 1):
            # a rank whose peer died stops at --dist-timeout instead of waiting for half an hour
            children.start(f"{name}.{rank}",
                           _train(data, init, root / name, *extra, "--dist-backend", "gloo", "--dist-timeout", "180"),
                           _env(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    children.start("amp", [sys.executable, "main.py", "--dummy", "--dummy-train-size", "96", "--dummy-val-size", "32",
                           "--dummy-classes", "10", "-a", "resnet18", "-b", "32", "-j", "0", "--image-size", "32",
                           "--val-resize", "32", "--epochs", "1", "--amp", "--compile", "default",
                           "--output-dir", str(root / "amp")], _env())
    children.start("sizes", [sys.executable, "main.py", "--dummy", "--dummy-train-size", "320", "--dummy-val-size",
                             "72", "--dummy-classes", "10", "-a", "resnet18", "-b", "32", "-j", "0", "--image-size",
                             "64", "--val-resize", "64", "--progressive-resize", "32", "--progressive-ramp", "1:2",
                             "--epochs", "3", "--fp16", "--val-flip", "--output-dir", str(root / "sizes")], _env())
    return Runs(root, children, init)
