"""Tar shards: scripts/make_shards.py's conversion (every image once, labels, the class table,
bad files reported, an interrupted run continued), the epoch order over shards (a permutation,
equal ranks without padding, every validation image once), reading a sample as the folder reads
its file (the same crops), and runs from shards: the same loss as the folder run, a mid-epoch
resume bit for bit, a corrupt sample counted, a truncated shard or a missing index refused,
a URL read through fsspec."""

import contextlib
import errno
import gc
import hashlib
import importlib.util
import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from imagenet.base.config import parse_config
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.shards import files as shardfiles
from imagenet.data.shards import writer as shardwriter
from imagenet.data.decode import TrainDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.probe import images_are_jpeg
from imagenet.data.gpu.decode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, decode_batch
from imagenet.data.loaders import build_datasets, build_loaders
from imagenet.data.shards.remote import local_copy
from imagenet.data.samplers import BlockSampler, SeededSampler, ShardWindowSampler
from imagenet.data.shards.index import read_index, shard_name
from imagenet.data.shards.dataset import SampleBytes, ShardDataset
from tests.helpers import digits_fixture, assert_same_run, interrupt_after_step, last_checkpoint, make_digits, photo, scratch

REPO = Path(__file__).resolve().parents[1]
SHARD_SIZE = 16_000  # about 5 digits a shard: 8 training shards, 2 of validation


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_shards_cli = _script("make_shards").main


def convert(src, out, **kw):
    return shardwriter.make_shards(str(src), str(out), shard_size=kw.pop("shard_size", SHARD_SIZE), seed=0,
                                   workers=kw.pop("workers", 0), progress=False, **kw)


def run_args(data, out, *extra):
    """A seeded ResNet-18 run at 16 px, batch 8, loading in-process, for one epoch."""
    return [str(data), "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16",
            "-p", "100", "--seed", "0", "--lr", "0.02", "--epochs", "1", "--output-dir", str(out), *map(str, extra)]


