"""The bad-file policy, file kind by file kind, for both data pipelines and through the real CLI.

Policy (DESIGN.md): empty, truncated, non-image, CMYK, grayscale, PNG-named-.JPEG, huge
(decompression-bomb) and unreadable-permission files inside train/ or val/ are skipped or
converted, counted per epoch in metrics.jsonl and listed in OUTPUT_DIR/skipped_images.txt, never
fatal; the run stops with one clear error only past --max-bad-fraction.
"""

import dataclasses
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from PIL import Image
from torchvision.datasets.folder import default_loader

from imagenet.base.config import Config
from imagenet.data.decode import TrainDecoder, ValDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.loaders import build_datasets
from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD, train_transform, val_transform
from tests.helpers import scratch

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
ROOT_REASON = "running as root: a mode-000 file is still readable, so it cannot be made unreadable"

SIZE, RESIZE = 16, 20  # unit-level crop and validation resize


# ------------------------------------------------------------------------------------ the corpus


def _pixels(w: int = 64, h: int = 48, seed: int = 0) -> np.ndarray:
    # A smooth gradient plus a little noise: JPEG-friendly and different in every channel.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // (w + h - 2)], -1)
    return np.clip(img + rng.integers(-8, 9, img.shape), 0, 255).astype(np.uint8)


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def bomb_png(side: int = 20000) -> bytes:
    """A real, valid 1-bit PNG of side x side pixels (400 M > 2 x PIL's MAX_IMAGE_PIXELS): ~50 KB
    on disk, so PIL refuses it at open time with DecompressionBombError."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    comp = zlib.compressobj(9)
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


_BOMB = None


def _bomb_bytes() -> bytes:
    global _BOMB
    if _BOMB is None:
        _BOMB = bomb_png()
    return _BOMB


def _rgb(seed: int = 0) -> Image.Image:
    return Image.fromarray(_pixels(seed=seed))


# name -> bytes; every kind a real dataset may hold
def convertible_files(seed: int = 0) -> dict:
    rgb = _rgb(seed)
    rgba = rgb.convert("RGBA")
    rgba.putalpha(128)
    return {
        "good.JPEG": _encoded(rgb, "JPEG"),
        "cmyk.JPEG": _encoded(rgb.convert("CMYK"), "JPEG"),
        "gray.JPEG": _encoded(rgb.convert("L"), "JPEG"),
        "gray.png": _encoded(rgb.convert("L"), "PNG"),
        "palette.png": _encoded(rgb.convert("P"), "PNG"),
        "rgba.png": _encoded(rgba, "PNG"),
        "png_named.JPEG": _encoded(rgb, "PNG"),  # PNG bytes behind a .JPEG name
    }


def unreadable_files(seed: int = 0) -> dict:
    whole = _encoded(_rgb(seed), "JPEG")
    return {
        "empty.JPEG": b"",
        "truncated.JPEG": whole[: len(whole) // 2],
        "not_an_image.jpg": b"this is a text file, not a JPEG\n" * 4,
        "bomb.png": _bomb_bytes(),
    }


NOPERM = "noperm.JPEG"
CONVERTED = list(convertible_files())
SKIPPED = list(unreadable_files())
GRAY = ("gray.JPEG", "gray.png")


def write_files(folder: Path, files: dict) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in files.items():
        (folder / name).write_bytes(data)
        paths.append(folder / name)
    return paths


def write_noperm(folder: Path, seed: int = 0) -> Path:
    path = folder / NOPERM
    path.write_bytes(_encoded(_rgb(seed), "JPEG"))
    path.chmod(0)
    return path


def test_corpus_premises():
    """The corpus is what it claims: PIL sees the kinds we mean, and cannot read the bad ones."""
    modes = {n: Image.open(io.BytesIO(b)).mode for n, b in convertible_files().items()}
    assert modes == {"good.JPEG": "RGB", "cmyk.JPEG": "CMYK", "gray.JPEG": "L", "gray.png": "L",
                     "palette.png": "P", "rgba.png": "RGBA", "png_named.JPEG": "RGB"}
    assert Image.open(io.BytesIO(convertible_files()["png_named.JPEG"])).format == "PNG"
    for name, data in unreadable_files().items():
        with pytest.raises(Exception):
            with Image.open(io.BytesIO(data)) as img:
                img.load()
    with pytest.raises(PIL.Image.DecompressionBombError):
        Image.open(io.BytesIO(_bomb_bytes()))


# ------------------------------------------------------------------------------------ unit level


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``root/{train,val}/c/<every kind>``: one class, the same files in both splits."""
    root = tmp_path_factory.mktemp("corpus")
    for split in ("train", "val"):
        folder = root / split / "c"
        write_files(folder, {**convertible_files(), **unreadable_files()})
        if not IS_ROOT:
            write_noperm(folder)
    yield root
    for split in ("train", "val"):  # let pytest clean up
        p = root / split / "c" / NOPERM
        if p.exists():
            p.chmod(0o644)


