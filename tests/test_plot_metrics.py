"""Tests for scripts/plot_metrics.py: learning-curve PNGs, run summaries and one-line errors."""

import builtins
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "plot_metrics.py"
_spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
plot_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_metrics)

# Five epochs of a ResNet-50-like ImageNet run in the trainer's record format (metrics.EpochRecord,
# written by imagenet/training/runlog.py).
FP32 = dict(lr=[0.04, 0.1, 0.0905, 0.0655, 0.0345], train_loss=[6.41, 5.02, 4.11, 3.58, 3.21],
            val_loss=[5.73, 4.48, 3.72, 3.31, 3.02], train_acc1=[2.9, 11.8, 22.4, 29.7, 35.2],
            val_acc1=[5.1, 17.6, 28.9, 35.4, 39.8], val_acc5=[15.2, 38.9, 53.6, 61.0, 65.7],
            img_per_s=[1874.2, 1902.5, 1899.1, 1905.8, 1897.3], loss_scale=[None] * 5,
            skipped_steps=[0] * 5, skipped_images=[0] * 5)
FP16 = dict(FP32, train_loss=[6.45, 5.06, 4.15, 3.60, 3.24], val_loss=[5.80, 4.52, 3.70, 3.29, 3.35],
            val_acc1=[4.8, 17.1, 29.3, 36.0, 34.2], img_per_s=[5712.4, 5820.9, 5803.3, 5831.0, 5815.6],
            loss_scale=[32768.0, 32768.0, 65536.0, 65536.0, 32768.0], skipped_steps=[3, 0, 0, 0, 1],
            skipped_images=[0, 2, 0, 0, 1])


def write_run(path: Path, series: dict, precision: str, lines=None) -> Path:
    """An output dir whose metrics.jsonl holds ``series`` as five epoch records (or the raw ``lines``)."""
    path.mkdir(parents=True, exist_ok=True)
    if lines is None:
        lines, best = [], 0.0
        for epoch in range(5):
            rec = {key: values[epoch] for key, values in series.items()}
            best = max(best, rec["val_acc1"] or 0.0)  # null: an epoch --eval-every did not validate
            rec.update(epoch=epoch, train_acc5=rec["train_acc1"] + 20, train_samples=1281167, steps=5004,
                       train_seconds=1281167 / rec["img_per_s"], val_samples=50000, epoch_seconds=700.0,
                       skipped_steps_total=sum(series["skipped_steps"][:epoch + 1]), best_acc1=best,
                       precision=precision, mode="ddp", world_size=8)
            lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def runs(tmp_path):
    return write_run(tmp_path / "fp32", FP32, "fp32"), write_run(tmp_path / "fp16", FP16, "fp16")


@pytest.fixture
def figures(monkeypatch):
    """Every figure the script saves (it still writes the file), for checking what was drawn."""
    from matplotlib.figure import Figure
    saved, real_savefig = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def check_png(path: Path):
    from PIL import Image
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.width >= 1000 and im.height >= 600
        im.verify()


def check_one_line_error(rc, out, err, *words):
    assert rc == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err


def run_main(capsys, *argv):
    rc = plot_metrics.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ------------------------------------------------------------------------------------------ plots


def test_one_run_writes_curves_png_into_its_dir(runs, capsys):
    pytest.importorskip("matplotlib")
    rc, out, err = run_main(capsys, runs[0])
    assert rc == 0, err
    check_png(runs[0] / "curves.png")
    assert out.splitlines()[-1] == f"wrote {runs[0] / 'curves.png'}"


def test_two_runs_overlay_in_one_png(runs, tmp_path, capsys, figures):
    pytest.importorskip("matplotlib")
    target = tmp_path / "cmp.png"
    rc, out, err = run_main(capsys, *runs, "--out", target, "--title", "fp32 vs fp16")
    assert rc == 0, err
    check_png(target)
    (fig,) = figures
    assert fig._suptitle.get_text() == "fp32 vs fp16"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fp32", "fp16"]
    loss, acc, lr, speed, scale, skipped = fig.axes
    assert len(loss.lines) == 4  # train and val per run
    assert len(acc.lines) == 6  # train, val and the best-val star per run
    assert len(lr.lines) == len(speed.lines) == 2
    # the panel plots `lr`, the rate at each epoch's first step (lr_end is the rate after its last)
    assert list(lr.lines[0].get_ydata()) == FP32["lr"]
    assert "first step" in lr.get_title() and "end" not in lr.get_title()
    assert len(scale.lines) == 1 and scale.get_yscale() == "log"  # only fp16 scales its loss
    assert scale.get_title().endswith("no loss scaling: fp32")
    assert len(skipped.lines) == 2  # fp16's overflow steps and unreadable images; fp32 skipped nothing
    star = acc.lines[5]  # fp16's best val epoch is 3, not the last one
    assert list(star.get_xdata()) == [3] and list(star.get_ydata()) == [36.0]


def test_the_val_curves_join_the_validated_epochs(tmp_path, capsys, figures):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "every2", dict(FP32, val_loss=[None, 4.48, None, 3.31, 3.02],
                                              val_acc1=[None, 17.6, None, 35.4, 39.8]), "fp16")
    rc, _, err = run_main(capsys, run, "--out", tmp_path / "cadence.png")
    assert rc == 0, err
    loss, acc = figures[0].axes[:2]
    assert list(acc.lines[1].get_xdata()) == [1, 3, 4] and list(acc.lines[1].get_ydata()) == [17.6, 35.4, 39.8]
    assert list(loss.lines[1].get_xdata()) == [1, 3, 4]


