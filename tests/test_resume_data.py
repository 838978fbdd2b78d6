"""A mid-epoch resume trains what its checkpoint says: the rest of the same epoch's images, and
the epoch's unreadable images all counted.

* What decides the data's order (the training folder's file list or the shard index, --seed,
  --shuffle-window) is in the checkpoint; a mid-epoch resume on changed data stops with one line
  (exit 2) naming what changed and --on-data-change, or with --on-data-change restart-epoch
  trains the epoch again from its start. The same data elsewhere, or another world size, is no
  change; an epoch's end and an older checkpoint without the record resume with a note.
* The epoch's count of unreadable images rides in the checkpoint: the resumed epoch reports,
  and --max-bad-fraction judges, the whole epoch's.
"""

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from imagenet.base import checkpoint as ckpt_io
from imagenet.base.config import Config
from imagenet.base.errors import UserError
from imagenet.base.metrics import DeviceSums, means
from imagenet.cli import main
from imagenet.data import dataorder
from imagenet.data.shards import writer as shardwriter
from imagenet.data.loaders import build_datasets
from imagenet.data.samplers import SeededSampler, ShardWindowSampler
from imagenet.training import engine
from imagenet.training.resume import _check_data_order
from imagenet.training.state import Progress
from tests.helpers import digits_fixture, interrupt_after_step, last_checkpoint, make_digits, scratch

SHARD_SIZE = 16_000  # about 5 digits a shard: 8 training shards of 40 images


def run_args(data, out, *extra):
    """A seeded ResNet-18 run at 16 px, batch 8, loading in-process, for one epoch."""
    return [str(data), "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16",
            "-p", "100", "--seed", "0", "--lr", "0.02", "--epochs", "1", "--output-dir", str(out), *map(str, extra)]


def rows(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def stopped_at(data, out, step, *extra):
    """Run until a mid-epoch checkpoint at ``step`` of epoch 0 is written, then stop as a kill -9 would."""
    with pytest.MonkeyPatch.context() as mp:
        interrupt_after_step(mp, step)
        assert main(run_args(data, out, "--save-every-steps", step, *extra)) == 130
    ckpt = last_checkpoint(out)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, step)
    return ckpt


def copy_checkpoint(src, dst) -> Path:
    dst = Path(dst)
    dst.mkdir(parents=True)
    shutil.copy(Path(src) / ckpt_io.CHECKPOINT, dst / ckpt_io.CHECKPOINT)
    return dst


