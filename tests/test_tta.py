"""scripts/perf/tta.py's CPU side: reading a run's rows and log, the recipes' sizes, the
projection's arithmetic and its tables (the GPU rows themselves run on the GPU machine)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from imagenet.cli import main

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tta", REPO / "scripts" / "perf" / "tta.py")
tta = importlib.util.module_from_spec(spec)
sys.modules["tta"] = tta  # its dataclass looks its module up
spec.loader.exec_module(tta)


def test_a_runs_rows_and_log_read_back(tmp_path, capsys):
    """The trainer's own metrics.jsonl and first-step lines, from a --dummy run through two sizes."""
    assert main(["--dummy", "-a", "resnet18", "-b", "8", "--epochs", "2", "--image-size", "16", "--progressive-resize",
                 "8", "--progressive-step", "8", "--progressive-ramp", "0:1", "--dummy-train-size", "16",
                 "--dummy-val-size", "8", "--dummy-classes", "4", "--output-dir", str(tmp_path)]) == 0
    log = capsys.readouterr().out
    epochs = tta.epochs_of([json.loads(line) for line in open(tmp_path / "metrics.jsonl")])
    assert [e["size"] for e in epochs] == [8, 16] and all(e["val_samples"] == 8 and e["val_s"] > 0 for e in epochs)
    assert all(e["ckpt"] >= 0 and e["overhead"] >= 0 and e["compiles"] is None for e in epochs)
    steps = tta.first_steps(log)
    assert set(steps) == {0, 16} and all(s >= 0 for s in steps.values())  # tenths of a second: 0.0 on a fast step


def test_a_gpu_decode_rows_share_and_decode_thread_are_read_from_its_input_stages():
    row = {"image_size": 160, "img_per_s": 13000.0, "data_wait_frac": 0.06, "train_seconds": 4.0, "train_samples": 40960,
           "val_samples": 2000, "val_seconds": 0.3, "epoch_seconds": 4.4,
           "input_stages": {"batches": 77, "starved": 1.3, "busy": 31.6, "ahead": 2.2, "decode_share": 0.33}}
    (got,) = tta.epochs_of([row])
    assert got["share"] == 0.33 and got["busy"] == pytest.approx(31.6 / 35.1)
    (plain,) = tta.epochs_of([{**row, "input_stages": None}])  # --dummy, --decode cpu: none
    assert plain["share"] is None and plain["busy"] is None


def test_the_recipes_are_ffcvs_with_their_sizes():
    recipes = {r.name: r for r in tta.recipes()}
    r16 = recipes["resnet50-ffcv-16.yaml"]
    assert r16.sizes == (160,) * 12 + (192,) * 4 and r16.batch == 4096 and r16.ffcv == (73.8, 14.9, 8)
    assert recipes["resnet50-ffcv-88.yaml"].sizes.count(192) == 17
    assert recipes["resnet18-ffcv-16.yaml"].ffcv == (66.9, 35.0, 1) and recipes["resnet18-ffcv-16.yaml"].batch == 1024
    assert len(recipes) == 8


def test_the_projection_adds_training_validation_checkpoints_and_compiling():
    r16 = next(r for r in tta.recipes() if r.name == "resnet50-ffcv-16.yaml")
    p = tta.project(r16, rates={160: 12000.0, 192: 9000.0}, val_rate=20000.0, ckpt_s=2.0,
                    overhead={160: 60.0, 192: 40.0})
    per_epoch = 312 * 4096  # ImageNet's 1,281,167 less the last partial batch of 4,096
    train = 12 * per_epoch / 12000 + 4 * per_epoch / 9000
    assert p["train_min"] == pytest.approx(train / 60)
    assert (p["val_min"], p["ckpt_min"], p["compile_min"]) == pytest.approx((16 * 2.5 / 60, 32 / 60, 100 / 60))
    assert p["total_min"] == pytest.approx((train + 40 + 32 + 100) / 60) and p["gpu_hours"] == pytest.approx(p["total_min"] / 60)
    assert p["ffcv_gpu_min"] == pytest.approx(119.2) and p["gpu_time_ratio"] == pytest.approx(119.2 / p["total_min"])
    assert tta.project(r16, rates={160: 12000.0}, val_rate=1.0, ckpt_s=0, overhead={}) is None  # 192 px unmeasured


def epoch(size, rate, overhead=0.0, val_s=1.0, ckpt=2.0, samples=10240):
    return {"size": size, "img_per_s": rate, "wait": 0.01, "compiles": 0, "train_s": 5.0, "overhead": overhead,
            "val_s": val_s, "val_samples": samples, "ckpt": ckpt}