def _cfg(pipeline: str, draft: bool = True) -> Config:
    return dataclasses.replace(Config(), data_pipeline=pipeline, no_jpeg_draft=not draft, image_size=SIZE,
                               val_resize=RESIZE)


PIPELINES = [("fast", True), ("fast", False), ("classic", True)]
PIPELINE_IDS = ["fast", "fast-nodraft", "classic"]


def _item(ds: SafeImageFolder, name: str, seed: int = 1234):
    index = [os.path.basename(p) for p, _ in ds.samples].index(name)
    return ds[(index, seed)], ds.samples[index]


def _check_converted(image, pipeline: str, name: str) -> None:
    if pipeline == "fast":
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8, (name, type(image))
        assert tuple(image.shape) == (SIZE, SIZE, 3), (name, image.shape)
        rgb = image.float()
    else:
        assert isinstance(image, torch.Tensor) and image.dtype == torch.float32, (name, image.dtype)
        assert tuple(image.shape) == (3, SIZE, SIZE), (name, image.shape)
        mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        rgb = ((image * std + mean) * 255).permute(1, 2, 0)
    if name in GRAY:  # converted by replication: R == G == B
        assert torch.allclose(rgb[..., 0], rgb[..., 1], atol=1e-3) and torch.allclose(rgb[..., 1], rgb[..., 2],
                                                                                       atol=1e-3), name
    else:  # a colour image stayed in colour (a CMYK file read as if RGB would not be gray either,
        # but it would be nowhere near the original: the mean colour is checked below)
        assert (rgb[..., 0] - rgb[..., 2]).abs().max() > 1, name


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("pipeline,draft", PIPELINES, ids=PIPELINE_IDS)
def test_convertible_kinds_decode_to_three_channels(corpus, pipeline, draft, split):
    data = build_datasets(_cfg(pipeline, draft), str(corpus))
    ds = data.train if split == "train" else data.val
    for name in CONVERTED:
        (image, target, bad), (path, _) = _item(ds, name)
        assert bad is None, f"{name} was skipped in {pipeline}/{split}"
        assert target == 0
        _check_converted(image, pipeline, name)


@pytest.mark.parametrize("pipeline,draft", PIPELINES, ids=PIPELINE_IDS)
def test_cmyk_is_converted_to_the_right_colours(corpus, pipeline, draft):
    # Validation is deterministic: a CMYK file must come out close to its RGB twin.
    data = build_datasets(_cfg(pipeline, draft), str(corpus))
    (good, _, _), _ = _item(data.val, "good.JPEG")
    (cmyk, _, _), _ = _item(data.val, "cmyk.JPEG")
    assert (good.float() - cmyk.float()).abs().mean() < (12 if pipeline == "fast" else 0.2)


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("pipeline,draft", PIPELINES, ids=PIPELINE_IDS)
def test_unreadable_kinds_are_skipped(corpus, pipeline, draft, split):
    data = build_datasets(_cfg(pipeline, draft), str(corpus))
    ds = data.train if split == "train" else data.val
    for name in SKIPPED + ([] if IS_ROOT else [NOPERM]):
        (image, target, bad), (path, _) = _item(ds, name)
        assert image is None, f"{name} was not skipped in {pipeline}/{split}"
        assert bad == path and target == 0


@pytest.mark.skipif(IS_ROOT, reason=ROOT_REASON)
@pytest.mark.parametrize("pipeline,draft", PIPELINES, ids=PIPELINE_IDS)
def test_permission_denied_file_is_skipped(corpus, pipeline, draft):
    data = build_datasets(_cfg(pipeline, draft), str(corpus))
    for ds in (data.train, data.val):
        (image, _, bad), (path, _) = _item(ds, NOPERM)
        assert image is None and bad == path


