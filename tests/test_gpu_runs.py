"""main.py end to end on one GPU with the speed defaults its plain command takes there
(channels_last, the Triton max-pool and BatchNorm kernels, torch.compile with CUDA graphs). Each
run is a process of its own and all start at once, since each spends most of its time compiling:

* ``one``: one process, fp32 (TF32 off: the runs compared with it then differ only in the order
  of their additions);
* ``two``: the same command as two DDP processes sharing the GPU: gloo, and SLURM's task
  variables, under which a task that sees one GPU takes ``cuda:0``;
* ``two-fp16``: those two processes with ``--fp16``;
* ``amp``: one process, ``--amp --compile default``, on synthetic data.

The DDP runs must train as the one-process run does. Their training images come in pairs of
identical pixels that the sampler hands to rank 0 and to rank 1 at the same step (each crop the
whole image, no flips), under labels that mostly differ: every rank's BatchNorm statistics are
then those of the global batch, as in the one-process run, while the ranks' gradients differ. A
rank that missed the all-reduce, or gradients averaged wrongly, change the weights' updates by
30-150% (measured with these runs on a CPU); reordered additions changed them by under 2%.
"""

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from imagenet.models.registry import create_model
from imagenet.parallel.distributed import free_port
from tests.helpers import Children, photo, scratch

pytestmark = pytest.mark.gpu

STEPS, BATCH, SIZE, CLASSES, LR = 5, 32, 32, 4, 0.002
SPEED_DEFAULTS = ("channels_last", "stem max-pool on Triton kernels", "BatchNorm + add + ReLU fused in Triton",
                  "torch.compile with CUDA graphs (reduce-overhead)")
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
    """The module's runs (``Children``) and their output folders."""

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with scratch(tmp_path_factory, "gpu_runs") as root:
        data, init = root / "pairs", root / "init.pth"
        paired_folder(data)
        torch.manual_seed(0)
        torch.save(create_model("resnet18", CLASSES).state_dict(), init)
        ports = set()
        while len(ports) < 2:
            ports.add(free_port())
        children = Children(root / "logs")
        try:
            children.start("one", _train(data, init, root / "one", "--no-tf32"), _env())
            for name, port, extra in (("two", ports.pop(), ["--no-tf32"]),
                                      ("two-fp16", ports.pop(), ["--fp16", "--initial-loss-scale", "1024"])):
                for rank in (0, 1):
                    children.start(f"{name}.{rank}",
                                   _train(data, init, root / name, *extra, "--dist-backend", "gloo"),
                                   _env(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            children.start("amp", [sys.executable, "main.py", "--dummy", "--dummy-train-size", "96",
                                   "--dummy-val-size", "32", "--dummy-classes", "10", "-a", "resnet18", "-b", "32",
                                   "-j", "0", "--image-size", "32", "--val-resize", "32", "--epochs", "1", "--amp",
                                   "--compile", "default", "--output-dir", str(root / "amp")], _env())
            yield Runs(root, children, init)
        finally:
            children.stop()


def _took_the_speed_defaults(banner: str) -> None:
    for what in SPEED_DEFAULTS:
        assert re.search(rf"^=> default: {re.escape(what)}: ", banner, re.M), f"no '{what}' line:\n{banner[-3000:]}"
    assert "=> first step done" in banner


def test_two_processes_on_one_gpu_train_as_one_with_the_speed_defaults(runs):
    one, two = runs.output("one"), runs.output("two.0")
    runs.output("two.1")  # rank 1 logs warnings only: it ended well
    _took_the_speed_defaults(one)
    _took_the_speed_defaults(two)
    assert "=> mode: single cuda:0" in one and "=> mode: DistributedDataParallel, rank 0 of 2 (gloo, cuda:0)" in two
    row = runs.row("two")
    # both ranks' images: the totals are summed over the ranks
    assert (row["world_size"], row["steps"], row["train_samples"]) == (2, STEPS, STEPS * BATCH), row
    a, b = runs.losses("one"), runs.losses("two.0")
    assert len(a) == len(b) == STEPS and b == pytest.approx(a, rel=5e-3), (a, b)
    ua, ub = runs.updates("one"), runs.updates("two")
    assert float((ub - ua).norm() / ua.norm()) < 0.1


def test_fp16_under_ddp_trains_as_fp32_does_within_fp16s_rounding(runs):
    """The two processes in fp16 (masters in fp32, a dynamic loss scale low enough that no step
    overflows) against the one fp32 process: the first step's loss (the forward alone), the
    classifier's bias (whose gradient goes through no BatchNorm, where fp16 rounding grows: the
    other weights' updates are tens of percents apart in fp16) and the loss's course."""
    two = runs.output("two-fp16.0")
    runs.output("two-fp16.1")
    _took_the_speed_defaults(two)
    assert "=> precision: fp16, loss scale 1024 (dynamic)" in two
    row = runs.row("two-fp16")
    assert (row["world_size"], row["steps"], row["skipped_steps"]) == (2, STEPS, 0), row
    a, b = runs.losses("one"), runs.losses("two-fp16.0")
    assert len(b) == STEPS and b[0] == pytest.approx(a[0], rel=5e-3) and b == pytest.approx(a, rel=0.05), (a, b)
    ua, ub = runs.updates("one", ["fc.bias"]), runs.updates("two-fp16", ["fc.bias"])
    assert float((ub - ua).norm() / ua.norm()) < 0.2


def test_mixed_precision_trains_with_the_kernels_under_compile_default(runs):
    out = runs.output("amp")
    assert "=> kernels: stem max-pool on Triton kernels; BatchNorm + add + ReLU fused in Triton" in out
    assert "=> compile: torch.compile default" in out
    row = runs.row("amp")
    assert row["steps"] == 3 and math.isfinite(row["train_loss"]) and row["val_samples"] == 32, row
