"""Tests for checkpoints (imagenet/base/checkpoint.py) and their use by the runner: save, safe load, resume.

Everything runs in-process through ``imagenet.training.runner.main`` on a tiny ImageFolder of
rendered digits (tests/helpers.py), 10 classes x 8 train / 2 val images, 16 px, ResNet-18,
batch 8 (10 steps per epoch). Runs that several tests read are module-scoped fixtures.
"""

import contextlib
import dataclasses
import errno
import filecmp
import io
import json
import os
import pickle
import re
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # no install step: the tests import the package from the checkout
from imagenet.base import checkpoint as ckpt_io  # noqa: E402
from imagenet.base.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from imagenet.cli import main  # noqa: E402
from imagenet.training import runner  # noqa: E402
from tests.helpers import make_digits, scratch  # noqa: E402

TRAIN_PER_CLASS, VAL_PER_CLASS, NUM_CLASSES = 8, 2, 10
CKPT, BEST, METRICS = "checkpoint.pth.tar", "model_best.pth.tar", "metrics.jsonl"
METRIC_KEYS = {"epoch", "lr", "train_loss", "train_acc1", "val_loss", "val_acc1", "val_acc5", "val_samples",
               "img_per_s", "epoch_seconds", "skipped_images"}
CKPT_KEYS = {"state_dict", "optimizer", "scheduler", "epoch", "best_acc1", "rng", "config", "arch"}
ACC_LINE = re.compile(r" \* Acc@1 ([0-9.]+) Acc@5 ([0-9.]+)")


# ------------------------------------------------------------------------------------- helpers


def trainer_args(data, out, *extra, workers=0, batch=8):
    return [str(data), "-a", "resnet18", "-b", str(batch), "-j", str(workers), "--image-size", "16",
            "--val-resize", "16", "-p", "1", "--seed", "0", "--output-dir", str(out), *map(str, extra)]