RESULTS = {
    "recipe": {"epochs": [epoch(160, 11000.0, 90.0, val_s=20.0), epoch(192, 8500.0, 50.0)], "first_steps": {"0": 95.0}},
    "jpeg-j4": {"epochs": [epoch(160, 9000.0, 30.0, val_s=4.0, samples=5000), epoch(192, 8000.0, val_s=2.0, samples=5000)]},
    "jpeg-j8": {"epochs": [epoch(160, 10500.0, 30.0, val_s=4.0, samples=5000),
                           epoch(192, 8400.0, val_s=0.5, samples=5000, ckpt=1.5)]},
    "sizes-b256": {"epochs": [epoch(s, r) for s, r in ((128, 15000.0), (160, 12000.0), (192, 9500.0), (224, 8000.0))]},
    "typed-160": {"epochs": [epoch(160, 12100.0)]},
    "blur": {"bench": [{"img_per_s": 8000.0, "peak_gib": 30.0}, {"img_per_s": 7600.0, "peak_gib": 31.0}]},
}


def test_the_projection_takes_the_fastest_files_row_and_the_cold_compile():
    rates, val_rate, ckpt, overhead, source = tta.inputs_for(RESULTS, "resnet50")
    assert rates == {160: 10500.0, 192: 8400.0} and source.startswith("jpeg-j8")
    assert val_rate == 10000.0 and ckpt == 1.5
    # the recipe row compiled cold: 90 s at 160 px, plus validation's first compile (20 s less 1 s steady)
    assert overhead == {160: 90.0 + 19.0, 192: 50.0}
    assert tta.inputs_for(RESULTS, "resnet18") is None  # no rn18 row


def test_the_tables_print_from_rows_json(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(RESULTS))
    out = subprocess.run([sys.executable, "scripts/perf/tta.py", "--project", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60).stdout
    assert "| jpeg-j8 | 192 | 8,400 |" in out
    assert "0.992x" in out  # 12,000 against the typed command's 12,100 at 160 px
    assert "0.950x" in out  # BlurPool's 7,600 against 8,000
    rows = [line for line in out.splitlines() if line.startswith("| resnet50-ffcv-")]
    assert len(rows) == 6 and "| 16 |" in rows[0] and "(8x A100)" in rows[0]


def test_files_rows_are_set_beside_synthetic_at_each_size_leaving_out_the_first_epoch():
    results = {"recipe": RESULTS["recipe"],
               "jpeg-j8": {"epochs": [epoch(160, 9000.0), epoch(160, 10450.0), epoch(192, 8415.0)]},
               "sizes-b256": RESULTS["sizes-b256"],
               "jpeg-sizes-j4": {"epochs": [epoch(128, 9000.0), epoch(128, 13500.0), epoch(224, 7900.0)]}}
    rows = {(r["files"], r["size"]): r for r in tta.files_against(results)}
    assert set(rows) == {("jpeg-j8", 160), ("jpeg-j8", 192), ("jpeg-sizes-j4", 128), ("jpeg-sizes-j4", 224)}
    assert rows[("jpeg-j8", 160)]["ratio"] == pytest.approx(10450 / 11000)  # the second epoch at 160 px, not the first
    assert rows[("jpeg-j8", 192)]["ratio"] == pytest.approx(0.99)
    assert rows[("jpeg-sizes-j4", 128)]["ratio"] == pytest.approx(0.9) and rows[("jpeg-sizes-j4", 224)]["synthetic"] == "sizes-b256"
    assert tta.files_against({"jpeg-j8": results["jpeg-j8"]}) == []  # no synthetic row: nothing to set beside


def test_the_files_rows_train_each_size_after_a_first_epoch():
    from imagenet.base.config import parse_config
    from imagenet.data.transforms import image_size_at
    for name, sizes in (("jpeg-j8", [160, 160, 160, 160, 192]), ("jpeg-sizes-j8", [128, 128, 160, 192, 224])):
        cfg = parse_config(tta.shlex.split(tta.ROWS[name][1].replace("JPEG", "/data"))[1:])
        assert [image_size_at(e, cfg) for e in range(cfg.epochs)] == sizes, name


def test_every_main_row_is_a_command_line_main_accepts():
    import shlex

    from imagenet.base.config import parse_config
    for name, (_, template) in tta.ROWS.items():
        argv = shlex.split(template.replace("JPEG", "/data"))
        if argv[0] == "main.py":
            cfg = parse_config(argv[1:] + ["--output-dir", "/tmp/x"])
            assert cfg.arch in ("resnet50", "resnet18"), name
    assert set(tta.DEFAULT_ROWS.split(",")) <= set(tta.ROWS)
