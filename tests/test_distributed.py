"""Multi-process tests of the trainer on the CPU with gloo: DDP end to end, DDP/single-process
parity, a rank killed mid-run, a two-node simulation, the one-line startup errors, torchrun.

Everything runs as subprocesses, the way users start the trainer, on a tiny ImageFolder
(rendered digits, 4 per class per split) at 16 px with ResNet-18 and ``-j 0``. Children get
``OMP_NUM_THREADS=1`` and no GPU (``CUDA_VISIBLE_DEVICES=""``), so the file stays fast on two
cores and behaves the same on a GPU machine. Every output (logs, checkpoints, rendezvous files)
goes under pytest's tmp_path, never into the checkout.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torchvision

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from imagenet.parallel.distributed import free_port  # noqa: E402
from tests.helpers import make_digits, scratch  # noqa: E402

PER_CLASS = 4  # -> 40 train images (5 global batches of 8), 40 val images before one is removed
N_CLASSES = 10
TINY = ["-a", "resnet18", "-j", "0", "--image-size", "16", "--val-resize", "16", "--seed", "0"]
# Environment variables of a surrounding launcher (a CI job under torchrun or SLURM) that would
# turn a plain `python main.py` child into a DDP rank.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "TORCHELASTIC_RUN_ID")


# ----------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """An ImageFolder: 40 train images, and an ODD number (39) of val images, so that a val
    set split over 2 ranks can only come out exact if nothing is padded or dropped."""
    root = tmp_path_factory.mktemp("digits_tiny")
    counts = make_digits(root, PER_CLASS, PER_CLASS)
    assert counts == {"train": N_CLASSES * PER_CLASS, "val": N_CLASSES * PER_CLASS}
    first = sorted((root / "val" / "0").iterdir())[0]
    first.unlink()
    n_val = sum(1 for p in (root / "val").rglob("*.png"))
    assert n_val == counts["val"] - 1 and n_val % 2 == 1
    return {"root": root, "n_train": counts["train"], "n_val": n_val}


def child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NCCL_NVLS_ENABLE", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def multiproc(*args):
    return [sys.executable, "-m", "multiproc", *map(str, args)]


def main_py(*args):
    return [sys.executable, "main.py", *map(str, args)]


def run(cmd, env=None, timeout=120):
    """subprocess.run, except that a timeout also ends the launcher's ranks, which live in
    sessions of their own and would outlive a plain kill of the launcher."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in children(p.pid):
            kill_group_quietly(pid)
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... still running after {timeout}s:\n{out}{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def alive(pid):
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def env_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def kill_group_quietly(pid):
    """Cleanup after a failed assertion: multiproc's ranks run in sessions of their own
    (pgid == pid, which also reaches DataLoader workers); torchrun's do not."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def read_metrics(out_dir):
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------- 1. two ranks, end to end

@pytest.fixture(scope="module")
def ddp_epoch(dataset, tmp_path_factory):
    """One epoch of two ranks through the launcher: (the launcher's result, the output folder,
    the log folder). Run once; a test that writes into the output folder works on a copy."""
    with scratch(tmp_path_factory, "ddp_epoch") as base:
        out, logs = base / "out", base / "logs"
        r = run(multiproc("--nproc-per-node", 2, "--log-dir", logs, "main.py", dataset["root"], *TINY,
                          "-b", 8, "--epochs", 1, "--dist-backend", "gloo", "--output-dir", out))
        yield r, out, logs


def test_two_rank_ddp_run_end_to_end(dataset, ddp_epoch):
    r, out, logs = ddp_epoch
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr

    # rank 0 owns the terminal: the banner names the mode, the reference script's summary line
    assert "DistributedDataParallel" in r.stdout
    assert "rank 0 of 2" in r.stdout
    assert "global 8, per device 4 (2 processes)" in r.stdout
    assert " * Acc@1" in r.stdout

    # rank 1 writes to LOG_DIR/GPU_1.log, and nothing alarming in it
    rank1_log = logs / "GPU_1.log"
    assert rank1_log.is_file()
    assert "Traceback" not in rank1_log.read_text()

    # the val set (odd size) is evaluated exactly once over the two ranks: no padding, no dropping
    records = read_metrics(out)
    assert len(records) == 1, "metrics.jsonl must be written by rank 0 only, once per epoch"
    rec = records[0]
    assert rec["val_samples"] == dataset["n_val"]
    assert rec["train_samples"] == dataset["n_train"]  # 40 = 5 full global batches of 8
    assert rec["mode"] == "ddp" and rec["world_size"] == 2

    # one checkpoint, written by rank 0 only (atomic write: no temp files left behind), that
    # loads into a plain torchvision ResNet-18 without the DDP 'module.' prefix
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pth.tar", "config.yaml", "metrics.jsonl",
                                                     "model_best.pth.tar"]
    ckpt = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1
    assert not any(k.startswith("module.") for k in ckpt["state_dict"])
    model = torchvision.models.resnet18(num_classes=N_CLASSES)
    model.load_state_dict(ckpt["state_dict"], strict=True)


def test_ddp_ranks_skip_validations_and_stop_at_the_target_together(dataset, tmp_path):
    """--eval-start 1: epoch 0 is not validated (no collective of validation's on any rank); the
    target is reached at epoch 1's validation as soon as one image of 39 is right, which every rank
    learns from the same all-reduced sums: all stop there, none waits on a peer."""
    out = tmp_path / "out"
    r = run(multiproc("--nproc-per-node", 2, "--log-dir", tmp_path / "logs", "main.py", dataset["root"], *TINY,
                      "-b", 8, "--epochs", 4, "--eval-start", 1, "--target-acc", 1.01, "--dist-backend", "gloo",
                      "--output-dir", out))
    assert r.returncode == 0, r.stdout + r.stderr
    records = read_metrics(out)
    assert [(x["epoch"], x["val_acc1"] is None) for x in records] == [(0, True), (1, False)], records
    assert records[1]["seconds_to_target"] == records[1]["run_seconds"]
    assert records[1]["val_samples"] == dataset["n_val"]
    assert "--target-acc 1.01 reached after epoch 1" in r.stdout


# ------------------------------------------------------------ 2. DDP == one process, same batch

PARITY_DRIVER = r'''
"""Train 3 steps through the package's own pieces; rank 0 saves the weights.

Run plainly this is a single CPU process (DistContext mode 'cpu', batch 8); under
`python -m multiproc --nproc-per-node 2` it is DDP with 4 images per rank.
"""
import dataclasses
import sys
import torch
import torch.nn as nn
from torchvision import transforms

sys.path.insert(0, sys.argv[1])
from imagenet.parallel import distributed
from imagenet.base.config import parse_config
from imagenet.data.loaders import DataBundle, build_loaders
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from imagenet.training.engine import LoopOptions, train_one_epoch
from imagenet.models.registry import create_model
from imagenet.precision import build_precision
from imagenet.training.state import Progress, TrainState

data_dir, out_path, steps = sys.argv[2], sys.argv[3], int(sys.argv[4])  # argv[5]: lr
cfg = parse_config([data_dir, "-a", "resnet18", "-b", "8", "-j", "0", "--lr", sys.argv[5],
                    "--dist-backend", "gloo", "--seed", "0"])
ctx = distributed.setup(cfg)  # 'ddp' under the launcher, 'cpu' without it


def per_sample_norm(module):
    """BatchNorm -> GroupNorm (32 channels a group). DDP keeps BatchNorm statistics per rank, so
    with real BatchNorm 2 ranks x 4 images differ from 1 x 8 by design, not by a bug; GroupNorm
    normalises each image on its own, so a batch's split over ranks cannot change the math.
    (Frozen/eval BatchNorm would do too in principle, but an un-normalised ResNet-18 at 16 px
    diverges within 3 steps, which would amplify rounding far beyond the tolerance.)"""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, nn.GroupNorm(max(child.num_features // 32, 1), child.num_features))
        else:
            per_sample_norm(child)


# No randomness in the transform: both runs must feed bit-identical images.
tf = transforms.Compose([transforms.Resize(16), transforms.ToTensor(),
                         transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
train = SafeImageFolder(data_dir + "/train", tf)
val = SafeImageFolder(data_dir + "/val", tf)
data = DataBundle(train, val, train.classes, data_dir)
train_loader, _ = build_loaders(cfg, data, ctx, seed=0)

torch.manual_seed(0)
model = create_model("resnet18", len(train.classes))
per_sample_norm(model)
initial = {k: v.clone() for k, v in model.state_dict().items()}

precision = build_precision(cfg, ctx.device)
model = precision.prepare_model(model)
optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: 1.0)
model = distributed.wrap(model, ctx)
train_loader.sampler.set_epoch(0)
state = TrainState(model, optimizer, scheduler, precision, nn.CrossEntropyLoss(), nn.CrossEntropyLoss())
result = train_one_epoch(state=state, progress=Progress(), loader=train_loader, ctx=ctx,
                         opts=LoopOptions(print_freq=1000, progress="lines", max_steps=steps))
result = dataclasses.asdict(result)
if ctx.is_main:
    torch.save({"final": precision.model_state_dict(model), "initial": initial, "result": result,
                "mode": ctx.mode, "world_size": ctx.world_size}, out_path)
# The DDP wrapper (its reducer) must go before its process group, as it does in runner.run,
# where the model is a local of _run; a module-level DDP outliving destroy_process_group
# aborts at interpreter exit ("terminate called without an active exception").
del model, optimizer, scheduler, state
distributed.cleanup(ctx)
'''


def test_ddp_two_ranks_match_one_process(dataset, tmp_path):
    driver = tmp_path / "parity_driver.py"
    driver.write_text(PARITY_DRIVER)
    steps, lr = 3, 0.05
    single, ddp = tmp_path / "single.pt", tmp_path / "ddp.pt"

    def args(out):
        return [driver, REPO, dataset["root"], out, steps, lr]

    with ThreadPoolExecutor(2) as pool:  # both at once: each is mostly its processes' start-up
        one = pool.submit(run, [sys.executable, *map(str, args(single))])
        two = pool.submit(run, multiproc("--nproc-per-node", 2, "--log-dir", tmp_path, *args(ddp)))
        r = one.result()
        assert r.returncode == 0, r.stdout + r.stderr
        r = two.result()
        assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "GPU_1.log").read_text()

    a = torch.load(single, weights_only=True)
    b = torch.load(ddp, weights_only=True)
    assert (a["mode"], a["world_size"]) == ("cpu", 1)
    assert (b["mode"], b["world_size"]) == ("ddp", 2)
    for res in (a["result"], b["result"]):
        assert res["steps"] == steps and res["samples"] == 8 * steps
        assert math.isfinite(res["loss"])
    # the reduced training loss is the same mean over the same 24 images
    assert a["result"]["loss"] == pytest.approx(b["result"]["loss"], rel=1e-5)
    # Same starting point (seeded initialisation in both runs) ...
    for k in a["initial"]:
        assert torch.equal(a["initial"][k], b["initial"][k]), k
    # ... and training really moved the weights, so the comparison below means something.
    moved = max((a["final"][k] - a["initial"][k]).abs().max().item() for k in a["final"]
                if a["final"][k].is_floating_point())
    assert moved > 1e-3

    # The same global batches (DistributedSampler with world 1 vs 2 and one seed: rank r takes
    # positions r, r+2, ... of the same permutation, so step k of both runs holds the same 8
    # images) must give the same weights up to fp32 rounding. DDP averages two per-rank
    # gradients of 4 images each while the single process reduces all 8 at once, so only the
    # order of the floating-point sums differs: ~1e-7 relative per gradient element (fp32 eps is
    # 6e-8). Through lr 0.05 and 3 momentum steps that is ~1e-7 absolute on weights of ~1e-1..1
    # (measured: 1.2e-7). 1e-5 leaves room for other summation orders (another CPU, other
    # thread counts) and is still orders of magnitude below what a real mistake produces: the
    # updates here are up to ~0.5 (asserted > 1e-3 above), so a gradient summed instead of
    # averaged over ranks, or a step on other images, shows up as differences of that order.
    worst = {k: (a["final"][k] - b["final"][k]).abs().max().item() for k in a["final"]
             if a["final"][k].is_floating_point()}
    key = max(worst, key=worst.get)
    assert worst[key] < 1e-5, f"{key} differs by {worst[key]:.3e}"


# --------------------------------------------------------------------- 3. a rank killed mid-run

def test_killed_rank_stops_the_launcher(dataset, tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    stdout = open(tmp_path / "launcher.out", "w")
    launcher = subprocess.Popen(
        multiproc("--nproc-per-node", 2, "--log-dir", logs, "--grace-period", 5, "main.py",
                  dataset["root"], *TINY, "-b", 8, "--epochs", 1000, "--lr", "0.01",
                  "--dist-backend", "gloo", "--output-dir", out),
        cwd=REPO, env=child_env(), stdout=stdout, stderr=subprocess.STDOUT)
    stdout.close()
    ranks = {}
    try:
        # Rank 1 logs only warnings, so wait for rank 0's first epoch record: by then both
        # ranks are inside the training loop (every step all-reduces gradients between them).
        deadline = time.monotonic() + 90
        while not (out / "metrics.jsonl").exists():
            assert launcher.poll() is None, (tmp_path / "launcher.out").read_text()
            assert time.monotonic() < deadline, "training never finished an epoch"
            time.sleep(0.2)
        for pid in children(launcher.pid):
            ranks[int(env_of(pid)["RANK"])] = pid
        assert sorted(ranks) == [0, 1]

        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        try:
            status = launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("launcher still running 30 s after rank 1 was killed")
        took = time.monotonic() - t0
        text = (tmp_path / "launcher.out").read_text()
        assert status != 0, text
        # Normally 137 (rank 1, SIGKILL). Rank 0 sees gloo's "connection reset" and exits 1 by
        # itself soon after; when both deaths fall in one poll of the launcher, it names rank 0.
        assert status in (128 + signal.SIGKILL, 1), text
        assert "exited with status" in text
        assert took < 30
        # rank 0 (the terminal) says which rank it lost in one line, not in gloo's traceback
        assert "Traceback" not in text, text
        assert len([ln for ln in error_lines(text) if ln.startswith("error: rank 1 died during a collective")]) == 1, \
            text
        time.sleep(0.5)
        left = [pid for pid in ranks.values() if alive(pid)]
        assert not left, f"rank processes still running: {left}"
    finally:
        for pid in ranks.values():
            kill_group_quietly(pid)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# ---------------------------------------------------------------- 4. two nodes on one machine

def test_two_node_simulation(dataset, tmp_path):
    port = free_port()
    procs, outs = [], []
    for node in (0, 1):
        out = tmp_path / f"out{node}"
        outs.append(out)
        log = open(tmp_path / f"node{node}.out", "w")
        procs.append(subprocess.Popen(
            multiproc("--nnodes", 2, "--node-rank", node, "--nproc-per-node", 1,
                      "--master-addr", "127.0.0.1", "--master-port", port,
                      "--log-dir", tmp_path / f"logs{node}", "main.py", dataset["root"], *TINY,
                      "-b", 8, "--epochs", 1, "--dist-backend", "gloo", "--dist-timeout", 60,
                      "--output-dir", out),
            cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT))
        log.close()
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    assert codes == [0, 0], texts
    assert "world size 2" in texts[0] and "world size 2" in texts[1]
    assert "rank 0 of 2" in texts[0]
    # only global rank 0 (node 0) writes metrics and checkpoints
    records = read_metrics(outs[0])
    assert len(records) == 1 and records[0]["world_size"] == 2
    assert records[0]["val_samples"] == dataset["n_val"]
    assert not (outs[1] / "metrics.jsonl").exists()
    assert not (outs[1] / "checkpoint.pth.tar").exists()


# ---------------------------------------------------------------------- 5. one-line errors

def _case_nccl(data, tmp):
    cmd = multiproc("--nproc-per-node", 2, "--log-dir", tmp, "main.py", data, *TINY, "-b", 8,
                    "--epochs", 1, "--dist-backend", "nccl", "--output-dir", tmp / "out")
    return cmd, {}, ["nccl", "gloo"]


def _case_batch_does_not_divide(data, tmp):
    cmd = multiproc("--nproc-per-node", 2, "--log-dir", tmp, "main.py", data, *TINY, "-b", 7,
                    "--epochs", 1, "--dist-backend", "gloo", "--output-dir", tmp / "out")
    return cmd, {}, ["-b/--batch-size 7", "multiple of 2"]


def _case_rank_without_world(data, tmp):
    return main_py(data, *TINY, "-b", 8, "--output-dir", tmp / "out"), {"RANK": "0"}, \
        ["RANK", "WORLD_SIZE"]


def _case_rank_outside_world(data, tmp):
    cmd = main_py(data, *TINY, "-b", 8, "--world-size", 2, "--rank", 5,
                  "--dist-url", f"tcp://127.0.0.1:{free_port()}", "--dist-backend", "gloo",
                  "--output-dir", tmp / "out")
    return cmd, {}, ["rank 5", "world-size 2"]


def _case_master_unreachable(data, tmp):
    port = free_port()  # nothing listens there
    env = {"RANK": 1, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    cmd = main_py(data, *TINY, "-b", 8, "--dist-backend", "gloo", "--dist-timeout", 3,
                  "--output-dir", tmp / "out")
    return cmd, env, [f"127.0.0.1:{port}"]


def _case_stale_rendezvous_file(data, tmp):
    path = tmp / "rendezvous"
    path.write_text("")
    old = time.time() - 600
    os.utime(path, (old, old))
    cmd = main_py(data, *TINY, "-b", 8, "--world-size", 2, "--rank", 0, "--dist-url", f"file://{path}",
                  "--dist-backend", "gloo", "--dist-timeout", 10, "--output-dir", tmp / "out")
    return cmd, {}, [str(path)]


def _case_mp_distributed_without_gpu(data, tmp):
    cmd = main_py(data, *TINY, "-b", 8, "--multiprocessing-distributed", "--output-dir", tmp / "out")
    return cmd, {}, ["multiproc"]


ERROR_CASES = {
    "nccl-without-gpu": _case_nccl,
    "batch-does-not-divide": _case_batch_does_not_divide,
    "rank-without-world-size": _case_rank_without_world,
    "rank-outside-world": _case_rank_outside_world,
    "master-unreachable": _case_master_unreachable,
    "stale-file-rendezvous": _case_stale_rendezvous_file,
    "mp-distributed-without-gpu": _case_mp_distributed_without_gpu,
}


# timed against its --dist-timeout: run on its own, not beside the others
TIMED_CASES = ("master-unreachable",)


@pytest.fixture(scope="module")
def startup_errors(dataset, tmp_path_factory):
    """Every error case but the timed ones, all started at once (each spends seconds importing
    torch before its one line): case -> (the process, its folder, what its line names)."""
    started = {}
    try:
        for case, make in ERROR_CASES.items():
            if case not in TIMED_CASES:
                tmp = tmp_path_factory.mktemp(case)
                cmd, env, needles = make(dataset["root"], tmp)
                proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(**env), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                started[case] = (proc, tmp, needles)
        yield started
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                for pid in children(proc.pid):
                    kill_group_quietly(pid)
                proc.kill()
                proc.communicate()


def _finished(proc, cmd_name: str, timeout: int = 90) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd_name} still running after {timeout}s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_startup_errors_are_one_line_exit_2(case, dataset, tmp_path, request):
    t0 = time.monotonic()
    if case in TIMED_CASES:
        cmd, env, needles = ERROR_CASES[case](dataset["root"], tmp_path)
        r = run(cmd, env=child_env(**env), timeout=60)
    else:
        proc, tmp_path, needles = request.getfixturevalue("startup_errors")[case]
        r = _finished(proc, case)
    took = time.monotonic() - t0
    text = r.stdout + r.stderr
    rank1_log = tmp_path / "GPU_1.log"
    if rank1_log.exists():
        text_all = text + rank1_log.read_text()
    else:
        text_all = text
    assert r.returncode == 2, text_all
    assert "Traceback" not in text_all
    # One `error:` line on the terminal. Under the launcher each rank reports the same mistake,
    # rank 1 into its log; the launcher may stop rank 0 before it prints when rank 1 is faster,
    # so the one line is on the terminal or, failing that, in GPU_1.log.
    errors = error_lines(text)
    assert len(errors) <= 1, text
    if not errors:
        errors = error_lines(rank1_log.read_text() if rank1_log.exists() else "")
    assert len(errors) == 1, text_all
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    if case == "master-unreachable":
        assert took < 15, f"took {took:.1f}s with --dist-timeout 3"


# ------------------------------------------------------------------------------ 6. torchrun

def test_torchrun_runs_the_trainer(dataset, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "main.py", str(dataset["root"]), *TINY, "-b", "8",
           "--epochs", "1", "--dist-backend", "gloo", "--output-dir", str(out)]
    r = run(cmd, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DistributedDataParallel" in r.stdout and "rank 0 of 2" in r.stdout
    records = read_metrics(out)
    assert len(records) == 1
    assert records[0]["val_samples"] == dataset["n_val"]
    assert records[0]["world_size"] == 2


# ------------------------------------------- 7. an unreadable batch on one rank (bad-file policy)

def test_unreadable_batch_on_one_rank_is_skipped_not_fatal(dataset, tmp_path):
    """DESIGN: 'A corrupt image inside a dataset is skipped, counted and reported, never fatal.'
    Corrupt exactly the 4 images that rank 1 draws for its first step (the same
    DistributedSampler, seed and epoch as data.build_loaders), so that rank has nothing to train
    on at step 0 while rank 0 has a full batch."""
    from torch.utils.data.distributed import DistributedSampler
    from imagenet.data.images.folder import SafeImageFolder

    root = tmp_path / "data"
    shutil.copytree(dataset["root"], root)
    train = SafeImageFolder(str(root / "train"))
    sampler = DistributedSampler(train, num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(0)
    corrupted = sorted(train.samples[i][0] for i in list(sampler)[:4])
    for path in corrupted:
        Path(path).write_bytes(b"not a png")

    out = tmp_path / "out"
    r = run(multiproc("--nproc-per-node", 2, "--log-dir", tmp_path, "--grace-period", 2, "main.py",
                      root, *TINY, "-b", 8, "--epochs", 1, "--dist-backend", "gloo",
                      "--dist-timeout", 10, "--max-bad-fraction", 0.5, "--output-dir", out),
            timeout=90)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rec = read_metrics(out)[0]
    assert rec["skipped_images"] == 4
    assert rec["train_samples"] == dataset["n_train"] - 4
    # rank 0 writes the list, with the paths rank 1 met
    listed = [line.split("\t")[1] for line in (out / "skipped_images.txt").read_text().splitlines()]
    assert sorted(listed) == corrupted
    assert rec["val_samples"] == dataset["n_val"]


# ------------------------------------------- 8. a checkpoint from N processes resumes on M

def test_two_rank_checkpoint_resumes_in_one_process(dataset, ddp_epoch, tmp_path):
    r, ddp_out, _ = ddp_epoch
    assert r.returncode == 0, r.stdout + r.stderr
    out = shutil.copytree(ddp_out, tmp_path / "out")
    r = run(main_py(dataset["root"], *TINY, "-b", 8, "--epochs", 2, "--resume", "auto", "--output-dir", out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed" in r.stdout and "continuing at epoch 1" in r.stdout
    records = read_metrics(out)
    assert [(x["epoch"], x["mode"], x["world_size"]) for x in records] == [(0, "ddp", 2), (1, "cpu", 1)]
    assert records[1]["val_samples"] == dataset["n_val"]


# ------------------------------------------- 9. the environments that select DDP

def test_launch_environments_are_read_like_torchrun_and_slurm():
    from imagenet.base.config import Config
    from imagenet.base.launchenv import distributed_env
    from imagenet.base.errors import UserError
    cfg = Config()
    assert distributed_env(cfg, {}) is None
    assert distributed_env(cfg, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # a plain sbatch job
    got = distributed_env(cfg, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (got["rank"], got["world_size"], got["local_rank"]) == (3, 4, 1)
    got = distributed_env(cfg, {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"})
    assert (got["rank"], got["world_size"], got["local_rank"]) == (5, 8, 1)
    got = distributed_env(Config(world_size=2, rank=1, dist_url="tcp://127.0.0.1:1234"), {})
    assert (got["rank"], got["world_size"]) == (1, 2)
    for bad in ({"RANK": "0"}, {"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "2"}):
        with pytest.raises(UserError):
            distributed_env(cfg, bad)
    with pytest.raises(UserError, match="--rank"):
        distributed_env(Config(world_size=2, dist_url="tcp://127.0.0.1:1234"), {})


def test_an_error_on_rank_0_alone_stops_every_rank_with_a_message(dataset, tmp_path):
    """Only rank 0 writes the output dir: when it cannot, the other rank must not wait in (or
    crash out of) DDP's first collective, but stop with a line saying where the reason is."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output folder should go")
    logs = tmp_path / "logs"
    r = run(multiproc("--nproc-per-node", 2, "--log-dir", logs, "main.py", dataset["root"], *TINY,
                      "-b", 8, "--epochs", 1, "--dist-backend", "gloo", "--output-dir", blocker / "out"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--output-dir" in r.stderr and "is not writable" in r.stderr
    rank1 = (logs / "GPU_1.log").read_text()
    assert "rank 0 could not start" in rank1 and "the terminal" in rank1
    assert "Traceback" not in r.stdout + r.stderr + rank1


# ------------------------------------------- 10. the model validated is the model saved

EVAL_SPY = r'''
"""main.py, saving the BatchNorm statistics of every model this rank validates (before it does)."""
import os
import sys

import torch

sys.path.insert(0, sys.argv[1])
from imagenet.base.wrappers import unwrap
from imagenet.cli import main
from imagenet.training import runner

real_validate, spy_dir = runner.validate, sys.argv[2]


def validate(**kwargs):
    stats = {k: v.detach().clone() for k, v in unwrap(kwargs["model"]).state_dict().items() if "running_" in k}
    which = "ema" if kwargs.get("name") else "model"
    torch.save(stats, os.path.join(spy_dir, f"{which}-rank{os.environ['RANK']}.pt"))
    return real_validate(**kwargs)


runner.validate = validate
sys.exit(main(sys.argv[3:]))
'''


def test_every_rank_validates_the_model_the_checkpoint_holds(dataset, tmp_path):
    """Each rank's BatchNorm statistics come from its own batches; validation and the checkpoint
    must see the same ones (the ranks' average), for the model and for the weight average, so
    that -e on the checkpoint reproduces the epoch's Acc@1."""
    driver, spy, out = tmp_path / "eval_spy.py", tmp_path / "spy", tmp_path / "out"
    driver.write_text(EVAL_SPY)
    spy.mkdir()
    r = run(multiproc("--nproc-per-node", 2, "--log-dir", tmp_path, driver, REPO, spy, dataset["root"], *TINY,
                      "-b", 8, "--lr", 0.02, "--epochs", 1, "--model-ema", "0.9", "--dist-backend", "gloo",
                      "--output-dir", out))
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "GPU_1.log").read_text()
    ckpt = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    for which, saved in (("model", ckpt["state_dict"]), ("ema", ckpt["state_dict_ema"])):
        for rank in (0, 1):
            evaluated = torch.load(spy / f"{which}-rank{rank}.pt", weights_only=True)
            assert evaluated, which
            differ = [k for k, v in evaluated.items() if not torch.equal(v, saved[k])]
            assert not differ, f"rank {rank} validated other {which} statistics than saved: {differ[:3]}"
    # main.py -e on the checkpoint, in one process, with its result (the loss too) on the last line
    evaluate = ("import json, sys; sys.path.insert(0, sys.argv[1]); from imagenet.base.config import parse_config; "
                "from imagenet.training.runner import run; print(json.dumps(run(parse_config(sys.argv[2:]))))")
    r = run([sys.executable, "-c", evaluate, str(REPO), str(dataset["root"]), *TINY, "-b", "8", "-e", "--resume",
             str(out / "checkpoint.pth.tar"), "--output-dir", str(tmp_path / "eval")])
    assert r.returncode == 0, r.stdout + r.stderr
    got, rec = json.loads(r.stdout.splitlines()[-1]), read_metrics(out)[0]
    assert got["val_samples"] == rec["val_samples"] == dataset["n_val"]
    assert (got["val_acc1"], got["val_acc5"]) == pytest.approx((rec["val_acc1"], rec["val_acc5"]))
    # the same sums in another order (two shards, one process): fp32 rounding only
    assert got["val_loss"] == pytest.approx(rec["val_loss"], rel=1e-5)


@pytest.mark.parametrize("message, is_timeout", [
    ("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to complete", True),
    ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete", True),
    ("[gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure", True),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)", True),
    ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41213", False),
    ("DataLoader worker (pid 123) exited unexpectedly", False),
])
def test_a_collective_timeout_is_told_in_one_line(message, is_timeout):
    """The backends' ways of saying a peer never answered (seen in tests/test_multiproc.py's
    stalled rank), told as the run's --dist-timeout; any other error keeps its traceback."""
    from imagenet.parallel.distributed import collective_timeout
    line = collective_timeout(RuntimeError(message), 30)
    if is_timeout:
        assert line.startswith("a collective operation timed out after 30 s waiting for a peer (--dist-timeout 30)")
    else:
        assert line is None


GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
GLOO_HINT = ". This is typically caused by a remote worker crashing. Check the logs of the remote worker."


@pytest.mark.parametrize("message, world, rank, line", [
    (f"{GLOO}Connection closed by peer [127.0.0.1]:23442{GLOO_HINT}", 2, 0,
     "rank 1 died during a collective operation (its connection closed); its output (GPU_1.log under "
     "python -m multiproc) and the launcher say why"),
    (f"{GLOO}Read error [127.0.0.1]:21133: Connection reset by peer{GLOO_HINT}", 2, 1,
     "rank 0 died during a collective operation (its connection closed); its output (the terminal under "
     "python -m multiproc) and the launcher say why"),
    (f"{GLOO}Connection closed by peer [10.0.0.7]:23442{GLOO_HINT}", 4, 0,
     "another rank died during a collective operation (the connection to 10.0.0.7:23442 closed); "
     "python -m multiproc names it and says how"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
     "NCCL version 2.21.5 ncclRemoteError: A call failed possibly due to a network error or a remote process "
     "exiting prematurely.", 2, 0, "rank 1 died during a collective operation"),
    ("DataLoader worker (pid 123) exited unexpectedly", 2, 0, None),
    ("Connection reset by peer", 2, 0, None),  # not from a collective
])
def test_a_dead_peer_is_told_in_one_line(message, world, rank, line):
    """A peer killed mid-run (SIGKILL, out of memory) breaks the next collective: one line naming
    the rank that died where the group has two, instead of the backend's traceback; status 1 as
    for a stalled peer (main's execute)."""
    from imagenet.parallel.distributed import DistContext, PeerFailure, peer_failure
    ctx = DistContext("ddp", torch.device("cpu"), "test", rank=rank, world_size=world, backend="gloo")
    failure = peer_failure(RuntimeError(message), ctx, 30)
    if line is None:
        assert failure is None
    else:
        assert isinstance(failure, PeerFailure) and str(failure).startswith(line) and "\n" not in str(failure)
    timeout = peer_failure(RuntimeError("Timed out waiting 30000ms for recv operation to complete"), ctx, 30)
    assert str(timeout).startswith("a collective operation timed out after 30 s")