def run_captured(argv) -> SimpleNamespace:
    """``main(argv)`` with its stdout/stderr captured (usable from module-scoped fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return SimpleNamespace(rc=rc, out=out.getvalue(), err=err.getvalue())


def metrics(out_dir) -> list:
    with open(Path(out_dir) / METRICS) as fh:
        return [json.loads(line) for line in fh]


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def leftovers(folder) -> list:
    """Temp files an interrupted save or probe could leave behind."""
    return sorted(n for n in os.listdir(folder) if n.startswith((".tmp-", ".write-test")))


def snapshot(folder) -> dict:
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)}


def copy_run(src, dst, names=(CKPT, METRICS)) -> Path:
    dst = Path(dst)
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy2(Path(src) / name, dst / name)
    return dst


def assert_same_tensors(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


def assert_same_optimizer(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for idx in a["state"]:
        assert_same_tensors(a["state"][idx], b["state"][idx], f"optimizer state {idx}")


def user_error_line(res) -> str:
    """The one ``error: ...`` line of a failed run; fails if anything else went to stderr."""
    assert res.rc == EXIT_USER_ERROR, (res.rc, res.err[-2000:])
    lines = [ln for ln in res.err.splitlines() if ln.strip() and "UserWarning" not in ln
             and "return Unpickler(" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.err
    return lines[0]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    counts = make_digits(root, TRAIN_PER_CLASS, VAL_PER_CLASS)
    assert counts == {"train": NUM_CLASSES * TRAIN_PER_CLASS, "val": NUM_CLASSES * VAL_PER_CLASS}
    return root


@pytest.fixture(scope="module")
def val_size(data_root) -> int:
    return sum(1 for _ in (data_root / "val").rglob("*.png"))


@pytest.fixture(scope="module")
def base_run(data_root, tmp_path_factory):
    """One epoch from scratch; most tests read (never modify) its output folder."""
    with scratch(tmp_path_factory, "base") as out:
        res = run_captured(trainer_args(data_root, out, "--epochs", 1))
        assert res.rc == 0, res.err[-3000:]
        res.dir = out
        yield res


@pytest.fixture(scope="module")
def straight_run(data_root, tmp_path_factory):
    """Two epochs in one go. ``--resume auto`` in an empty folder must simply start fresh."""
    with scratch(tmp_path_factory, "straight") as out:
        res = run_captured(trainer_args(data_root, out, "--epochs", 2, "--resume", "auto"))
        assert res.rc == 0, res.err[-3000:]
        res.dir = out
        yield res


@pytest.fixture(scope="module")
def five_class_root(data_root, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("five") / "data"
    shutil.copytree(data_root, root)
    for split in ("train", "val"):
        for cls in "56789":
            shutil.rmtree(root / split / cls)
    return root


# ------------------------------------------------------------------------------ what a run writes


def test_one_epoch_writes_checkpoints_and_metrics(base_run, val_size):
    out = base_run.dir
    assert (out / CKPT).is_file() and (out / BEST).is_file() and (out / METRICS).is_file()
    assert leftovers(out) == []
    lines = (out / METRICS).read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert METRIC_KEYS <= rec.keys(), METRIC_KEYS - rec.keys()
    assert rec["epoch"] == 0
    assert rec["val_samples"] == val_size == NUM_CLASSES * VAL_PER_CLASS
    assert rec["train_samples"] == NUM_CLASSES * TRAIN_PER_CLASS  # 80 / 8: no partial batch dropped
    assert rec["skipped_images"] == 0
    assert rec["lr"] == pytest.approx(0.1)
    for k in ("train_loss", "val_loss", "img_per_s", "epoch_seconds"):
        assert isinstance(rec[k], float) and rec[k] == rec[k] and rec[k] >= 0, k  # finite, not NaN
    for k in ("train_acc1", "val_acc1", "val_acc5"):
        assert 0.0 <= rec[k] <= 100.0
    assert rec["val_acc5"] >= rec["val_acc1"]
    assert f" * Acc@1 {rec['val_acc1']:.3f} Acc@5 {rec['val_acc5']:.3f}" in base_run.out


def test_checkpoint_contents(base_run):
    ckpt = load(base_run.dir / CKPT)
    assert CKPT_KEYS <= ckpt.keys(), CKPT_KEYS - ckpt.keys()
    assert ckpt["epoch"] == 1  # the epoch to run next
    assert ckpt["arch"] == "resnet18"
    assert ckpt["best_acc1"] == metrics(base_run.dir)[-1]["val_acc1"]
    state = ckpt["state_dict"]
    assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert all(isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.int64) for v in state.values())
    model = torchvision.models.resnet18(num_classes=NUM_CLASSES)
    model.load_state_dict(state, strict=True)
    # Optimizer/scheduler states load back into fresh objects of the same shape.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt.load_state_dict(ckpt["optimizer"])
    assert len(ckpt["optimizer"]["state"]) == len(list(model.parameters()))  # momentum buffers
    assert ckpt["scheduler"]["last_epoch"] == 10  # stepped once per iteration
    assert type(ckpt["config"]) is dict
    json.dumps(ckpt["config"])  # plain values only
    assert ckpt["config"]["arch"] == "resnet18" and ckpt["config"]["epochs"] == 1
    assert ckpt["config"]["batch_size"] == 8 and ckpt["config"]["seed"] == 0
    assert {"python", "numpy", "torch"} <= ckpt["rng"].keys()
    assert ckpt["num_classes"] == NUM_CLASSES and ckpt["classes"] == [str(d) for d in range(10)]


def test_model_best_matches_checkpoint_after_a_best_epoch(base_run):
    best, last = load(base_run.dir / BEST), load(base_run.dir / CKPT)
    assert best["epoch"] == last["epoch"] == 1
    assert_same_tensors(best["state_dict"], last["state_dict"], "model_best vs checkpoint")
    assert (base_run.dir / BEST).read_bytes() == (base_run.dir / CKPT).read_bytes()  # the same bytes ...
    assert os.stat(base_run.dir / BEST).st_ino != os.stat(base_run.dir / CKPT).st_ino  # ... in a file of its own


def test_model_best_is_a_copy_that_the_next_checkpoint_leaves_alone(tmp_path):
    ckpt_io.save_checkpoint({"epoch": 1}, str(tmp_path), is_best=True)
    assert not os.path.samefile(tmp_path / BEST, tmp_path / CKPT)
    assert (tmp_path / BEST).read_bytes() == (tmp_path / CKPT).read_bytes()
    inode = os.stat(tmp_path / BEST).st_ino
    ckpt_io.save_checkpoint({"epoch": 2}, str(tmp_path), is_best=False)  # a worse epoch
    assert os.stat(tmp_path / BEST).st_ino == inode and load(tmp_path / BEST) == {"epoch": 1}
    assert load(tmp_path / CKPT) == {"epoch": 2}
    assert not os.path.samefile(tmp_path / BEST, tmp_path / ckpt_io.PREVIOUS)
    ckpt_io.save_checkpoint({"epoch": 3}, str(tmp_path), is_best=True)
    assert not os.path.samefile(tmp_path / BEST, tmp_path / CKPT) and load(tmp_path / BEST) == {"epoch": 3}
    assert leftovers(tmp_path) == []


def _full_checkpoint(epoch: int) -> dict:
    return {"state_dict": {"w": torch.full((4,), float(epoch))}, "optimizer": {"state": {}, "param_groups": []},
            "scheduler": {"last_epoch": epoch}, "epoch": epoch, "best_acc1": 50.0, "rng": {}, "config": {},
            "arch": "resnet18"}


def test_rewriting_model_best_in_place_leaves_the_resumable_checkpoint_alone(tmp_path):
    """People strip the optimizer from model_best for a release, writing over the file in place
    (torch.save to its name opens it for writing: the same inode); --resume auto must still find
    the full checkpoint."""
    ckpt_io.save_checkpoint(_full_checkpoint(1), str(tmp_path), is_best=True)
    release = {"state_dict": load(tmp_path / BEST)["state_dict"]}
    inode = os.stat(tmp_path / BEST).st_ino
    with open(tmp_path / BEST, "r+b") as fh:  # in place: the same file, truncated and written again
        fh.truncate(0)
        torch.save(release, fh)
    assert os.stat(tmp_path / BEST).st_ino == inode and load(tmp_path / BEST).keys() == {"state_dict"}
    path = ckpt_io.resolve_resume("auto", str(tmp_path))
    assert path == str(tmp_path / CKPT)
    resumed = ckpt_io.read_checkpoint(path)
    ckpt_io.require_keys(resumed, path, ("state_dict", "optimizer", "epoch"))
    assert resumed["epoch"] == 1 and resumed["scheduler"] == {"last_epoch": 1}
    assert os.stat(tmp_path / BEST).st_ino != os.stat(tmp_path / CKPT).st_ino


def test_a_model_best_left_as_a_hard_link_gets_a_file_of_its_own(tmp_path):
    """A folder written when model_best was a hard link to the checkpoint: the next save (a worse
    epoch, which keeps model_best) parts the two, so neither the checkpoint nor the one before it
    shares model_best's storage."""
    ckpt_io.save_checkpoint({"epoch": 1}, str(tmp_path), is_best=False)
    os.link(tmp_path / CKPT, tmp_path / BEST)  # what the older trainer left
    ckpt_io.save_checkpoint({"epoch": 2}, str(tmp_path), is_best=False)
    assert load(tmp_path / BEST) == {"epoch": 1} and load(tmp_path / CKPT) == {"epoch": 2}
    assert load(tmp_path / ckpt_io.PREVIOUS) == {"epoch": 1}
    inodes = {os.stat(tmp_path / name).st_ino for name in (BEST, CKPT, ckpt_io.PREVIOUS)}
    assert len(inodes) == 3 and leftovers(tmp_path) == []