@pytest.mark.parametrize("pipeline,draft", PIPELINES, ids=PIPELINE_IDS)
def test_file_that_cannot_be_opened_is_skipped(tmp_path, pipeline, draft):
    # Root-proof stand-in for an unreadable file: a dangling symlink (open() raises OSError).
    for split in ("train", "val"):
        write_files(tmp_path / split / "c", {"good.JPEG": _encoded(_rgb(), "JPEG")})
        os.symlink(tmp_path / "gone.JPEG", tmp_path / split / "c" / "dangling.JPEG")
    data = build_datasets(_cfg(pipeline, draft), str(tmp_path))
    for ds in (data.train, data.val):
        (image, _, bad), (path, _) = _item(ds, "dangling.JPEG")
        assert image is None and bad == path


def _datasets_as_built(root: Path, pipeline: str) -> list:
    """SafeImageFolder(root, transform, loader=...) for both splits, as build_datasets makes them."""
    if pipeline == "fast":
        pairs = [(TrainDecoder(SIZE, 0.08, 0.5), path_identity), (ValDecoder(SIZE, RESIZE), path_identity)]
    else:
        pairs = [(train_transform(SIZE, 0.08, 0.5), default_loader), (val_transform(SIZE, RESIZE), default_loader)]
    return [SafeImageFolder(str(root), tf, loader=loader) for tf, loader in pairs]


@pytest.mark.parametrize("pipeline", ["fast", "classic"])
def test_decompression_bomb_below_the_patched_limit_is_skipped(tmp_path, monkeypatch, pipeline):
    # 64 x 48 = 3072 pixels > 2 x 1000: PIL raises DecompressionBombError at open time.
    files = {"small_bomb.png": _encoded(_rgb(), "PNG"), "small_bomb.JPEG": _encoded(_rgb(), "JPEG")}
    write_files(tmp_path / "c", files)
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)
    for ds in _datasets_as_built(tmp_path, pipeline):
        for name in files:
            (image, _, bad), (path, _) = _item(ds, name)
            assert image is None and bad == path, name


@pytest.mark.parametrize("pipeline", ["fast", "classic"])
def test_real_decompression_bomb_is_skipped_not_fatal(tmp_path, pipeline):
    write_files(tmp_path / "c", {"bomb.png": _bomb_bytes(), "good.JPEG": _encoded(_rgb(), "JPEG")})
    for ds in _datasets_as_built(tmp_path, pipeline):
        (image, _, bad), (path, _) = _item(ds, "bomb.png")
        assert image is None and bad == path
        (image, _, bad), _ = _item(ds, "good.JPEG")
        assert image is not None and bad is None