def resume(data, out, *extra):
    """``--resume auto`` in ``out``: (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(run_args(data, out, "--resume", "auto", *extra))
    return rc, stdout.getvalue(), stderr.getvalue()


def first_step(data, out, *extra):
    """``--resume auto`` in ``out``, stopped right after its first step; (exit status, stdout, the
    epoch's batches done at that step: where the resumed run started, plus one)."""
    seen = []
    real = engine.train_one_epoch

    def one_step(*a, **k):
        def hook(done, sums):
            seen.append(done)
            raise KeyboardInterrupt
        return real(*a, **dict(k, on_step=hook))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("imagenet.training.runner.train_one_epoch", one_step)
        rc, printed, stderr = resume(data, out, *extra)
    assert rc == 130 and len(seen) == 1, stderr
    return printed, seen[0]


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


digits = digits_fixture(4, 1)  # 40 train (5 steps of 8), 10 val


@pytest.fixture(scope="module")
def folder_stop(digits, tmp_path_factory):
    """A folder run stopped after step 2 of epoch 0, its checkpoint written there."""
    with scratch(tmp_path_factory, "folder_stop") as out:
        stopped_at(digits, out, 2)
        yield out


@pytest.fixture(scope="module")
def shards(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "out"
    shardwriter.make_shards(str(digits), str(out), shard_size=SHARD_SIZE, seed=0, workers=0, progress=False)
    return out


WINDOW = ("--shuffle-window", 10)  # 2 of the 8 training shards at a time


@pytest.fixture(scope="module")
def shard_stop(shards, tmp_path_factory):
    """A shard run (--shuffle-window 10) stopped after step 2 of epoch 0."""
    with scratch(tmp_path_factory, "shard_stop") as out:
        stopped_at(shards, out, 2, *WINDOW)
        yield out


# ------------------------------------------------------------------ the data's order changed since

def test_a_folder_that_gained_files_stops_a_mid_epoch_resume(digits, folder_stop, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    for i, image in enumerate(sorted((data / "train" / "3").iterdir())):
        shutil.copy(image, data / "train" / "3" / f"new-{i}.png")
    out = copy_checkpoint(folder_stop, tmp_path / "run")
    rc, _, stderr = resume(data, out)
    assert rc == 2
    line = one_error_line(stderr)
    assert "middle of epoch 0 (after step 2)" in line and "file list changed: 40 images then, 44 now" in line
    assert "--on-data-change restart-epoch" in line
    assert last_checkpoint(out)["step_in_epoch"] == 2  # nothing written over


def test_another_seed_stops_a_mid_epoch_resume(digits, folder_stop, tmp_path):
    out = copy_checkpoint(folder_stop, tmp_path / "run")
    rc, _, stderr = resume(digits, out, "--seed", 1)
    assert rc == 2
    line = one_error_line(stderr)
    assert "--seed 0 then, 1 now" in line and "--on-data-change restart-epoch" in line


def test_another_shuffle_window_stops_a_mid_epoch_resume_or_restarts_the_epoch(shards, shard_stop, tmp_path):
    out = copy_checkpoint(shard_stop, tmp_path / "run")
    rc, _, stderr = resume(shards, out, "--shuffle-window", 20)
    assert rc == 2
    assert "--shuffle-window 10 then (2 shards shuffled together), 20 now (4)" in one_error_line(stderr)
    printed, done = first_step(shards, out, "--shuffle-window", 20, "--on-data-change", "restart-epoch")
    assert "epoch 0 restarts from its start (--on-data-change restart-epoch)" in printed
    assert done == 1  # the epoch's first batch, not its third


def test_rebuilt_shards_stop_a_mid_epoch_resume(digits, shard_stop, tmp_path):
    rebuilt = tmp_path / "rebuilt"  # the same images, packed into shards of another size
    shardwriter.make_shards(str(digits), str(rebuilt), shard_size=2 * SHARD_SIZE, seed=0, workers=0, progress=False)
    out = copy_checkpoint(shard_stop, tmp_path / "run")
    rc, _, stderr = resume(rebuilt, out, *WINDOW)
    assert rc == 2
    line = one_error_line(stderr)
    assert "the shard index (make_shards re-run?) changed: 40 images then, 40 now" in line


def test_shards_rebuilt_in_place_stop_a_mid_epoch_resume(digits, shards, shard_stop, tmp_path):
    """make_shards re-run in the folder after a source file changed: the next generation of its
    index (new names, the old files kept) is still a change of the data's order."""
    src, data = tmp_path / "src", tmp_path / "shards"
    shutil.copytree(digits, src)  # the times kept: the same conversion
    shutil.copytree(shards, data)
    image = sorted((src / "train" / "3").iterdir())[0]
    image.write_bytes(sorted((src / "train" / "5").iterdir())[0].read_bytes())
    report = shardwriter.make_shards(str(src), str(data), shard_size=SHARD_SIZE, seed=0, workers=0, progress=False)
    assert report.changed_source and report.generation == 1
    out = copy_checkpoint(shard_stop, tmp_path / "run")
    rc, _, stderr = resume(data, out, *WINDOW)
    assert rc == 2
    assert "the shard index (make_shards re-run?) changed" in one_error_line(stderr)


@pytest.fixture(scope="module")
def last_step_stop(digits, tmp_path_factory):
    """A folder run stopped right after the checkpoint of epoch 0's last step (5 of 5), before its
    validation: what --save-every-steps writes there, and what an elastic restart resumes from."""
    with scratch(tmp_path_factory, "last_step_stop") as out:
        ckpt = stopped_at(digits, out, 5)
        assert ckpt["epoch_trained"] is True
        yield out


@pytest.mark.parametrize("on_change", ["stop", "restart-epoch"])
def test_a_checkpoint_after_an_epochs_last_step_is_at_the_epochs_end(digits, last_step_stop, tmp_path, on_change):
    """On changed data (48 images now: 6 steps) it is no mid-epoch checkpoint: the run validates the
    trained epoch without training any of it again (no sixth step either), with the epoch boundary's
    line, and trains the next epoch from its start."""
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    for i, image in enumerate(sorted((data / "train").rglob("*.png"))[:8]):
        shutil.copy(image, image.parent / f"new-{i}.png")
    out = copy_checkpoint(last_step_stop, tmp_path / "run")
    printed, done = first_step(data, out, "--on-data-change", on_change, "--epochs", 2)
    assert "middle of epoch" not in printed and "restarts from its start" not in printed
    assert "the training data's order changed since" in printed
    assert "epoch 1 is trained from its start, every image of it once" in printed
    assert "continuing at epoch 0, step 5 (its last: its validation, then epoch 1 from its start)" in printed
    [epoch0] = rows(out)
    assert (epoch0["epoch"], epoch0["steps"], epoch0["train_samples"]) == (0, 0, 40)
    assert done == 1 and "Epoch: [1][0/6]" in printed  # the first step the resumed run took


def test_a_trained_epoch_takes_no_batch_from_the_synthetic_loader_either():
    """--dummy's loader counts batches, not samples: a trained epoch leaves it empty too."""
    from types import SimpleNamespace
    from imagenet.data.synthetic import SyntheticDataset, SyntheticLoader
    from imagenet.training.runner import _begin_epoch
    loader = SyntheticLoader(SyntheticDataset(40, 10, 16, seed=1), batch=8, samples=40, drop_last=True,
                             device=torch.device("cpu"), channels_last=False)
    cfg, ctx = Config(batch_size=8), SimpleNamespace(distributed=False, is_main=True)
    _begin_epoch(cfg, ctx, loader, Progress(0, 5, trained=True), first=True)
    assert len(loader) == 0
    _begin_epoch(cfg, ctx, loader, Progress(0, 2), first=True)
    assert len(loader) == 3


def test_the_same_data_elsewhere_resumes_where_it_stopped(digits, folder_stop, tmp_path):
    data = tmp_path / "moved"
    shutil.copytree(digits, data)
    out = copy_checkpoint(folder_stop, tmp_path / "run")
    printed, done = first_step(data, out)
    assert "continuing at epoch 0, step 2" in printed and "order changed" not in printed
    assert done == 3


def test_an_older_checkpoint_without_the_record_resumes_with_a_note(digits, folder_stop, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    old = ckpt_io.read_checkpoint(str(folder_stop / ckpt_io.CHECKPOINT))
    del old["data_order"]
    old["train_partial"] = old["train_partial"][:4]  # nor an unreadable count in its sums
    torch.save(old, out / ckpt_io.CHECKPOINT)
    printed, done = first_step(digits, out, "--seed", 1)  # a change it cannot see
    assert "holds no record of the data's order" in printed and done == 3


# ------------------------------------------------------------------ the fingerprint and the check, unit level

def _fingerprint(root, world=1, **cfg):
    data = build_datasets(dataclasses.replace(Config(), image_size=16, val_resize=16, **cfg), str(root))
    table = getattr(data.train, "table", None)
    if table is None:
        sampler = SeededSampler(data.train, world, 0, cfg.get("seed") or 0)
    else:
        sampler = ShardWindowSampler(table["shard"], table["id"], world, 0, 0, cfg.get("shuffle_window", 65536))
    return dataorder.fingerprint(data.train, sampler)


def test_the_fingerprint_leaves_out_what_does_not_change_the_order(digits, shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    assert _fingerprint(digits) == _fingerprint(copy) == _fingerprint(digits, world=2)
    assert _fingerprint(digits)["source"] == dataorder.FOLDER
    # every window at least the set's 40 images is one full shuffle: the same order
    full, larger = _fingerprint(shards, shuffle_window=40), _fingerprint(shards, shuffle_window=65536)
    assert dataorder.changes(full, larger) == [] and full["shards_together"] == 8
    assert dataorder.changes(_fingerprint(shards, shuffle_window=10), full)
    assert dataorder.changes(_fingerprint(digits), full) == [f"the training data was {dataorder.FOLDER}, now "
                                                             f"{dataorder.SHARDS}"]


def _check(saved, now, step, on_data_change="stop"):
    ckpt = {"data_order": saved} if saved != "absent" else {}
    cfg = dataclasses.replace(Config(), on_data_change=on_data_change)
    return _check_data_order(ckpt, Progress(3, step, 10.0, [1.0, 2.0, 3.0, 4.0, 5.0]), "ckpt", cfg, now)


def test_the_check_acts_mid_epoch_only_and_as_told(caplog):
    a = {"source": dataorder.FOLDER, "images": 40, "digest": "x", "seed": 0}
    b = dict(a, images=44, digest="y")
    with pytest.raises(UserError, match="--on-data-change restart-epoch"):
        _check(a, b, step=2)
    restarted = _check(a, b, step=2, on_data_change="restart-epoch")
    assert (restarted.epoch, restarted.step, restarted.sums, restarted.best_acc1) == (3, 0, None, 10.0)
    caplog.set_level("INFO", logger="imagenet")
    caplog.clear()
    assert _check(a, b, step=0).step == 0  # an epoch's end: a whole epoch follows anyway
    assert "epoch 3 is trained from its start" in caplog.text
    for saved, now in ((a, a), (a, None), (None, a), ("absent", a)):
        assert _check(saved, now, step=2).step == 2, (saved, now)


# ------------------------------------------------------------------ unreadable images counted over a resume

def test_device_sums_count_unreadable_images_and_take_older_sums():
    sums = DeviceSums(torch.device("cpu"))
    sums.seed([2.0, 1.0, 2.0, 4.0])  # a checkpoint written before the count rode in the sums
    sums.unreadable(3)
    sums.add(torch.tensor(0.5), torch.eye(5)[:2], torch.tensor([0, 1]))
    assert sums.raw() == [3.0, 3.0, 4.0, 6.0, 3.0]
    assert means(sums.raw())["unreadable"] == 3 and means([2.0, 1.0, 2.0, 4.0])["unreadable"] == 0
    assert Progress(0, 2, 0.0, sums.raw()).unreadable == 3 and Progress().unreadable == 0


BAD_TRAIN, BAD_VAL = 10, 1


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory):
    """30 digits and 10 empty files in train/ (5 steps of 8), 10 digits and one empty file in val/."""
    root = tmp_path_factory.mktemp("bad_tree")
    make_digits(root, train_per_class=3, val_per_class=1)
    for i in range(BAD_TRAIN):
        (root / "train" / str(i) / "empty.png").write_bytes(b"")
    (root / "val" / "0" / "empty.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def bad_stop(bad_tree, tmp_path_factory):
    """The bad tree's run stopped after step 4 of 5, and the unreadable images it had met."""
    with scratch(tmp_path_factory, "bad_stop") as out:
        ckpt = stopped_at(bad_tree, out, 4, "--max-bad-fraction", 1)
        yield out, means(ckpt["train_partial"])["unreadable"]


def test_a_resumed_epoch_counts_the_unreadable_images_of_the_whole_epoch(bad_tree, bad_stop, tmp_path):
    stopped, before = bad_stop
    assert before > 0  # a resumed run that counts only its own part would come short
    out = copy_checkpoint(stopped, tmp_path / "run")
    rc, printed, stderr = resume(bad_tree, out, "--max-bad-fraction", 1)
    assert rc == 0, stderr
    assert rows(out)[-1]["skipped_images"] == BAD_TRAIN + BAD_VAL
    assert "not listed" not in printed
    # every one listed, those met before the resume too: the checkpoint carried their paths
    listed = [line.split("\t") for line in (out / "skipped_images.txt").read_text().splitlines()]
    assert sorted(path for _, path in listed) == sorted(str(p) for p in bad_tree.rglob("empty.png"))
    assert {epoch for epoch, _ in listed} == {"epoch 0"}


def test_a_checkpoint_keeps_the_first_paths_and_the_list_says_how_many_it_lacks(tmp_path, monkeypatch):
    """The paths a mid-epoch checkpoint carries are bounded (engine.CARRIED_PATHS); the count is
    whole, and skipped_images.txt says how many of the epoch's it cannot name."""
    from types import SimpleNamespace
    from imagenet.training.runlog import RunLog
    from imagenet.training.runner import _count_skipped
    monkeypatch.setattr(engine, "CARRIED_PATHS", 3)
    ctx = SimpleNamespace(is_main=True, distributed=False, device=torch.device("cpu"))
    assert engine.skipped_so_far(["a"], ["b", "c", "d"], ctx) == ["a", "b", "c"]
    resumed = Progress(0, 2, 0.0, [0.0, 0.0, 0.0, 0.0, 5.0], skipped=["a", "b", "c"])  # 5 met, 3 carried
    saved = Progress()
    saved.load_state_dict(resumed.state_dict())
    assert saved.skipped == ["a", "b", "c"] and saved.unreadable == 5
    cfg = Config(output_dir=str(tmp_path), max_bad_fraction=1.0)
    with RunLog(cfg, ctx) as log:
        assert _count_skipped(cfg, ctx, log, ["e"], 0, 100, before=saved) == 6
    assert (tmp_path / "skipped_images.txt").read_text().splitlines() == [
        "epoch 0\ta", "epoch 0\tb", "epoch 0\tc", "epoch 0\te",
        "# epoch 0: 2 of them, met before the run resumed in this epoch, not listed (the checkpoint resumed did "
        "not keep their paths)"]


def test_max_bad_fraction_judges_the_whole_epoch_after_a_resume(bad_tree, bad_stop, tmp_path):
    total, bad = 40 + 11, BAD_TRAIN + BAD_VAL  # 22%: over a limit the part after the stop stays under
    out = copy_checkpoint(bad_stop[0], tmp_path / "run")
    rc, _, stderr = resume(bad_tree, out, "--max-bad-fraction", 0.21)
    assert rc == 2
    assert f"{bad} of {total} images could not be read" in one_error_line(stderr)