def _no_hard_links(monkeypatch):
    def link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")  # what some network and FUSE mounts say
    monkeypatch.setattr(ckpt_io.os, "link", link)


def test_saves_work_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    _no_hard_links(monkeypatch)
    ckpt_io.save_checkpoint({"epoch": 1}, str(tmp_path), is_best=True)
    ckpt_io.save_checkpoint({"epoch": 2}, str(tmp_path), is_best=False)
    assert not os.path.samefile(tmp_path / BEST, tmp_path / CKPT)
    assert load(tmp_path / BEST) == {"epoch": 1} and load(tmp_path / CKPT) == {"epoch": 2}
    assert load(tmp_path / ckpt_io.PREVIOUS) == {"epoch": 1}  # a copy of the checkpoint before
    assert leftovers(tmp_path) == []


def _set_best_acc1(path, value: float):
    ckpt = load(path)
    ckpt["best_acc1"] = value
    torch.save(ckpt, path)


def test_model_best_is_kept_after_a_worse_epoch_and_replaced_after_a_better_one(base_run, data_root, tmp_path):
    # The first epoch of a run always writes model_best (see the test above). Whether a later epoch
    # beats the best so far is decided here by editing the recorded best, not by what tiny runs score:
    # 101% cannot be beaten, -1% is beaten by any epoch.
    folder = copy_run(base_run.dir, tmp_path / "run", names=(CKPT, BEST, METRICS))
    best_before = (folder / BEST).read_bytes()
    _set_best_acc1(folder / CKPT, 101.0)
    res = run_captured(trainer_args(data_root, folder, "--epochs", 2, "--resume", "auto"))
    assert res.rc == 0, res.err[-3000:]
    last = load(folder / CKPT)
    assert last["epoch"] == 2 and last["best_acc1"] == 101.0  # the checkpoint moved on ...
    assert (folder / BEST).read_bytes() == best_before  # ... model_best, after a worse epoch, did not
    assert not all(torch.equal(v, load(folder / BEST)["state_dict"][k]) for k, v in last["state_dict"].items())

    _set_best_acc1(folder / CKPT, -1.0)
    res = run_captured(trainer_args(data_root, folder, "--epochs", 3, "--resume", "auto"))
    assert res.rc == 0, res.err[-3000:]
    best, last = load(folder / BEST), load(folder / CKPT)
    assert best["epoch"] == last["epoch"] == 3
    assert_same_tensors(best["state_dict"], last["state_dict"], "model_best vs checkpoint after a better epoch")
    assert best["best_acc1"] == last["best_acc1"] == metrics(folder)[-1]["val_acc1"]


