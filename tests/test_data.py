"""Tests for datasets, layout checks, the bad-file policy, samplers and loaders (imagenet/data/)."""

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets.folder import default_loader

from imagenet.base.config import Config
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.images.folder import SafeImageFolder, check_layout
from imagenet.data.loaders import DataBundle, build_datasets, build_loaders, collate_skipping, per_process_batch
from imagenet.data.samplers import ShardSampler
from imagenet.data.synthetic import SyntheticDataset
from imagenet.parallel.distributed import DistContext
from tests.helpers import scratch

REPO = Path(__file__).resolve().parents[1]
_rng = np.random.default_rng(0)


# ------------------------------------------------------------------------------------ helpers


def save_image(path: Path, size: int = 8, fmt: str = "PNG") -> Path:
    """A real image of random pixels, written by PIL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = _rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, fmt)
    return path


def make_split(root: Path, split: str, classes: dict, size: int = 8) -> None:
    """``root/split/<class>/<i>.png|jpg`` with ``classes[class]`` images each (PNG and JPEG mixed)."""
    (root / split).mkdir(parents=True, exist_ok=True)
    for name, n in classes.items():
        (root / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            if i % 2:
                save_image(root / split / name / f"{i}.JPEG", size, "JPEG")
            else:
                save_image(root / split / name / f"{i}.png", size, "PNG")


def truncated_jpeg(path: Path, size: int = 16) -> Path:
    """The first half of a real JPEG: PIL reads the header, then fails decoding."""
    buf = io.BytesIO()
    Image.fromarray(_rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def assert_one_line_error(rc: int, stdout: str, stderr: str) -> str:
    assert rc == 2, f"exit {rc}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:"), stderr
    return lines[0]


# ------------------------------------------------------------------------------- layout cases
#
# Each case builds a tree under ``base`` and returns the DIR to pass, plus fragments the one-line
# message must contain.


def _missing_dir(base):
    return base / "no-such-folder", ["does not exist"]


def _dir_is_file(base):
    path = base / "imagenet.tar"
    path.write_bytes(b"not a folder")
    return path, ["is a file"]


def _missing_train(base):
    make_split(base, "val", {"cat": 1, "dog": 1})
    return base, ["train", "missing"]


def _missing_val(base):
    make_split(base, "train", {"cat": 1, "dog": 1})
    return base, ["val", "missing"]


def _flat_val(base):
    make_split(base, "train", {"cat": 1, "dog": 1})
    for i in range(3):
        save_image(base / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", fmt="JPEG")
    return base, ["scripts/prepare_imagenet_val.py", "class folders"]


def _empty_val(base):
    make_split(base, "train", {"cat": 1, "dog": 1})
    (base / "val").mkdir()
    (base / "val" / "README.txt").write_text("no images here")
    return base, ["val", "no class folders"]


def _empty_train_class(base):
    make_split(base, "train", {"cat": 1, "dog": 1, "zebra": 0})
    make_split(base, "val", {"cat": 1, "dog": 1, "zebra": 1})
    return base, ["train/", "zebra", "no images"]


def _class_mismatch(base):
    make_split(base, "train", {"cat": 1, "dog": 1, "otter": 1})
    make_split(base, "val", {"cat": 1, "dog": 1, "heron": 1})
    return base, ["same class folders", "otter", "heron"]


LAYOUT_CASES = {
    "missing-dir": _missing_dir,
    "dir-is-file": _dir_is_file,
    "missing-train": _missing_train,
    "missing-val": _missing_val,
    "flat-val": _flat_val,
    "empty-val": _empty_val,
    "empty-train-class": _empty_train_class,
    "class-mismatch": _class_mismatch,
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_check_layout_errors(tmp_path, case):
    root, fragments = LAYOUT_CASES[case](tmp_path)
    with pytest.raises(UserError) as exc:
        check_layout(str(root))
    msg = str(exc.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert "\n" not in msg


def test_check_layout_good_tree_returns_classes(tmp_path):
    make_split(tmp_path, "train", {"b": 2, "a": 1})
    make_split(tmp_path, "val", {"a": 1, "b": 1})
    (tmp_path / "train" / ".DS_Store").write_text("")  # stray files next to class folders are fine
    assert check_layout(str(tmp_path)) == ["a", "b"]


def test_check_layout_accepts_images_in_nested_folders(tmp_path):
    make_split(tmp_path, "val", {"a": 1})
    save_image(tmp_path / "train" / "a" / "sub" / "0.png")
    assert check_layout(str(tmp_path)) == ["a"]


def _cfg(**over):
    """The real config at tiny sizes, with ``over`` replacing fields."""
    base = dict(image_size=8, val_resize=8, min_crop_scale=0.5, batch_size=2, workers=0)
    return dataclasses.replace(Config(), **{**base, **over})


@pytest.mark.parametrize("hidden_images", [0, 1])
def test_hidden_folder_in_train_does_not_break_labels(tmp_path, hidden_images):
    make_split(tmp_path, "train", {"cat": 2, "dog": 2, ".ipynb_checkpoints": hidden_images})
    make_split(tmp_path, "val", {"cat": 1, "dog": 1})
    try:
        data = build_datasets(_cfg(), str(tmp_path))
    except UserError:
        return  # refusing the layout with a clear message would be fine too
    assert data.train.classes == data.classes == data.val.classes == ["cat", "dog"]


# --------------------------------------------------------------------------- unreadable images


@pytest.fixture
def mixed_folder(tmp_path):
    """An ImageFolder with good images and three kinds of unreadable file in both classes."""
    root = tmp_path / "mixed"
    good, bad = [], []
    for cls in ("a", "b"):
        good.append(save_image(root / cls / "good0.png"))
        good.append(save_image(root / cls / "good1.jpg", fmt="JPEG"))
        good.append(save_image(root / cls / "good2.png"))
    empty = root / "a" / "empty.jpg"
    empty.write_bytes(b"")
    bad.append(empty)
    bad.append(truncated_jpeg(root / "b" / "truncated.jpg"))
    text = root / "a" / "notes.png"
    text.write_text("this is not a PNG\n")
    bad.append(text)
    for path in bad:  # the premise: PIL really cannot read these
        with pytest.raises(Exception):
            default_loader(str(path))
    return root, [str(p) for p in good], [str(p) for p in bad]


def test_safe_image_folder_item_for_a_bad_file(mixed_folder):
    root, good, bad = mixed_folder
    ds = SafeImageFolder(str(root), transforms.ToTensor())
    by_path = {p: i for i, (p, _) in enumerate(ds.samples)}
    image, target, path = ds[by_path[bad[0]]]
    assert image is None and path == bad[0] and target == ds.class_to_idx["a"]
    image, target, path = ds[by_path[good[0]]]
    assert isinstance(image, torch.Tensor) and image.shape == (3, 8, 8) and path is None


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_skips_unreadable_files_and_reports_them(mixed_folder, workers):
    root, good, bad = mixed_folder
    ds = SafeImageFolder(str(root), transforms.ToTensor())
    assert len(ds) == len(good) + len(bad)
    loader = DataLoader(ds, batch_size=3, shuffle=False, num_workers=workers, collate_fn=collate_skipping)
    n_images, targets, skipped = 0, [], []
    for images, batch_targets, batch_skipped in loader:
        assert images.shape[0] == batch_targets.shape[0]
        if images.numel():
            assert images.shape[1:] == (3, 8, 8)
        n_images += images.shape[0]
        targets += batch_targets.tolist()
        skipped += batch_skipped
    assert n_images == len(good)
    assert sorted(skipped) == sorted(bad)
    expected_targets = [t for p, t in ds.samples if p not in bad]
    assert targets == expected_targets


def test_collate_of_an_all_bad_batch():
    images, targets, skipped = collate_skipping([(None, 0, "x.jpg"), (None, 1, "y.jpg")])
    assert images.numel() == 0 and targets.numel() == 0 and targets.dtype == torch.long
    assert skipped == ["x.jpg", "y.jpg"]


def test_collate_keeps_order_of_good_samples():
    a, b = torch.zeros(3, 2, 2), torch.ones(3, 2, 2)
    images, targets, skipped = collate_skipping([(a, 4, None), (None, 1, "bad.png"), (b, 2, None)])
    assert torch.equal(images, torch.stack([a, b]))
    assert targets.tolist() == [4, 2]
    assert skipped == ["bad.png"]


# ------------------------------------------------------------------------ samplers and batches


def test_shard_sampler_covers_every_index_once_without_padding():
    shards = [list(ShardSampler(10, rank, 3)) for rank in range(3)]
    assert [len(ShardSampler(10, rank, 3)) for rank in range(3)] == [len(s) for s in shards] == [4, 3, 3]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(10))
    assert len(flat) == len(set(flat)) == 10


def test_shard_sampler_world_of_one_and_short_dataset():
    assert list(ShardSampler(5, 0, 1)) == [0, 1, 2, 3, 4]
    assert [list(ShardSampler(2, r, 3)) for r in range(3)] == [[0], [1], []]


def test_per_process_batch():
    ddp3 = DistContext("ddp", torch.device("cpu"), "test", world_size=3)
    assert per_process_batch(12, ddp3) == 4
    with pytest.raises(UserError) as exc:
        per_process_batch(256, ddp3)
    assert "256" in str(exc.value) and "3" in str(exc.value)
    # Single process and DataParallel: the whole global batch.
    assert per_process_batch(256, DistContext("cpu", torch.device("cpu"), "test")) == 256


def _ctx(distributed=False, world_size=1, rank=0):
    return DistContext("ddp" if distributed else "cpu", torch.device("cpu"), "test", rank=rank, world_size=world_size)


def _bundle(n_train, n_val=4):
    return DataBundle(SyntheticDataset(n_train, 2, 8), SyntheticDataset(n_val, 2, 8), ["0", "1"], "synthetic")


def test_build_loaders_refuses_a_train_set_smaller_than_one_batch():
    with pytest.raises(UserError, match="batch"):
        build_loaders(_cfg(batch_size=8), _bundle(5), _ctx(), seed=0)


def test_build_loaders_refuses_a_shard_smaller_than_one_batch():
    # 7 images over 2 ranks: 3 per rank, fewer than the per-process batch of 8 // 2 = 4.
    with pytest.raises(UserError, match="batch"):
        build_loaders(_cfg(batch_size=8), _bundle(7), _ctx(True, 2, 0), seed=0)


def test_build_loaders_shapes():
    train, val = build_loaders(_cfg(batch_size=4), _bundle(10, 5), _ctx(), seed=0)
    assert len(train) == 2  # the partial last training batch is dropped
    assert len(val) == 2  # validation keeps every image
    assert sum(len(t) for _, t, _ in val) == 5
    images, targets, skipped = next(iter(train))
    assert images.shape == (4, 3, 8, 8) and targets.shape == (4,) and skipped == []


class _Images(torch.utils.data.Dataset):
    """n 8x8 images through the file loaders' path (workers, collate, DeviceLoader)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        return torch.full((3, 8, 8), float(index)), index % 2, None