def metrics(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


digits = digits_fixture(4, 1)  # 40 train (5 steps of 8), 10 val


@pytest.fixture(scope="module")
def shards(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "out"
    convert(digits, out)
    return out


def folder_files(root, split):
    return SafeImageFolder(str(Path(root) / split)).samples


# ------------------------------------------------------------------------------------ conversion


def test_conversion_packs_every_image_once_with_its_label(digits, shards):
    index = read_index(str(shards))
    assert index.classes == [str(d) for d in range(10)]
    assert (shards / "classes.txt").read_text().split() == index.classes
    for split, count in (("train", 40), ("val", 10)):
        files = folder_files(digits, split)
        table = index.splits[split].table()
        assert len(table) == count and sorted(table["id"]) == list(range(count))
        # what another tool sees: consecutive KEY.png + KEY.cls members, labels in decimal
        seen = []
        for shard in index.splits[split].shards:
            assert shard["bytes"] == os.path.getsize(shards / shard["name"]) <= SHARD_SIZE
            with tarfile.open(shards / shard["name"]) as tar:
                members = tar.getmembers()
                assert len(members) == 2 * shard["samples"]
                for image, label in zip(members[::2], members[1::2]):
                    key, ext = image.name.split(".")
                    assert (ext, label.name) == ("png", f"{key}.cls")
                    seen.append((hashlib.sha1(tar.extractfile(image).read()).hexdigest(),
                                 int(tar.extractfile(label).read())))
        expected = [(hashlib.sha1(Path(p).read_bytes()).hexdigest(), label) for p, label in files]
        assert sorted(seen) == sorted(expected)
        # the index points at each image's bytes, with the folder's label and index
        for shard_no, offset, size, label, image_id in table.tolist():
            with open(shards / index.splits[split].shards[shard_no]["name"], "rb") as fh:
                fh.seek(offset)
                assert fh.read(size) == Path(files[image_id][0]).read_bytes()
            assert label == files[image_id][1]
    assert len(index.splits["train"].shards) > 2
    train_ids = list(index.splits["train"].table()["id"])
    assert train_ids != sorted(train_ids)  # shuffled once before packing
    assert list(index.splits["val"].table()["id"]) == list(range(10))  # validation keeps the folder's order


@pytest.fixture(scope="module")
def with_bad_files(tmp_path_factory):
    """Digits (2 train, 1 val a class) plus unreadable files: 2 in train, 3 in val (7 val images left)."""
    root, out = tmp_path_factory.mktemp("bad") / "src", tmp_path_factory.mktemp("bad") / "out"
    make_digits(root, train_per_class=2, val_per_class=1)
    good = next((root / "train" / "1").iterdir()).read_bytes()
    (root / "train" / "3" / "garbage.png").write_bytes(os.urandom(300))
    (root / "train" / "5" / "cut.png").write_bytes(good[: len(good) // 2])
    for c in (0, 4, 9):  # the only image of the class, emptied: the class stays, its image goes
        next((root / "val" / str(c)).iterdir()).write_bytes(b"")
    return root, out


def test_bad_files_are_reported_and_not_packed(with_bad_files, capsys):
    root, out = with_bad_files
    assert make_shards_cli([str(root), str(out), "--shard-size", "16kB", "--workers", "2", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "not packed, unreadable: train/3/garbage.png" in printed and "5 unreadable image(s)" in printed
    listed = (out / "bad_files.txt").read_text()
    emptied = {f"val/{c}/{next((root / 'val' / str(c)).iterdir()).name}" for c in (0, 4, 9)}
    assert {line.split("\t")[0] for line in listed.splitlines()} == {"train/3/garbage.png", "train/5/cut.png",
                                                                      *emptied}
    reasons = dict(line.split("\t") for line in listed.splitlines())
    assert "garbage.png" in reasons["train/3/garbage.png"] and "BytesIO" not in listed  # PIL's message names the file
    index = json.loads((out / "index.json").read_text())
    assert [index["splits"][s]["samples"] for s in ("train", "val")] == [20, 7]
    assert [index["splits"][s]["skipped"] for s in ("train", "val")] == [2, 3]
    # the index lists what it left out, per split, with the folder's ids and labels
    files = {split: {os.path.relpath(p, root / split): (i, label) for i, (p, label) in enumerate(folder_files(root, split))}
             for split in ("train", "val")}
    for split, names in (("train", {"3/garbage.png", "5/cut.png"}), ("val", {e.split("/", 1)[1] for e in emptied})):
        left_out = index["splits"][split]["left_out"]
        assert {item["name"] for item in left_out} == names
        assert all(files[split][item["name"]] == (item["id"], item["label"]) for item in left_out)
    # the ids stay the folder's: the unreadable files keep theirs, unused
    bad_ids = {i for i, (p, _) in enumerate(folder_files(root, "train")) if "garbage" in p or "cut" in p}
    ids = set(read_index(str(out)).splits["train"].table()["id"].tolist())
    assert len(ids) == 20 and not ids & bad_ids


def test_an_interrupted_conversion_is_refused_then_continued(digits, shards, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real, closed = shardwriter._close, []

    def stop_after_three(*a, **k):
        real(*a, **k)
        closed.append(1)
        if len(closed) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(shardwriter, "_close", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        convert(digits, out)
    monkeypatch.undo()
    assert not (out / "index.json").exists()
    assert main(run_args(out, tmp_path / "run")) == 2  # half-written: no index, so no run
    err = capsys.readouterr().err
    assert "no index.json" in err and "scripts/make_shards.py" in err
    report = convert(digits, out)
    assert report.continued_from > 0
    same_files(out, shards)  # the same bytes as a conversion that never stopped
    assert convert(digits, out).finished_before
    with pytest.raises(UserError, match="--overwrite"):
        convert(digits, out, shard_size=2 * SHARD_SIZE)


def cli_args(src, out):
    return [str(src), str(out), "--shard-size", str(SHARD_SIZE), "--workers", "0", "-q"]


def same_files(a, b):
    """The folders hold the same files (the generations' records included), byte for byte."""
    names = sorted(str(p.relative_to(a)) for p in Path(a).rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in Path(b).rglob("*") if p.is_file())
    for name in names:
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


def same_conversion(a, b):
    """The indexes of two shard folders describe the same conversion, and the files they name hold
    the same bytes, whatever their names (a rebuild's generation)."""
    ia, ib = read_index(str(a)), read_index(str(b))
    for split in ("train", "val"):
        sa, sb = ia.splits[split], ib.splits[split]
        assert np.array_equal(sa.table(), sb.table()) and sa.left_out == sb.left_out, split
        assert [(s["bytes"], s["sources"]) for s in sa.shards] == [(s["bytes"], s["sources"]) for s in sb.shards]
        for number in range(len(sa.shards)):
            assert Path(sa.path(number)).read_bytes() == Path(sb.path(number)).read_bytes(), (split, number)


def data_files(root):
    """The files of a shard folder that a copy of it needs (not the generations' records)."""
    return [p for p in Path(root).iterdir() if p.is_file()]


def test_ctrl_c_is_one_line_and_a_rerun_continues_with_the_files_changed_meanwhile(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    make_digits(src, train_per_class=2, val_per_class=1)
    real, closed = shardwriter._close, []

    def ctrl_c_after_two(*a, **k):
        real(*a, **k)
        closed.append(1)
        if len(closed) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(shardwriter, "_close", ctrl_c_after_two)
    capsys.readouterr()
    assert make_shards_cli(cli_args(src, out)) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted; rerun the same command" in err
    monkeypatch.undo()
    # the first shard's first image is replaced before the rerun: it rewrites from that shard on
    samples = folder_files(src, "train")
    first = Path(samples[np.random.default_rng(0).permutation(len(samples))[0]][0])
    first.write_bytes(Path(samples[-1][0]).read_bytes())
    assert make_shards_cli(cli_args(src, out)) == 0
    convert(src, tmp_path / "fresh")
    same_files(out, tmp_path / "fresh")


def test_a_full_disk_while_writing_the_index_is_one_line_and_a_rerun_completes(digits, shards, tmp_path, monkeypatch,
                                                                              capsys):
    out, real = tmp_path / "out", shardwriter.atomic

    def disk_full_at_the_index(path, write):
        def part_then_full(fh):
            fh.write(b"{")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, part_then_full if path.endswith("index.json") else write)
    monkeypatch.setattr(shardwriter, "atomic", disk_full_at_the_index)
    capsys.readouterr()
    assert make_shards_cli(cli_args(digits, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "rerun" in err
    assert not (out / "index.json").exists() and not list(out.glob("*.tmp"))
    monkeypatch.undo()
    assert make_shards_cli(cli_args(digits, out)) == 0
    same_files(out, shards)


def test_a_repaired_file_is_packed_by_a_rerun_which_keeps_the_shards_before_it(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    make_digits(src, train_per_class=2, val_per_class=1)
    last = int(np.random.default_rng(0).permutation(20)[-1])  # packed last: into a later shard than the first
    broken = Path(folder_files(src, "train")[last][0])
    good = broken.read_bytes()
    broken.write_bytes(good[:40])
    convert(src, out)
    [item] = read_index(str(out)).splits["train"].left_out
    assert item["id"] == last and item["shard"] > 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    broken.write_bytes(good)  # repaired
    assert make_shards_cli(cli_args(src, out)) == 0
    assert "changed since these shards were made" in capsys.readouterr().out
    index = read_index(str(out))
    assert not index.splits["train"].left_out and last in index.splits["train"].table()["id"].tolist()
    kept = [shard_name("train", n) for n in range(item["shard"])] + [s["name"] for s in index.splits["val"].shards]
    assert [s["name"] for s in index.splits["train"].shards[:item["shard"]]] == kept[:item["shard"]]
    assert all((out / name).stat().st_mtime_ns == stamps[name] for name in kept)
    # the rest under the next generation's names; the old files all stay (the previous index's)
    assert {s["name"] for s in index.splits["train"].shards[item["shard"]:]} <= {
        shard_name("train", n, 1) for n in range(10)}
    assert set(stamps) <= {p.name for p in out.iterdir()}
    convert(src, tmp_path / "fresh")
    same_conversion(out, tmp_path / "fresh")
    assert convert(src, out).finished_before


def _replace_first_packed(src, split="train"):
    """Put another image (of another size) in place of the file packed first: every shard is then
    rewritten, and every sample after it moves. Returns (its image id, its new bytes)."""
    samples = folder_files(src, split)
    first = int(np.random.default_rng(0).permutation(len(samples))[0])
    other = next(p for p, _ in samples if Path(p).stat().st_size != Path(samples[first][0]).stat().st_size)
    Path(samples[first][0]).write_bytes(Path(other).read_bytes())
    return first, Path(other).read_bytes()


def _read_all(data, workers=0, context=None):
    """Every sample of ``data`` through a DataLoader, by row: (bytes, label, None)."""
    from torch.utils.data import DataLoader
    loader = DataLoader(data, batch_size=5, num_workers=workers, multiprocessing_context=context, collate_fn=list)
    return [sample for batch in loader for sample in batch]


def test_a_job_holding_the_old_index_reads_it_whole_while_make_shards_rebuilds(tmp_path):
    """A repaired or replaced source file makes a rerun rewrite shards. A job that read the index
    before keeps reading its files: in its own process, in workers forked after the rerun, and in
    spawned workers (which map the table and open the shards afresh). A job after it reads the new."""
    import operator
    src, out = tmp_path / "src", tmp_path / "out"
    make_digits(src, train_per_class=2, val_per_class=1)
    convert(src, out)
    data = ShardDataset(read_index(str(out)).splits["train"], None, operator.methodcaller("getvalue"))
    before = _read_all(data)
    assert len(before) == 20 and all(bad is None for _, _, bad in before)
    changed, new_bytes = _replace_first_packed(src)
    report = convert(src, out)
    assert report.changed_source and report.generation == 1
    assert _read_all(data) == before
    assert _read_all(data, workers=2, context="fork") == before
    assert _read_all(data, workers=1, context="spawn") == before
    data.close()
    now = ShardDataset(read_index(str(out)).splits["train"], None, operator.methodcaller("getvalue"))
    row = now.table["id"].tolist().index(changed)
    assert now[row][0] == new_bytes and before[row][0] != new_bytes
    now.close()


def test_an_old_index_stays_while_a_job_reads_it_and_goes_after(tmp_path, capsys):
    """A run leases the generation of the index it read: two rebuilds later its files are still
    there; once it ended, the next run of make_shards removes them, and keeps the previous
    generation's (for a job a lock cannot see) unless --prune."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_digits(src, train_per_class=2, val_per_class=1)
    convert(src, out)
    first = read_index(str(out))
    files = [out / name for name in first.files()]
    cfg = parse_config(run_args(out, tmp_path / "run"))
    job = build_datasets(cfg, str(out))
    assert job.lease is not None
    for generation in (1, 2):
        _replace_first_packed(src)
        assert convert(src, out).generation == generation
    assert all(f.exists() for f in files)  # read by the job
    capsys.readouterr()
    assert make_shards_cli(cli_args(src, out)) == 0
    assert "kept the files of 1 earlier version(s) of the index that a job still reads" in capsys.readouterr().out
    job.close()
    assert make_shards_cli(cli_args(src, out)) == 0
    assert "removed the files of 1 earlier version(s)" in capsys.readouterr().out
    previous, now = shardfiles.read_json(str(out / ".generations" / "1.json")), read_index(str(out))
    assert {p.name for p in out.iterdir() if p.suffix in (".tar", ".npy")} == set(previous["files"]) | set(now.files())
    assert set(first.files()) - set(previous["files"]) - set(now.files())  # gone: only the job read them
    assert make_shards_cli([*cli_args(src, out), "--prune"]) == 0
    assert {p.name for p in out.iterdir() if p.suffix in (".tar", ".npy")} == set(now.files())
    assert sorted(p.name for p in (out / ".generations").iterdir()) == ["2.json"]
    same_conversion(out, convert(src, tmp_path / "fresh").out)


def test_overwrite_builds_beside_the_conversion_a_job_reads(digits, tmp_path):
    """--overwrite (other settings) is a rebuild like any other: the next generation, from scratch,
    under new names; the old index's files stay for the job that reads them."""
    import operator
    out = tmp_path / "out"
    convert(digits, out)
    data = ShardDataset(read_index(str(out)).splits["train"], None, operator.methodcaller("getvalue"))
    before = _read_all(data)
    report = convert(digits, out, shard_size=3 * SHARD_SIZE, overwrite=True)
    assert report.generation == 1 and not report.changed_source
    assert _read_all(data, workers=2, context="fork") == before
    data.close()
    now = read_index(str(out))
    assert all(".g1." in name for name in now.files()) and now.shard_count < 10
    same_conversion(out, convert(digits, tmp_path / "fresh", shard_size=3 * SHARD_SIZE).out)


def test_a_job_whose_index_went_before_it_took_its_lease_is_told_to_run_again(shards, tmp_path, monkeypatch, capsys):
    """Only two rebuilds between a job's reading the index and its taking the lease can do it."""
    from imagenet.data.shards.lease import Lease
    monkeypatch.setattr(Lease, "removed", property(lambda self: True))
    assert main(run_args(shards, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "was rebuilt by make_shards while this run started" in err and "run the command again" in err


def test_a_job_whose_generation_record_went_before_it_took_its_lease_is_told_to_run_again(shards, tmp_path, capsys):
    """The record of the generation a job read can be gone too (two rebuilds, the second with
    --prune, between its reading the index and taking the lease): not a folder without records."""
    folder = tmp_path / "out"
    shutil.copytree(shards, folder)
    records = list((folder / ".generations").iterdir())
    assert records, "make_shards wrote no generation record"
    for record in records:
        record.unlink()
    assert main(run_args(folder, tmp_path / "run")) == 2
    assert "was rebuilt by make_shards while this run started" in capsys.readouterr().err


def test_the_same_folder_through_a_symlink_is_the_same_conversion(digits, shards, tmp_path, capsys):
    (tmp_path / "link").symlink_to(digits)
    shutil.copytree(shards, tmp_path / "out")
    assert make_shards_cli(cli_args(tmp_path / "link", tmp_path / "out")) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_conversion_by_an_earlier_make_shards_is_kept_with_a_note(digits, shards, tmp_path, capsys):
    """Its plan held the absolute source path and no sizes or times: the same listing and settings
    are taken as this conversion, and the user is told how to rebuild it."""
    shutil.copytree(shards, tmp_path / "out")
    index = json.loads((shards / "index.json").read_text())
    index["made_by"]["source"] = str(digits)
    for split in index["splits"].values():
        for shard in split["shards"]:
            del shard["next"], shard["sources"]
    (tmp_path / "out" / "index.json").write_text(json.dumps(index))
    assert make_shards_cli(cli_args(digits, tmp_path / "out")) == 0
    printed = capsys.readouterr().out
    assert "earlier make_shards" in printed and "--overwrite" in printed


def test_the_index_says_whether_the_images_are_jpegs(shards, tmp_path):
    """--decode auto asks: PNG digits are not JPEGs; an index from before the formats were recorded
    is 'not known', as before."""
    assert images_are_jpeg(str(shards)) is False
    jpegs = tmp_path / "jpegs"
    for split in ("train", "val"):
        for c in ("a", "b"):
            (jpegs / split / c).mkdir(parents=True)
            photo(20, 24, seed=len(c)).save(jpegs / split / c / "x.jpg")
    convert(jpegs, tmp_path / "jpeg-shards")
    assert json.loads((tmp_path / "jpeg-shards" / "index.json").read_text())["splits"]["train"]["formats"] == {"jpg": 2}
    assert images_are_jpeg(str(tmp_path / "jpeg-shards")) is True
    shutil.copytree(shards, tmp_path / "older")
    index = json.loads((shards / "index.json").read_text())
    for split in index["splits"].values():
        del split["formats"]
    (tmp_path / "older" / "index.json").write_text(json.dumps(index))
    assert images_are_jpeg(str(tmp_path / "older")) is None


# ------------------------------------------------------------------------------------- samplers


def uneven_rows(sizes=(5, 3, 7, 1, 4, 6), seed=0):
    """(shard of each row, id of each row) for shards of ``sizes`` samples, ids shuffled."""
    shard_of_row = np.repeat(np.arange(len(sizes)), sizes)
    return shard_of_row, np.random.default_rng(seed).permutation(len(shard_of_row))


def test_the_epoch_order_is_a_permutation_that_reads_a_window_of_shards_at_a_time():
    shard_of_row, ids = uneven_rows()  # shards of 5, 3, 7, 1, 4 and 6
    sizes = np.bincount(shard_of_row)
    sampler = ShardWindowSampler(shard_of_row, ids, 1, 0, seed=3, window=9)
    assert sampler.group == 2  # 9 of 26 images: 2 of the 6 shards at a time
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = sampler.epoch_order()
        assert sorted(order) == list(range(len(ids)))
        np.testing.assert_array_equal(order, sampler.epoch_order())  # a function of (seed, epoch)
        shards, start, interleaved = shard_of_row[order], 0, False
        while start < len(order):  # blocks holding all the images of 2 shards, mixed
            pair = list(dict.fromkeys(shards[start:].tolist()))[:2]
            end = start + sizes[pair].sum()
            assert set(shards[start:end].tolist()) == set(pair)
            interleaved |= len([i for i in range(start + 1, end) if shards[i] != shards[i - 1]]) > 1
            start = end
        assert interleaved
        orders.append(order)
    assert not np.array_equal(*orders)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_partition_uneven_shards_without_padding(world):
    shard_of_row, ids = uneven_rows()  # 26 samples in 6 shards of 1 to 7
    full = ShardWindowSampler(shard_of_row, ids, 1, 0, seed=0, window=8)
    full.set_epoch(2)
    order = full.epoch_order()
    ranks = []
    for rank in range(world):
        s = ShardWindowSampler(shard_of_row, ids, world, rank, seed=0, window=8)
        s.set_epoch(2)
        keys = list(s)
        assert len(keys) == len(s) == 26 // world  # equal lengths, the tail dropped, nothing repeated
        ranks.append([k[0] for k in keys])
    everyone = [i for r in ranks for i in r]
    assert len(set(everyone)) == len(everyone) == 26 // world * world
    assert set(everyone) == set(order[: 26 // world * world].tolist())
    # DDP's global batch k (each rank's k-th batch of 4 / world) holds single-process batch k's images
    per_rank = 4 // world if 4 % world == 0 else None
    if per_rank:
        for k in range(len(ranks[0]) // per_rank):
            together = {i for r in ranks for i in r[k * per_rank:(k + 1) * per_rank]}
            assert together == set(order[k * 4:(k + 1) * 4].tolist())


def test_seeds_come_from_the_image_id_and_a_full_window_is_the_folders_order():
    shard_of_row, ids = uneven_rows()
    shard = ShardWindowSampler(shard_of_row, ids, 2, 1, seed=5, window=10 ** 6)
    folder = SeededSampler(list(range(26)), 2, 1, seed=5)
    for epoch in (0, 3):
        shard.set_epoch(epoch)
        folder.set_epoch(epoch)
        shard.set_start(2)
        folder.set_start(2)
        assert [(int(ids[row]), seed) for row, seed in shard] == list(folder)
    shard.set_image_size(12)
    assert all(len(key) == 3 and key[2] == 12 for key in shard)


def test_a_resumed_epoch_is_the_rest_of_the_same_epoch():
    shard_of_row, ids = uneven_rows()
    s = ShardWindowSampler(shard_of_row, ids, 3, 2, seed=1, window=5)
    s.set_epoch(4)
    whole = list(s)
    s.set_start(3)
    assert list(s) == whole[3:] and len(s) == len(whole) - 3


@pytest.mark.parametrize("n", [1, 7, 13])
def test_validation_blocks_cover_every_image_once(n):
    for world in range(1, 9):
        blocks = [list(BlockSampler(n, rank, world)) for rank in range(world)]
        assert [i for b in blocks for i in b] == list(range(n))
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


@pytest.mark.parametrize("world", [2, 3])
def test_validation_images_over_ranks_are_each_read_once_the_left_out_ones_skipped(with_bad_files, world):
    """10 validation images: 7 packed, 3 left out at conversion, which come back skipped, named."""
    root, out = with_bad_files
    if not (out / "index.json").exists():
        convert(root, out)
    cfg = parse_config(run_args(out, "/tmp"))
    data = build_datasets(cfg, str(out), device=torch.device("cpu"))
    seen, read, skipped = [], 0, []
    for rank in range(world):
        ctx = SimpleNamespace(world_size=world, rank=rank, distributed=True, device=torch.device("cpu"))
        _, val = build_loaders(parse_config(run_args(out, "/tmp", "-b", 2 * world)), data, ctx, 0)
        seen += [int(data.val.image_ids[i]) for i in val.sampler]
        for _, targets, bad in val:
            read, skipped = read + len(targets), skipped + bad
    assert sorted(seen) == list(range(10)) and read == 7
    emptied = {f"val/{c}/{next((root / 'val' / str(c)).iterdir()).name}" for c in (0, 4, 9)}
    assert {name.split(" ")[0] for name in skipped} == emptied
    data.close()


# ----------------------------------------------------------------------------------- reading


def test_a_sample_gives_its_files_crops_in_every_pipeline(digits, shards):
    for pipeline in ("fast", "classic"):
        cfg = parse_config(run_args(shards, "/tmp", "--data-pipeline", pipeline))
        from_shards = build_datasets(cfg, str(shards), device=torch.device("cpu"))
        from_folder = build_datasets(cfg, str(digits), device=torch.device("cpu"))
        for split in ("train", "val"):
            a, b = getattr(from_shards, split), getattr(from_folder, split)
            for row, image_id in enumerate(a.table["id"].tolist()):
                key_a, key_b = ((row, 1234 + image_id, 12), (image_id, 1234 + image_id, 12)) if split == "train" \
                    else (row, image_id)
                image, label, bad = a[key_a]
                assert bad is None and label == b[key_b][1]
                assert torch.equal(image, b[key_b][0]), (pipeline, split, row)


def test_worker_processes_resume_a_shard_epoch_bit_exactly(shards):
    """Workers map the table and open the shards themselves; how many there are changes nothing."""
    from torch.utils.data import DataLoader
    from imagenet.data.loaders import collate_skipping
    data = ShardDataset(read_index(str(shards)).splits["train"], TrainDecoder(12, 0.25, 0.5), path_identity)
    copy = pickle.loads(pickle.dumps(data))  # what a spawned worker gets: no table, no descriptors
    assert copy._table is None and not copy._fds and torch.equal(copy[(3, 7)][0], data[(3, 7)][0])

    def batches(start, workers):
        sampler = ShardWindowSampler(data.table["shard"], data.table["id"], 2, 1, seed=3, window=10)
        sampler.set_epoch(5)
        sampler.set_start(start)
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate_skipping,
                            drop_last=True)
        return [(x, y) for x, y, _ in loader]
    whole, resumed = batches(0, 2), batches(8, 1)
    assert len(whole) == 5 and len(resumed) == 3
    for (xa, ya), (xb, yb) in zip(whole[2:], resumed):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_the_gpu_decoders_worker_side_takes_a_sample_as_it_takes_a_file(tmp_path):
    path = tmp_path / "photo.jpg"
    photo(40, 56, seed=1).save(path, "JPEG")
    reader = TrainJpegReader(TrainDecoder(16, 0.25, 0.5))
    torch.manual_seed(7)
    from_file = reader(str(path))
    torch.manual_seed(7)
    from_sample = reader(SampleBytes(path.read_bytes(), "train-000001.tar@512"))
    assert isinstance(from_sample, JpegJob) and from_sample.data == path.read_bytes()
    assert (from_sample.box, from_sample.flip, from_sample.path) == (from_file.box, from_file.flip,
                                                                      "train-000001.tar@512")
    png = tmp_path / "photo.png"
    photo(40, 56, seed=1).save(png)
    assert isinstance(reader(SampleBytes(png.read_bytes(), "x")), CpuDecoded)  # decoded in the worker, as a file
    # collated into the batch's shared buffer and decoded as the file's job is, named as the sample
    batch = JpegBatch.collate([from_sample], [3])
    assert batch.paths == ["train-000001.tar@512"] and batch.targets.tolist() == [3]
    assert torch.equal(decode_batch(batch, torch.device("cpu")).images,
                       decode_batch(JpegBatch.collate([from_file]), torch.device("cpu")).images)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_a_dataset_closes_its_shards_when_closed_or_dropped(shards):
    before = open_fds()
    data = ShardDataset(read_index(str(shards)).splits["train"], None, lambda f: f.getvalue())
    assert all(data[row][0] for row in range(len(data)))
    assert open_fds() > before
    data.close()
    assert open_fds() == before
    assert data[0][0] and open_fds() > before  # a later sample opens what it needs again
    data._pid = -1  # as in a forked worker: the parent's descriptors are closed there, not kept
    assert data[len(data) - 1][0]
    assert open_fds() == before + 2  # the table's map and one shard
    del data
    gc.collect()
    assert open_fds() == before


def test_a_samples_name_is_its_shard_and_member(shards):
    """What the skipped-images report shows for a sample the GPU decoder or PIL rejects, and what
    PIL's messages show (a file object's repr)."""
    data = ShardDataset(read_index(str(shards)).splits["train"], None, lambda f: f)
    for row in (0, len(data) - 1):
        sample = data[row][0]
        shard, offset = (int(x) for x in data.table[row][["shard", "offset"]].item())
        assert sample.name == data.name(shard, offset) and sample.name.endswith(".png")
        assert sample.name.startswith(data.split.shards[shard]["name"] + ":")
        assert repr(sample) == repr(sample.name)
    data.close()


def test_a_shard_cut_short_after_start_up_is_a_counted_skip(shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    data = ShardDataset(read_index(str(copy)).splits["train"], None, lambda f: f.read())
    last_row = max(range(len(data)), key=lambda r: (data.table[r]["shard"], data.table[r]["offset"]))
    shard = data.split.path(int(data.table[last_row]["shard"]))
    assert data[last_row][2] is None
    os.truncate(shard, int(data.table[last_row]["offset"]) + 10)
    image, label, name = data[last_row]
    assert image is None and label == data.table[last_row]["label"]
    assert name.startswith(os.path.basename(shard) + ":") and name.endswith(".png")


# ---------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def shard_run(shards, tmp_path_factory):
    """The one-epoch run from the shards: its metrics and what it printed."""
    with scratch(tmp_path_factory, "shard_run") as out:
        printed = io.StringIO()
        fds = open_fds()
        with contextlib.redirect_stdout(printed):  # the run's log handler writes to sys.stdout
            assert main(run_args(shards, out)) == 0
        yield metrics(out), printed.getvalue(), open_fds() - fds


def test_a_shard_run_matches_the_folder_run_of_the_same_images(digits, shards, shard_run, tmp_path):
    assert main(run_args(digits, tmp_path)) == 0
    folder, (from_shards, printed, _) = metrics(tmp_path), shard_run
    for key in ("train_loss", "train_acc1", "val_loss", "val_acc1", "train_samples", "val_samples"):
        assert from_shards[0][key] == folder[0][key], key
    assert f"=> data: {shards} (tar shards (40 train / 10 val in 10 shards), 10 classes)" in printed


def test_an_in_process_run_leaves_no_file_open(shard_run):
    assert shard_run[2] == 0


def test_a_shard_run_skips_and_counts_the_unreadable_images_its_folder_run_does(with_bad_files, tmp_path, capsys):
    """The converter left 2 train and 3 val images out: the shard run meets them where the folder
    run does (the same order), counts and lists them, and --max-bad-fraction judges the same."""
    root, _ = with_bad_files
    convert(root, tmp_path / "shards")
    lenient = ("--max-bad-fraction", "0.5")
    assert main(run_args(root, tmp_path / "folder", *lenient)) == 0
    assert main(run_args(tmp_path / "shards", tmp_path / "from_shards", *lenient)) == 0
    banner = capsys.readouterr().out.split("tar shards (")[1].split("\n")[0]
    assert banner.startswith("20 train / 7 val in") and "; 5 unreadable image(s) left out when converted" in banner
    folder, from_shards = metrics(tmp_path / "folder")[0], metrics(tmp_path / "from_shards")[0]
    assert folder["skipped_images"] >= 3
    for key in ("skipped_images", "train_loss", "train_samples", "val_loss", "val_acc1", "val_samples"):
        assert from_shards[key] == folder[key], key

    def listed(run):
        return sorted(line.split("\t")[1] for line in (tmp_path / run / "skipped_images.txt").read_text().splitlines())
    assert [name.split(" ")[0] for name in listed("from_shards")] == [os.path.relpath(p, root) for p in listed("folder")]
    assert main(run_args(tmp_path / "shards", tmp_path / "strict", "--max-bad-fraction", "0.05")) == 2
    assert "could not be read in epoch 0" in capsys.readouterr().err


def test_a_mid_epoch_checkpoint_resumes_bit_exactly(shards, tmp_path, monkeypatch):
    windowed = ("--shuffle-window", "10")  # 2 of the 8 training shards at a time
    straight = tmp_path / "straight"
    assert main(run_args(shards, straight, *windowed)) == 0
    interrupt_after_step(monkeypatch, 2)  # as a kill -9 right after the checkpoint
    split = tmp_path / "split"
    assert main(run_args(shards, split, *windowed, "--save-every-steps", "2")) == 130
    ckpt = last_checkpoint(split)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 2)
    monkeypatch.undo()
    assert main(run_args(shards, split, *windowed, "--resume", "auto")) == 0
    assert_same_run(last_checkpoint(straight), last_checkpoint(split))
    assert metrics(split)[-1]["train_loss"] == metrics(straight)[-1]["train_loss"]


def test_a_corrupt_sample_is_skipped_and_counted(shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    split = read_index(str(copy)).splits["train"]
    shard, offset, size = (int(x) for x in split.table()[[0]][["shard", "offset", "size"]].item())
    with open(split.path(shard), "r+b") as fh:  # the same length: only decoding can tell
        fh.seek(offset)
        fh.write(b"\x89PNG" + bytes(size - 4))
    assert main(run_args(copy, tmp_path / "run", "--max-bad-fraction", "0.1")) == 0
    row = metrics(tmp_path / "run")[0]
    assert row["skipped_images"] == 1 and row["train_samples"] == 39
    listed = (tmp_path / "run" / "skipped_images.txt").read_text()
    assert f"{split.shards[shard]['name']}:" in listed and ".png" in listed


def test_a_truncated_shard_stops_the_run_at_start_up(shards, tmp_path, capsys):
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    os.truncate(copy / "train-000003.tar", 5000)
    assert main(run_args(copy, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "train-000003.tar has 5000 bytes" in err and "truncated" in err
    (copy / "val-000001.tar").unlink()
    os.truncate(copy / "train-000003.tar", (shards / "train-000003.tar").stat().st_size)
    assert main(run_args(copy, tmp_path / "run")) == 2
    assert "val-000001.tar is missing" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint.pth.tar").exists()


def test_tars_without_an_index_name_the_converter(tmp_path, capsys):
    with tarfile.open(tmp_path / "train-000000.tar", "w") as tar:  # another tool's shard
        tar.add(__file__, arcname="x/0001.py")
    assert main(run_args(tmp_path, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "no index.json" in err and "python scripts/make_shards.py" in err


# ------------------------------------------------------------------------------------------ URLs


def memory_copy(shards, url):
    import fsspec
    fs, root = fsspec.core.url_to_fs(url)
    for path in data_files(shards):
        fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
    return fs, root


def test_a_url_is_copied_once_into_the_cache_and_trains_as_the_local_folder(shards, shard_run, tmp_path, capsys):
    fs, root = memory_copy(shards, "memory://i30/shards")
    try:
        assert main(run_args("memory://i30/shards", tmp_path / "run", "--cache-dir", tmp_path / "cache")) == 0
        assert metrics(tmp_path / "run")[0]["train_loss"] == shard_run[0][0]["train_loss"]
        assert "=> data: memory://i30/shards (tar shards (40 train" in capsys.readouterr().out
    finally:
        fs.rm(root, recursive=True)


def test_a_cached_copy_is_reused_and_repaired(shards, tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    shutil.copytree(shards, tmp_path / "remote")
    lease = local_copy(url, tmp_path / "cache", progress=False)
    local = Path(lease.path)
    assert sorted(p.name for p in local.iterdir()) == sorted([".readers", *(p.name for p in data_files(shards))])
    stamp = (local / "train-000000.tar").stat().st_mtime_ns
    again = local_copy(url, tmp_path / "cache", progress=False)
    assert again.path == str(local)
    assert (local / "train-000000.tar").stat().st_mtime_ns == stamp  # not copied again
    (local / "val-000000.tar").unlink()  # a damaged cache is repaired
    local_copy(url, tmp_path / "cache", progress=False).close()
    assert (local / "val-000000.tar").read_bytes() == (shards / "val-000000.tar").read_bytes()
    lease.close()
    again.close()


def test_two_jobs_on_one_url_each_read_the_version_they_started_with(digits, shards, tmp_path):
    """The data at the URL is rebuilt while a job reads its cached copy: a second job copies the new
    version beside it, the first keeps reading its own files, and the old version goes once no job
    reads it."""
    remote = tmp_path / "remote"
    url = f"file://{remote}"
    shutil.copytree(shards, remote)
    first = local_copy(url, tmp_path / "cache", progress=False)
    old = read_index(first.path)
    reader = ShardDataset(old.splits["train"], None, lambda f: f.getvalue())
    before = [reader[row][0] for row in range(len(reader))]
    shutil.rmtree(remote)
    convert(digits, remote, shard_size=3 * SHARD_SIZE)  # rebuilt: other shards under the same names
    second = local_copy(url, tmp_path / "cache", progress=False)
    assert second.path != first.path
    reader.close()  # the first job's next samples are opened afresh: from its own version
    assert [reader[row][0] for row in range(len(reader))] == before
    assert all((Path(first.path) / p.name).read_bytes() == p.read_bytes() for p in data_files(shards))
    assert (Path(second.path) / "index.json").read_text() == (remote / "index.json").read_text()
    local_copy(url, tmp_path / "cache", progress=False).close()
    assert Path(first.path).exists()  # still read: kept
    first.close()
    local_copy(url, tmp_path / "cache", progress=False).close()
    assert not Path(first.path).exists() and Path(second.path).exists()  # no one reads it: removed
    second.close()


@pytest.mark.parametrize("url, message", [
    ("pipe:curl -s http://host/train-000000.tar", "pipe: URLs are not supported"),
    ("nosuchprotocol://bucket/shards", "nosuchprotocol"),
    ("memory://i30/nothing-here", "has no index.json"),
])
def test_url_errors_say_what_to_do(url, message, tmp_path, capsys):
    assert main(run_args(url, tmp_path / "run", "--cache-dir", tmp_path / "cache")) == 2
    err = capsys.readouterr().err
    assert message in err
    if "no index" in message:
        assert "scripts/make_shards.py" in err


def test_a_url_without_fsspec_names_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "fsspec", None)
    assert main(run_args("s3://bucket/shards", tmp_path / "run")) == 2
    assert "pip install fsspec" in capsys.readouterr().err


def test_the_shard_reader_benchmark_reads_every_sample(shards, digits, capsys):
    """scripts/perf/shard_readers.py (the reader against webdataset's): on the CPU with our reader
    (webdataset is optional), both kinds of work, a row each; a folder without an index is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("shard_readers", REPO / "scripts" / "perf" / "shard_readers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(shards), "--readers", "ours", "--workers", "0", "--batch-size", "8", "--passes", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ours |")]
    assert [row.split("|")[2].strip() for row in rows] == ["read", "decode"], rows
    assert all(float(row.split("|")[3].replace(",", "")) > 0 for row in rows)
    assert bench.main([str(digits), "--readers", "ours"]) == 2
    assert "no shard folder" in capsys.readouterr().out