def test_read_checkpoint_returns_the_dict(base_run):
    ckpt = ckpt_io.read_checkpoint(str(base_run.dir / CKPT))
    assert ckpt["epoch"] == 1 and "state_dict" in ckpt


def test_checkpoint_file_mode_follows_umask(base_run):
    umask = os.umask(0)
    os.umask(umask)
    if umask & 0o077 == 0o077:
        pytest.skip("umask already makes files private")
    mode = stat.S_IMODE(os.stat(base_run.dir / CKPT).st_mode)
    assert mode == 0o666 & ~umask, oct(mode)


# ------------------------------------------------------------------------------ --weights loading


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_weights_accept_prefixed_state_dict(base_run, data_root, tmp_path, prefix):
    state = load(base_run.dir / CKPT)["state_dict"]
    prefixed = tmp_path / "prefixed.pth"
    torch.save({prefix + k: v for k, v in state.items()}, prefixed)
    raw = ckpt_io.read_checkpoint(str(prefixed))
    assert all(k.startswith(prefix) for k in raw)
    res = run_captured(trainer_args(data_root, tmp_path / "out", "-e", "--weights", prefixed))
    assert res.rc == 0, res.err[-2000:]
    # Evaluating those weights reproduces the saved run's validation exactly: they really loaded.
    rec = metrics(base_run.dir)[-1]
    assert ACC_LINE.search(res.out).groups() == (f"{rec['val_acc1']:.3f}", f"{rec['val_acc5']:.3f}")


def test_weights_accept_a_dataparallel_checkpoint_of_the_reference_script(base_run, data_root, tmp_path):
    ckpt = load(base_run.dir / CKPT)
    legacy = tmp_path / "legacy.pth.tar"  # pytorch/examples layout, saved from a DataParallel model
    torch.save({"epoch": 1, "arch": "resnet18", "best_acc1": torch.tensor(1.0),
                "state_dict": {"module." + k: v for k, v in ckpt["state_dict"].items()}}, legacy)
    res = run_captured(trainer_args(data_root, tmp_path / "out", "-e", "--weights", legacy))
    assert res.rc == 0, res.err[-2000:]
    rec = metrics(base_run.dir)[-1]
    assert ACC_LINE.search(res.out).group(1) == f"{rec['val_acc1']:.3f}"


# ------------------------------------------------------------------------------------ atomicity


def _crashing_save(exc):
    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + b"\0" * 4096)  # a torn zip: the start of a checkpoint, then death
        raise exc
    return save