def test_dummy_batches_are_made_once_on_the_device_and_never_pass_through_workers(monkeypatch):
    def no_workers(*args, **kwargs):
        raise AssertionError("--dummy made a DataLoader")
    monkeypatch.setattr("imagenet.data.loaders.DataLoader", no_workers)
    train, val = build_loaders(_cfg(batch_size=4, workers=2), _bundle(10, 5), _ctx(), seed=0)
    batches = list(train)
    assert len(train) == len(batches) == 2  # the partial last training batch is dropped, as with files
    assert all(b[0] is batches[0][0] for b in batches)  # the same device tensor every step
    assert [len(t) for _, t, _ in val] == [4, 1]
    train.set_start(4)  # a mid-epoch resume skips the batches done
    assert len(train) == 1 and len(list(train)) == 1


def test_gpu_decode_prepares_batches_in_a_background_thread():
    files = DataBundle(_Images(10), _Images(5), ["0", "1"], "tensors")
    for decode, background in (("cpu", False), ("gpu", True)):
        train, val = build_loaders(_cfg(batch_size=4, decode=decode), files, _ctx(), seed=0)
        assert train.background is background and val.background is background
        assert sum(len(t) for _, t, _ in val) == 5


# ------------------------------------------------------------------------------ the real CLI


TINY = ["-a", "resnet18", "-b", "4", "--epochs", "1", "-j", "0", "--image-size", "16", "--val-resize", "16",
        "--print-freq", "1", "--seed", "0"]