def test_fast_decoders_called_with_a_path():
    """The decoders themselves: converted kinds give uint8 HWC with 3 channels; bad kinds raise
    (SafeImageFolder turns the exception into a skip)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        paths = write_files(Path(d), {**convertible_files(), **unreadable_files()})
        decoders = [TrainDecoder(SIZE, 0.08, 0.5), ValDecoder(SIZE, RESIZE)]
        for path in paths:
            for dec in decoders:
                if path.name in CONVERTED:
                    out = dec(str(path))
                    assert out.dtype == torch.uint8 and tuple(out.shape) == (SIZE, SIZE, 3), path.name
                else:
                    with pytest.raises(Exception):
                        dec(str(path))


# ------------------------------------------------------------------------------------ end to end

BATCH = 4


def make_tree(root: Path) -> tuple:
    """2 classes; train/ and val/ each mix good, convertible and unreadable files. Each split's
    size is a multiple of the batch, so the training loader (drop_last) visits every file.
    Returns (converted paths, unreadable paths, n_train, n_val)."""
    converted, bad, counts = [], [], {}
    for split in ("train", "val"):
        n = 0
        a = root / split / "a"
        converted += write_files(a, convertible_files(seed=1))
        bad += write_files(a, unreadable_files(seed=2))
        n += len(CONVERTED) + len(SKIPPED)
        if not IS_ROOT:
            bad.append(write_noperm(a, seed=3))
            n += 1
        # class b: good RGB JPEGs, padding the split to a multiple of the batch (at least 6)
        extra = 6 + (-(n + 6)) % BATCH
        for i in range(extra):
            write_files(root / split / "b", {f"{i}.JPEG": _encoded(_rgb(seed=10 + i), "JPEG")})
        n += extra
        assert n % BATCH == 0
        counts[split] = n
    return converted, bad, counts["train"], counts["val"]


def make_one_survivor_tree(root: Path) -> None:
    """train/: 4 files = one batch of 4, of which only one image is readable; val/ mostly good."""
    good = _encoded(_rgb(), "JPEG")
    write_files(root / "train" / "a", {"good.JPEG": good, "empty1.JPEG": b"", "empty2.JPEG": b""})
    write_files(root / "train" / "b", {"empty3.JPEG": b""})
    write_files(root / "val" / "a", {"good.JPEG": good})
    write_files(root / "val" / "b", {"good.JPEG": _encoded(_rgb(1), "JPEG"), "empty.JPEG": b""})


EXACT = "the tree's own fraction of unreadable images"  # a stand-in, replaced once the tree is written
RUNS = {  # name -> (tree, extra flags)
    "fast": ("data", ["--max-bad-fraction", "0.6"]),
    "classic": ("data", ["--max-bad-fraction", "0.6", "--data-pipeline", "classic"]),
    "strict": ("data", ["--max-bad-fraction", "0.1"]),
    "one-survivor": ("one", ["--max-bad-fraction", "1", "-j", "0"]),
    # validates twice (the model, the weight average), at a limit that only a miscount goes over
    "ema": ("data", ["--model-ema", "0.9", "--max-bad-fraction", EXACT]),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Every CLI run at once (each start imports torch), on one shared tree."""
    with scratch(tmp_path_factory, "bad_tree") as base:  # six runs' checkpoints: 430 MB
        data = base / "data"
        converted, bad, n_train, n_val = make_tree(data)
        make_one_survivor_tree(base / "one")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        procs, outs = {}, {}
        exact = repr(len(bad) / (n_train + n_val))  # the run stops only above it
        for name, (tree, extra) in RUNS.items():
            extra = [exact if arg is EXACT else arg for arg in extra]
            outs[name] = base / f"out-{name}"
            cmd = [sys.executable, "main.py", str(base / tree), "-a", "resnet18", "-b", str(BATCH), "-j", "2",
                   "--image-size", "16", "--val-resize", "16", "--epochs", "1", "--seed", "0",
                   "--output-dir", str(outs[name]), *extra]
            procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
        results = {}
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()  # never leave a hung run behind
                stdout, stderr = proc.communicate()
            results[name] = (proc.returncode, stdout, stderr)
        yield SimpleNamespace(results=results, outs=outs, converted=converted, bad=bad, n_train=n_train,
                              n_val=n_val)
        for p in bad:
            if p.name == NOPERM:
                p.chmod(0o644)


def _real(paths) -> set:
    return {os.path.realpath(str(p)) for p in paths}


@pytest.mark.parametrize("run", ["fast", "classic"])
def test_cli_skips_counts_and_lists_exactly_the_unreadable_files(cli, run):
    rc, stdout, stderr = cli.results[run]
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr and "Traceback" not in stdout
    out = cli.outs[run]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    n_bad_train = sum("/train/" in str(p) for p in cli.bad)
    n_bad_val = len(cli.bad) - n_bad_train
    assert rec["skipped_images"] == len(cli.bad), rec
    # Every readable file (converted kinds included) was trained on or evaluated.
    assert rec["train_samples"] == cli.n_train - n_bad_train, rec
    assert rec["val_samples"] == cli.n_val - n_bad_val, rec
    lines = (out / "skipped_images.txt").read_text().splitlines()
    assert all(line.startswith("epoch 0\t") for line in lines), lines
    listed = [line.split("\t", 1)[1] for line in lines]
    assert len(listed) == len(set(listed)) == len(cli.bad), listed  # each visited once
    assert _real(listed) == _real(cli.bad)
    assert not _real(listed) & _real(cli.converted)
    assert (out / "checkpoint.pth.tar").is_file()