@pytest.mark.parametrize("exc, expected", [
    (RuntimeError("simulated crash"), RuntimeError),
    (KeyboardInterrupt(), KeyboardInterrupt),
    (OSError(errno.ENOSPC, "No space left on device"), UserError),
])
def test_crash_during_save_keeps_previous_checkpoint(base_run, tmp_path, monkeypatch, exc, expected):
    folder = copy_run(base_run.dir, tmp_path / "run", names=(CKPT,))
    before = snapshot(folder)
    monkeypatch.setattr(ckpt_io.torch, "save", _crashing_save(exc))
    with pytest.raises(expected):
        ckpt_io.save_checkpoint({"epoch": 99}, str(folder), is_best=True)
    monkeypatch.undo()
    assert snapshot(folder) == before  # same files, sizes and mtimes: nothing torn, nothing left
    assert filecmp.cmp(folder / CKPT, base_run.dir / CKPT, shallow=False)
    assert load(folder / CKPT)["epoch"] == 1


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "copy"])
def test_crash_while_writing_model_best_keeps_both_files_whole(base_run, tmp_path, monkeypatch, links):
    folder = copy_run(base_run.dir, tmp_path / "run", names=(CKPT, BEST))
    if not links:
        _no_hard_links(monkeypatch)
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # death after model_best's new name is made, before it is in place
        if os.path.basename(dst) == BEST:
            raise RuntimeError("crash in the second file")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(ckpt_io.os, "replace", replace)
    with pytest.raises(RuntimeError):
        ckpt_io.save_checkpoint({"epoch": 99}, str(folder), is_best=True)
    monkeypatch.undo()
    assert load(folder / CKPT) == {"epoch": 99}  # the first file was replaced whole
    assert filecmp.cmp(folder / BEST, base_run.dir / BEST, shallow=False)  # the second kept whole
    assert leftovers(folder) == []


class _DiskFullFile(io.RawIOBase):
    """A file on a disk that fills up after ``room`` bytes: writes then fail with ENOSPC."""

    def __init__(self, fd, room=8192):
        self._f = io.FileIO(fd, "wb")  # not os.fdopen: the fixture patches it
        self.room = room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self._f.write(b)

    def fileno(self):
        return self._f.fileno()

    def close(self):
        self._f.close()
        super().close()


@pytest.fixture
def disk_fills_up(monkeypatch):
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        return _DiskFullFile(fd) if "w" in mode else real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(ckpt_io.os, "fdopen", fdopen)


def test_disk_full_during_save_keeps_previous_checkpoint(base_run, tmp_path, disk_fills_up, monkeypatch):
    folder = copy_run(base_run.dir, tmp_path / "run", names=(CKPT,))
    ckpt = load(folder / CKPT)
    with pytest.raises((UserError, RuntimeError)):  # see test_disk_full_during_save_is_a_user_error
        ckpt_io.save_checkpoint(ckpt, str(folder), is_best=False)
    monkeypatch.undo()
    assert filecmp.cmp(folder / CKPT, base_run.dir / CKPT, shallow=False)
    assert leftovers(folder) == []


def test_disk_full_during_save_is_a_user_error(base_run, tmp_path, disk_fills_up):
    folder = copy_run(base_run.dir, tmp_path / "run", names=(CKPT,))
    with pytest.raises(UserError, match="free disk space"):
        ckpt_io.save_checkpoint(load(folder / CKPT), str(folder), is_best=False)


@pytest.mark.parametrize("failing", ["os.replace", "tempfile.mkstemp"])
def test_unwritable_output_dir_during_training_is_a_user_error(base_run, data_root, tmp_path, monkeypatch,
                                                               failing):
    # We run as root, where chmod 0o555 does not stop writes: simulate ENOSPC/EROFS at save time.
    folder = copy_run(base_run.dir, tmp_path / "run")
    before = (folder / CKPT).read_bytes()
    module, name = failing.split(".")
    real = getattr({"os": os, "tempfile": tempfile}[module], name)

    def refuse(*args, **kwargs):
        target = kwargs.get("dir") if name == "mkstemp" else args[1]
        if target is not None and str(folder) in str(target):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr({"os": ckpt_io.os, "tempfile": ckpt_io.tempfile}[module], name, refuse)
    res = run_captured(trainer_args(data_root, folder, "--epochs", 2, "--resume", "auto"))
    monkeypatch.undo()
    line = user_error_line(res)
    assert str(folder) in line and "No space left on device" in line and "intact" in line
    assert (folder / CKPT).read_bytes() == before
    assert load(folder / CKPT)["epoch"] == 1
    assert leftovers(folder) == []