def _main_py(*argv):
    # One thread each: these runs go concurrently on a small machine.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "main.py", *map(str, argv)], cwd=REPO, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _tiny_tree_with_a_bad_image(root: Path) -> str:
    # 3 good + 1 bad in one class, 4 in the other: 8 files make exactly 2 batches of 4, so the
    # training loader (which drops a partial last batch) reads every file, the bad one included.
    make_split(root, "train", {"cat": 3, "dog": 4}, size=16)
    make_split(root, "val", {"cat": 2, "dog": 2}, size=16)
    return str(truncated_jpeg(root / "train" / "cat" / "broken.JPEG"))


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Start both runs of main.py at once (each start imports torch), then collect them."""
    tolerance = {"e2e-tolerant": "0.5", "e2e-strict": "0"}
    with scratch(tmp_path_factory, *tolerance) as bases:  # the runs' checkpoints
        procs, info = {}, {}
        for (name, fraction), base in zip(tolerance.items(), bases):
            bad = _tiny_tree_with_a_bad_image(base / "data")
            out = base / "out"
            procs[name] = _main_py(base / "data", *TINY, "--output-dir", out, "--max-bad-fraction", fraction)
            info[name] = (bad, out)
        results = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            results[name] = (proc.returncode, stdout, stderr)
        yield results, info


def test_an_in_process_run_leaves_no_data_worker_behind(tmp_path, monkeypatch):
    """Persistent workers (-j N) live as long as their DataLoader: run() ends them when it ends,
    also when it ends in an exception its caller keeps (the traceback holds the run's frames, and
    with them the loaders), not the garbage collector (off here: it runs when it likes)."""
    import gc
    import multiprocessing
    from imagenet.base.config import parse_config
    from imagenet.training.runner import run
    from tests.helpers import interrupt_after_step, make_digits, resnet18_args
    make_digits(tmp_path / "data", train_per_class=2, val_per_class=1)  # 2 steps of 8
    cfg = parse_config(resnet18_args(tmp_path / "data", tmp_path / "out", "--epochs", 1, "-p", 100, "-j", 1))
    gc.collect()
    gc.disable()
    try:
        assert run(cfg)["epochs_run"] == 1
        assert multiprocessing.active_children() == []
        interrupt_after_step(monkeypatch, 1)
        with pytest.raises(KeyboardInterrupt) as stopped:
            run(cfg)
        assert stopped.value and multiprocessing.active_children() == []
    finally:
        gc.enable()


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_cli_layout_error_is_one_line_exit_2(tmp_path, capsys, case):
    """Through the command line's entry in this process (main.py as a process: the e2e-strict run
    below ends on a user error the same way)."""
    root, fragments = LAYOUT_CASES[case](tmp_path / "data" if case not in ("missing-dir", "dir-is-file") else tmp_path)
    rc = main([str(root), "--epochs", "1", "-j", "0", "-b", "4", "--image-size", "16", "--val-resize", "16",
               "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    line = assert_one_line_error(rc, captured.out, captured.err)
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


def test_cli_end_to_end_skips_and_reports_an_unreadable_image(cli_runs):
    results, info = cli_runs
    rc, stdout, stderr = results["e2e-tolerant"]
    assert rc == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert "Traceback" not in stderr
    bad, out = info["e2e-tolerant"]
    assert "Epoch: [0]" in stdout and " * Acc@1" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1
    assert records[0]["epoch"] == 0
    assert records[0]["skipped_images"] >= 1
    listed = [line.split("\t", 1)[1] for line in (out / "skipped_images.txt").read_text().splitlines()]
    assert listed and all(os.path.samefile(p, bad) for p in listed)
    assert (out / "checkpoint.pth.tar").is_file()


def test_cli_end_to_end_stops_past_max_bad_fraction(cli_runs):
    results, info = cli_runs
    line = assert_one_line_error(*results["e2e-strict"])
    assert "--max-bad-fraction" in line


def test_the_flat_val_hint_is_a_command_the_script_takes(tmp_path):
    """The hint for the official flat val folder names a command line prepare_imagenet_val.py
    accepts as it stands (it once gave a --ground-truth flag the script does not have)."""
    import shlex
    import subprocess
    import sys
    base, _ = _flat_val(tmp_path / "ds")
    with pytest.raises(UserError) as exc:
        check_layout(str(base))
    command = str(exc.value).split("sort it into class folders with: ")[1].split(" (or")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "scripts/prepare_imagenet_val.py"]
    (tmp_path / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{i:08d},n01440764 1 2 3 4\n" for i in range(3)))
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / argv[1]), *argv[2:], "--dry-run"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