def test_no_loss_scaling_panel_says_so(runs, tmp_path, capsys, figures):
    pytest.importorskip("matplotlib")
    rc, _, err = run_main(capsys, runs[0], "--out", tmp_path / "one.png")
    assert rc == 0, err
    scale, skipped = figures[0].axes[4:]
    assert not scale.lines and [t.get_text() for t in scale.texts] == ["no loss scaling"]
    assert [t.get_text() for t in skipped.texts] == ["nothing skipped"]


def test_several_runs_default_to_curves_png_in_cwd(runs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc, out, err = run_main(capsys, *runs)
    assert rc == 0, err
    check_png(cwd / "curves.png")
    assert not (runs[0] / "curves.png").exists()


def test_summary_paragraph_per_run(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, out, err = run_main(capsys, *runs, "--out", tmp_path / "s.png")
    assert rc == 0, err
    fp32, fp16, wrote = out.splitlines()
    assert fp32 == ("fp32: 5 epochs (0-4; fp32, ddp x8); best val Acc@1 39.800 (epoch 4), last 39.800 (epoch 4); "
                    "median 1,899 img/s; 0 skipped images, 0 overflow steps skipped; no loss scaling.")
    assert fp16 == ("fp16: 5 epochs (0-4; fp16, ddp x8); best val Acc@1 36.000 (epoch 3), last 34.200 (epoch 4); "
                    "median 5,816 img/s; 3 skipped images, 4 overflow steps skipped; final loss scale 32768.")
    assert wrote == f"wrote {tmp_path / 's.png'}"


def test_resumed_run_keeps_the_later_record_of_a_repeated_epoch(tmp_path):
    records = [{"epoch": 0, "val_acc1": 10.0}, {"epoch": 1, "val_acc1": 20.0}, {"epoch": 1, "val_acc1": 21.0},
               {"epoch": 2, "val_acc1": 30.0, "loss_scale": None}]
    run = write_run(tmp_path / "r", {}, "fp32", lines=[json.dumps(r) for r in records] + [""])
    loaded = plot_metrics.load_metrics(str(run))
    assert [r["epoch"] for r in loaded] == [0, 1, 2]
    assert loaded[1]["val_acc1"] == 21.0


def test_labels_fall_back_to_paths_when_dir_names_clash():
    assert plot_metrics.run_labels(["a/out", "b/out/", "c/fp16"]) == ["a/out", "b/out", "fp16"]


# ----------------------------------------------------------------------------------------- errors


def test_dir_without_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    check_one_line_error(*run_main(capsys, tmp_path / "empty"), "has no metrics.jsonl")
    check_one_line_error(*run_main(capsys, tmp_path / "nope"), "is not a directory")


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_metrics(tmp_path, capsys, text):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    check_one_line_error(*run_main(capsys, run), "metrics.jsonl is empty")


@pytest.mark.parametrize("bad, why", [('{"epoch": 2, "val_acc1": 3', "not valid JSON"),
                                      ("[1, 2]", "not a JSON object"),
                                      ('{"epoch": 2, "val_acc1": "high"}', "'val_acc1' is 'high'"),
                                      ('{"epoch": "two"}', "'epoch' is 'two'")])
def test_corrupt_line_names_file_and_line(runs, tmp_path, capsys, bad, why):
    lines = (runs[0] / "metrics.jsonl").read_text().splitlines()
    run = write_run(tmp_path / "bad", {}, "fp32", lines=lines[:2] + [bad] + lines[2:])
    rc, out, err = run_main(capsys, runs[1], run, "--out", tmp_path / "x.png")
    check_one_line_error(rc, out, err, f"{run / 'metrics.jsonl'} line 3", why)
    assert not (tmp_path / "x.png").exists()


def test_unwritable_out(runs, tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    check_one_line_error(*run_main(capsys, runs[0], "--out", blocker / "c.png"), "cannot write --out")
    check_one_line_error(*run_main(capsys, runs[0], "--out", tmp_path / "missing" / "c.png"), "cannot write --out")
    check_one_line_error(*run_main(capsys, runs[0], "--out", tmp_path), "is a directory")


def test_missing_matplotlib_in_process(runs, tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
    rc, out, err = run_main(capsys, runs[0], "--out", tmp_path / "c.png")
    assert err == "error: plotting needs matplotlib: pip install matplotlib\n"
    check_one_line_error(rc, out, err)
    assert not (tmp_path / "c.png").exists()


def test_missing_matplotlib_from_the_command_line(runs, tmp_path):
    # A meta-path finder that refuses matplotlib, then the script run as __main__ from a foreign cwd.
    wrapper = ("import sys, runpy\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'matplotlib': raise ImportError('blocked: ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               f"sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]\n"
               f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, str(runs[0])], capture_output=True, text=True,
                          cwd="/", timeout=60)
    assert proc.stderr == "error: plotting needs matplotlib: pip install matplotlib\n"
    check_one_line_error(proc.returncode, proc.stdout, proc.stderr)
    assert not (runs[0] / "curves.png").exists()