def test_read_only_output_dir_is_a_user_error(base_run, data_root, tmp_path):
    folder = copy_run(base_run.dir, tmp_path / "run")
    before = snapshot(folder)
    os.chmod(folder, 0o555)
    try:
        probe = folder / "probe"
        try:
            probe.write_text("x")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("this user (root?) can write into a 0o555 folder; covered by the simulated test")
        res = run_captured(trainer_args(data_root, folder, "--epochs", 2, "--resume", "auto"))
        line = user_error_line(res)
        assert str(folder) in line
    finally:
        os.chmod(folder, 0o755)
    assert snapshot(folder) == before


# --------------------------------------------------------------------------- refusing bad files


class _Payload:
    """Unpickling this runs a shell command: what a booby-trapped checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def _write_malicious(kind: str, path: Path, marker: Path) -> None:
    if kind == "torch.save":
        torch.save({"state_dict": {"fc.weight": torch.zeros(1)}, "epoch": 1, "optimizer": {},
                    "evil": _Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_Payload(marker), protocol=int(kind.split("-p")[1])))


def test_malicious_payload_is_real(tmp_path):
    """Guard for the test below: unpickling the payload unsafely does run the command."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker), protocol=2))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["pickle-p2", "pickle-p5", "torch.save"])
@pytest.mark.parametrize("flag", ["--resume", "--weights"])
def test_malicious_pickle_is_refused_and_not_executed(data_root, tmp_path, flag, kind):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pth.tar"
    _write_malicious(kind, evil, marker)
    out = tmp_path / "out"
    res = run_captured(trainer_args(data_root, out, "--epochs", 1, flag, evil))
    line = user_error_line(res)
    assert not marker.exists(), "the checkpoint's code ran"
    assert str(evil) in line and "safe loader" in line
    assert not (out / CKPT).exists() and not (out / METRICS).exists()


def test_malicious_pickle_message_names_the_refused_global(data_root, tmp_path):
    evil = tmp_path / "evil.pth.tar"
    _write_malicious("torch.save", evil, tmp_path / "PWNED")
    line = user_error_line(run_captured(trainer_args(data_root, tmp_path / "out", "-e", "--weights", evil)))
    assert "posix.system" in line or "os.system" in line
    assert "Re-running `torch." not in line


