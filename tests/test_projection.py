"""scripts/perf/mlperf_projection.py: the arithmetic that turns one GPU's measured rates into the
time to MLPerf's target on 8 GPUs (hand-worked numbers, not measurements)."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mlperf_projection", REPO / "scripts" / "perf" / "mlperf_projection.py")
proj = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proj)


def test_mlperfs_validations_are_its_epochs_3_7_to_35():
    assert proj.evaluations(35) == 9 and proj.evaluations(38) == 9 and proj.evaluations(39) == 10


def test_the_projection_adds_training_validation_and_overhead():
    r = proj.project(rate=1000.0, eval_rate=2000.0, gpus=8, epochs=35, batch=3200, overhead=1.0)
    assert r["images_per_epoch"] == 400 * 3200  # the last partial batch dropped
    assert r["train_s"] == pytest.approx(35 * 1280000 / 8000)
    assert r["validate_s"] == pytest.approx(9 * 50000 / 16000)
    assert r["minutes"] == pytest.approx((5600 + 28.125 + 35) / 60)
    half = proj.project(rate=1000.0, eval_rate=2000.0, scaling=0.5)
    assert half["train_s"] == pytest.approx(2 * r["train_s"])


def test_the_rate_for_a_goal_inverts_the_projection():
    kw = dict(eval_rate=20000.0, gpus=8, scaling=0.95, overhead=0.5)
    rate = proj.rate_for(11.0, **kw)
    assert proj.project(rate=rate, **kw)["minutes"] == pytest.approx(11.0)
    assert proj.rate_for(0.1, **kw) == float("inf")  # validation alone takes longer


def test_rates_come_from_a_runs_last_validated_row(tmp_path, capsys):
    rows = [{"img_per_s": 9000.0, "val_samples": 50000, "epoch_seconds": 12.5, "train_seconds": 10.0},
            {"img_per_s": 9100.0, "val_samples": None, "epoch_seconds": 11.0, "train_seconds": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert proj.rates_of_run(str(tmp_path)) == (9000.0, 20000.0)  # a row without val_seconds
    rows[0]["val_seconds"] = 2.0  # the validation alone, without the checkpoint's write
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert proj.rates_of_run(str(tmp_path)) == (9000.0, 25000.0)
    assert proj.main(["--from-run", str(tmp_path)]) == 0
    assert "min (MLPerf v4.0, NVIDIA 8x H200: 12.03 min" in capsys.readouterr().out
