"""metrics.jsonl: one record type, every key documented in docs/OPTIONS.md, nothing else leaks in."""

import json
import re
from pathlib import Path


from imagenet.base.metrics import EPOCH_KEYS, EpochRecord
from imagenet.cli import main
from tests.helpers import digits_fixture

OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md"


def documented_keys() -> set:
    """The keys of docs/OPTIONS.md's metrics.jsonl table (rows whose first cell lists `key`s)."""
    text = OPTIONS.read_text()
    table = text[text.index("Every line of `metrics.jsonl` has these keys"):]
    table = table[:table.index("\n\n", table.index("| key |"))]
    keys = set()
    for row in table.splitlines()[3:]:
        keys.update(re.findall(r"`([a-z0-9_]+)`", row.split("|")[1]))
    return keys


def test_the_documented_table_lists_exactly_the_record_fields():
    assert documented_keys() == set(EPOCH_KEYS)


digits = digits_fixture(4, 1)


def run(data, out, *extra):
    return main([data, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16", "--val-resize", "16",
                 "-p", "100", "--seed", "0", "--output-dir", str(out), *extra])


def test_every_row_key_is_documented_and_no_loop_control_leaks(digits, tmp_path):
    assert run(digits, tmp_path, "--epochs", "2", "--model-ema", "0.9") == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        assert set(row) <= documented_keys(), set(row) - documented_keys()
        # no --decode gpu, no --target-acc, no --compile here
        assert set(row) == set(EPOCH_KEYS) - {"decoded_on_gpu", "decode_fallbacks", "decoded_by_workers", "input_stages",
                                              "seconds_to_target", "compiles"}


def test_optional_keys_are_left_out_when_the_run_has_none():
    base = {k: 0 for k in EPOCH_KEYS if k not in EpochRecord.OPTIONAL}
    row = EpochRecord(**dict(base, loss_scale=None)).to_dict()
    assert set(row) == set(base) and row["loss_scale"] is None


def test_summary_counts_the_epochs_that_ran_under_prof(digits, tmp_path):
    from imagenet.base.config import parse_config
    from imagenet.training.runner import run as run_cfg
    summary = run_cfg(parse_config([digits, "-a", "resnet18", "-b", "8", "-j", "0", "--image-size", "16",
                                    "--val-resize", "16", "--epochs", "5", "--prof", "2",
                                    "--output-dir", str(tmp_path)]))
    assert summary["epochs_run"] == 1


def test_a_prof_run_adds_nothing_to_the_folders_history(tmp_path):
    """metrics.jsonl, skipped_images.txt and the TensorBoard scalars hold the folder's finished
    epochs: a --prof run's few batches go to prof.jsonl, so a later run there has one epoch 0."""
    import types

    import torch

    from imagenet.base.config import Config
    from imagenet.training.runlog import RunLog
    ctx = types.SimpleNamespace(is_main=True, device=torch.device("cpu"), distributed=False)
    train = types.SimpleNamespace(skipped_steps=0, steps=2, data_wait_frac=0.0, img_per_s=100.0)
    for prof, epoch in ((2, 0), (-1, 0), (-1, 1)):  # profiled, then a real run of two epochs
        with RunLog(Config(output_dir=str(tmp_path), prof=prof), ctx) as log:
            log.skipped_images(epoch, ["/data/train/a/bad.JPEG"], 1)
            log.catch_up({"epoch": 7})  # a checkpoint's row that metrics.jsonl lacks: a --prof run leaves it
            log.epoch({"epoch": epoch, "prof": prof}, train, None)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["epoch"], r.get("prof")) for r in rows] == [(7, None), (0, -1), (1, -1)]
    assert [json.loads(line) for line in open(tmp_path / "prof.jsonl")] == [{"epoch": 0, "prof": 2}]
    assert (tmp_path / "skipped_images.txt").read_text().splitlines() == [
        "epoch 0\t/data/train/a/bad.JPEG", "epoch 1\t/data/train/a/bad.JPEG"]


def test_a_prof_run_leaves_the_folders_config_yaml_alone(tmp_path):
    """config.yaml says how the folder's epochs were trained (--config repeats it): a --prof run in
    the folder writes its options to prof-config.yaml instead."""
    import types

    import torch
    import yaml

    from imagenet.base.config import Config
    from imagenet.training.runlog import RunLog
    ctx = types.SimpleNamespace(is_main=True, device=torch.device("cpu"), distributed=False)
    with RunLog(Config(output_dir=str(tmp_path), epochs=90), ctx):
        pass
    trained = (tmp_path / "config.yaml").read_text()
    with RunLog(Config(output_dir=str(tmp_path), epochs=5, prof=2), ctx):
        pass
    assert (tmp_path / "config.yaml").read_text() == trained
    profiled = yaml.safe_load((tmp_path / "prof-config.yaml").read_text())
    assert (profiled["prof"], profiled["epochs"]) == (2, 5)