@pytest.mark.parametrize("flag", ["--resume", "--weights"])
@pytest.mark.parametrize("kind, needle", [
    ("text", "not a readable PyTorch checkpoint"),
    ("empty", "not a readable PyTorch checkpoint"),
    ("truncated", "not a readable PyTorch checkpoint"),
    ("directory", "is a folder"),
    ("missing", None),
])
def test_unreadable_checkpoint_path_exits_2(base_run, data_root, tmp_path, flag, kind, needle):
    path = tmp_path / f"{kind}.pth.tar"
    if kind == "text":
        path.write_text("epoch: 3\nthis is not a checkpoint\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":  # e.g. a copy that was interrupted
        with open(base_run.dir / CKPT, "rb") as fh:
            path.write_bytes(fh.read(1 << 20))
    elif kind == "directory":
        path.mkdir()
    out = tmp_path / "out"
    line = user_error_line(run_captured(trainer_args(data_root, out, "--epochs", 1, flag, path)))
    assert str(path) in line
    if needle is None:  # the two flags word it differently; both must say it is not there
        needle = "no such file" if flag == "--resume" else "does not exist"
    assert needle in line
    assert not (out / CKPT).exists()


def test_resume_from_a_plain_state_dict_says_use_weights(base_run, data_root, tmp_path):
    plain = tmp_path / "plain.pth"
    torch.save(load(base_run.dir / CKPT)["state_dict"], plain)
    line = user_error_line(run_captured(trainer_args(data_root, tmp_path / "out", "--epochs", 1,
                                                     "--resume", plain)))
    assert str(plain) in line and "--weights" in line


def test_weights_file_without_tensors_exits_2(data_root, tmp_path):
    junk = tmp_path / "junk.pth"
    torch.save({"epoch": 3, "note": "no tensors here"}, junk)
    line = user_error_line(run_captured(trainer_args(data_root, tmp_path / "out", "-e", "--weights", junk)))
    assert str(junk) in line and "state dict" in line


def test_resume_with_another_arch_names_both(base_run, data_root, tmp_path):
    line = user_error_line(run_captured(trainer_args(data_root, tmp_path / "out", "--epochs", 2, "-a",
                                                     "resnet34", "--resume", base_run.dir / CKPT)))
    assert "resnet18" in line and "resnet34" in line and "-a resnet18" in line


def test_resume_on_a_dataset_with_other_classes_exits_2(base_run, five_class_root, tmp_path):
    line = user_error_line(run_captured(trainer_args(five_class_root, tmp_path / "out", "--epochs", 2,
                                                     "--resume", base_run.dir / CKPT)))
    assert "10" in line and "5" in line and "--weights" in line


# ------------------------------------------------------------------------------------------ resume


def test_resume_auto_without_checkpoint_starts_fresh(straight_run, base_run):
    assert "starting fresh" in straight_run.out and "=> resumed" not in straight_run.out
    recs = metrics(straight_run.dir)
    assert [r["epoch"] for r in recs] == [0, 1]
    assert load(straight_run.dir / CKPT)["epoch"] == 2
    # Same seed, same first epoch as the plain one-epoch run: a fresh start is a true fresh start.
    first = metrics(base_run.dir)[0]
    for k in ("train_loss", "train_acc1", "val_loss", "val_acc1"):
        assert recs[0][k] == first[k], k


@pytest.mark.parametrize("how", ["path", "auto"])
def test_resume_continues_exactly(base_run, straight_run, data_root, tmp_path, how):
    folder = copy_run(base_run.dir, tmp_path / "run")
    resume = folder / CKPT if how == "path" else "auto"
    res = run_captured(trainer_args(data_root, folder, "--epochs", 2, "--resume", resume))
    assert res.rc == 0, res.err[-3000:]
    assert "continuing at epoch 1" in res.out
    recs = metrics(folder)
    assert len(recs) == 2 and recs[-1]["epoch"] == 1
    assert recs[0] == metrics(base_run.dir)[0]  # the first epoch's line is kept, not rewritten
    straight = metrics(straight_run.dir)[1]
    for k in ("lr", "train_loss", "train_acc1", "val_loss", "val_acc1", "val_acc5"):
        assert recs[1][k] == straight[k], k
    a, b = load(folder / CKPT), load(straight_run.dir / CKPT)
    assert a["epoch"] == b["epoch"] == 2
    assert_same_tensors(a["state_dict"], b["state_dict"], "resumed vs straight weights")
    assert_same_optimizer(a["optimizer"], b["optimizer"])
    assert a["scheduler"] == b["scheduler"]
    assert a["best_acc1"] == b["best_acc1"]


@pytest.fixture(scope="module")
def tiny_root(data_root, tmp_path_factory) -> Path:
    """2 train / 1 val image per class: two steps per epoch, for the runs with a loader worker."""
    root = tmp_path_factory.mktemp("tiny") / "data"
    shutil.copytree(data_root, root)
    for split, keep in (("train", 2), ("val", 1)):
        for cls in (root / split).iterdir():
            for extra in sorted(cls.iterdir())[keep:]:
                extra.unlink()
    return root


@pytest.fixture(scope="module")
def worker_runs(tiny_root, tmp_path_factory):
    """Straight 2 epochs vs 1 + resumed 1, with one loader worker (persistent workers)."""
    with scratch(tmp_path_factory, "straight_j1", "split_j1") as (straight, split):
        kw = dict(workers=1)
        for argv in (trainer_args(tiny_root, straight, "--epochs", 2, **kw),
                     trainer_args(tiny_root, split, "--epochs", 1, **kw),
                     trainer_args(tiny_root, split, "--epochs", 2, "--resume", "auto", **kw)):
            res = run_captured(argv)
            assert res.rc == 0, res.err[-3000:]
        yield straight, split


def test_resume_with_workers_keeps_epoch_structure(worker_runs):
    straight, split = worker_runs
    assert [r["epoch"] for r in metrics(split)] == [0, 1]
    assert metrics(split)[0]["train_loss"] == metrics(straight)[0]["train_loss"]


def test_resume_with_workers_continues_exactly(worker_runs):
    straight, split = worker_runs
    assert metrics(split)[1]["train_loss"] == metrics(straight)[1]["train_loss"]
    assert_same_tensors(load(split / CKPT)["state_dict"], load(straight / CKPT)["state_dict"],
                        "resumed vs straight weights with -j 1")


def test_resume_of_a_finished_run_trains_nothing_and_writes_nothing(base_run, data_root, tmp_path):
    folder = copy_run(base_run.dir, tmp_path / "run")
    before = snapshot(folder)
    res = run_captured(trainer_args(data_root, folder, "--epochs", 1, "--resume", "auto"))
    assert res.rc == 0, res.err[-2000:]
    assert "nothing left to train" in res.out
    assert snapshot(folder) == before


def test_model_best_written_even_when_accuracy_is_zero(data_root, tmp_path, monkeypatch):
    real_validate = runner.validate

    def zero_accuracy(**kwargs):
        return dataclasses.replace(real_validate(**kwargs), acc1=0.0, acc5=0.0)

    monkeypatch.setattr(runner, "validate", zero_accuracy)
    out = tmp_path / "out"
    res = run_captured(trainer_args(data_root, out, "--epochs", 1))
    assert res.rc == 0, res.err[-2000:]
    assert (out / CKPT).is_file()
    assert (out / BEST).is_file()


def test_prof_leaves_no_checkpoint_to_resume_and_no_metrics_row(data_root, tmp_path):
    """A --prof run trains and validates a few batches of one epoch: a checkpoint of it would say
    the epoch was done (and model_best that a few batches were the best), so --resume auto or an
    elastic restart in that folder would skip the epoch. It writes none, and says so; its row
    goes to prof.jsonl, so the later run's metrics.jsonl has one epoch 0, its own."""
    res = run_captured(trainer_args(data_root, tmp_path, "--epochs", 3, "--prof", 2))
    assert res.rc == 0, res.err[-2000:]
    assert "no checkpoint is written, and the epoch's row goes to prof.jsonl" in res.out
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".pth.tar")]
    assert not (tmp_path / METRICS).exists()
    profiled = [json.loads(line) for line in open(tmp_path / "prof.jsonl")]
    assert [r["epoch"] for r in profiled] == [0] and profiled[0]["steps"] == 2
    res = run_captured(trainer_args(data_root, tmp_path, "--epochs", 1, "--resume", "auto"))
    assert res.rc == 0, res.err[-2000:]
    assert "starting fresh" in res.out and "Epoch: [0][" in res.out
    best, last = load(tmp_path / BEST), load(tmp_path / CKPT)
    assert best["epoch"] == last["epoch"] == 1
    assert [r["epoch"] for r in metrics(tmp_path)] == [0]
    assert best["best_acc1"] == metrics(tmp_path)[-1]["val_acc1"]  # the whole epoch's, not 2 batches'