def test_cli_with_model_ema_counts_each_unreadable_image_once(cli):
    """The weight average is validated on the same images: their unreadable ones are the same
    files, counted once, so --max-bad-fraction trips at the rate it does without --model-ema."""
    rc, stdout, stderr = cli.results["ema"]
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    rec = json.loads((cli.outs["ema"] / "metrics.jsonl").read_text().splitlines()[0])
    plain = json.loads((cli.outs["fast"] / "metrics.jsonl").read_text().splitlines()[0])
    assert "val_acc1_ema" in rec and "val_acc1_ema" not in plain
    assert rec["skipped_images"] == plain["skipped_images"] == len(cli.bad), rec
    listed = [line.split("\t", 1)[1] for line in (cli.outs["ema"] / "skipped_images.txt").read_text().splitlines()]
    assert len(listed) == len(set(listed)) == len(cli.bad) and _real(listed) == _real(cli.bad)


def test_cli_stops_past_max_bad_fraction_with_one_error_line(cli):
    rc, stdout, stderr = cli.results["strict"]
    assert rc == 2, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr and "Traceback" not in stdout
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "--max-bad-fraction" in errors[0]
    n = cli.n_train + cli.n_val
    assert f"{len(cli.bad)} of {n} images" in errors[0], errors[0]


def test_cli_survives_a_batch_left_with_one_readable_image(cli):
    rc, stdout, stderr = cli.results["one-survivor"]
    assert rc == 0 and "Traceback" not in stderr, f"exit {rc}\nstderr:\n{stderr[-1500:]}"
    assert "Traceback" not in stdout
    rec = json.loads((cli.outs["one-survivor"] / "metrics.jsonl").read_text().splitlines()[0])
    # the lone readable image is not trained on: a batch of one cannot give BatchNorm statistics
    assert rec["skipped_images"] == 4 and rec["train_samples"] == 0 and rec["val_samples"] == 2, rec


# ------------------------------------------------------------------- --max-bad-fraction's boundary


@pytest.mark.parametrize("count, total, limit, stops", [
    (1, 100, 0.01, False), (2, 100, 0.01, True),  # the default: exactly 1% goes on, more stops
    (29, 100, 0.29, False), (30, 100, 0.29, True),  # where limit * total rounds below the count
    (7, 100, 0.07, False), (1, 3, 1 / 3, False), (1, 3, 0.333, True),
    (0, 10, 0.0, False), (1, 10, 0.0, True),  # 0: none allowed
    (10, 10, 1.0, False), (0, 0, 0.0, False),  # 1: never stops; an empty epoch judges nothing
])
def test_max_bad_fraction_is_the_largest_share_that_goes_on(count, total, limit, stops):
    from imagenet.training.runner import exceeds_bad_fraction
    assert exceeds_bad_fraction(count, total, limit) is stops


@pytest.mark.parametrize("bad, stops", [(5, False), (6, True)], ids=["at-the-limit", "just-above"])
def test_an_epoch_at_the_limit_goes_on_and_one_image_more_stops(tmp_path, bad, stops):
    from imagenet.base.errors import UserError
    from imagenet.training.runlog import RunLog
    from imagenet.training.runner import _count_skipped
    cfg = Config(output_dir=str(tmp_path), max_bad_fraction=0.05)
    ctx = SimpleNamespace(is_main=True, device=torch.device("cpu"), distributed=False)
    paths = [f"/data/train/a/{i}.JPEG" for i in range(bad)]
    with RunLog(cfg, ctx) as log:
        if stops:
            with pytest.raises(UserError, match="6 of 100 images could not be read in epoch 0, more than "
                                                "--max-bad-fraction 0.05"):
                _count_skipped(cfg, ctx, log, paths, 0, 100)
        else:
            assert _count_skipped(cfg, ctx, log, paths, 0, 100) == 5
    assert len((tmp_path / "skipped_images.txt").read_text().splitlines()) == bad  # listed either way


def test_the_help_says_what_max_bad_fraction_allows():
    from imagenet.base.config import build_parser
    action = next(a for a in build_parser()._actions if "--max-bad-fraction" in a.option_strings)
    assert action.help and "largest share" in action.help and "exactly this share goes on" in action.help
    for doc in ("OPTIONS.md", "INPUT.md"):
        text = " ".join((REPO / "docs" / doc).read_text().split())
        assert "largest share of an epoch's images that may be unreadable" in text, doc
        assert "exactly th" in text.split("--max-bad-fraction", 1)[1][:400], doc