# ---------------------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize("evaluate, flag", [("-e", "--resume"), ("--evaluate", "--weights")])
def test_evaluate_validates_and_writes_nothing(base_run, data_root, tmp_path, flag, evaluate):
    out = tmp_path / "out"
    before = snapshot(base_run.dir)
    res = run_captured(trainer_args(data_root, out, evaluate, flag, base_run.dir / CKPT))
    assert res.rc == 0, res.err[-2000:]
    rec = metrics(base_run.dir)[-1]
    assert ACC_LINE.search(res.out).groups() == (f"{rec['val_acc1']:.3f}", f"{rec['val_acc5']:.3f}")
    assert "Epoch: [" not in res.out  # no training step
    assert os.listdir(out) == []  # no checkpoint, no metrics
    assert snapshot(base_run.dir) == before


def test_evaluate_returns_the_validation_summary(base_run, data_root, tmp_path, val_size):
    from imagenet.base.config import parse_config
    cfg = parse_config(trainer_args(data_root, tmp_path / "out", "-e", "--resume", base_run.dir / CKPT))
    with contextlib.redirect_stdout(io.StringIO()):
        result = runner.run(cfg)
    rec = metrics(base_run.dir)[-1]
    assert result["val_acc1"] == pytest.approx(rec["val_acc1"])
    assert result["val_loss"] == pytest.approx(rec["val_loss"], rel=1e-5)
    assert result["val_samples"] == val_size
