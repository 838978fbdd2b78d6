"""scripts/perf/input_matrix.py: its rows as written expand to the runs the GPU call makes."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "perf" / "input_matrix.py"
_spec = importlib.util.spec_from_file_location("input_matrix", _PATH)
input_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(input_matrix)


def test_rows_expand_to_their_product_in_order():
    rows = input_matrix.parse_rows("synthetic:256,384;folder:cpu,gpu:2,4:256:eager;shards:auto:4:384:graphs:ddp2;"
                                   "folder:gpu:4:256:graphs:one:A=x+B=2")
    assert rows == [("synthetic", "-", 0, 256, "graphs", "one", ""), ("synthetic", "-", 0, 384, "graphs", "one", ""),
                    ("folder", "cpu", 2, 256, "eager", "one", ""), ("folder", "cpu", 4, 256, "eager", "one", ""),
                    ("folder", "gpu", 2, 256, "eager", "one", ""), ("folder", "gpu", 4, 256, "eager", "one", ""),
                    ("shards", "auto", 4, 384, "graphs", "ddp2", ""), ("folder", "gpu", 4, 256, "graphs", "one", "A=x+B=2")]
    assert [input_matrix.row_name(*r) for r in rows[-3:]] == ["folder-gpu-j4-b256-eager",
                                                              "shards-auto-j4-b384-graphs-ddp2",
                                                              "folder-gpu-j4-b256-graphs-x-2"]


@pytest.mark.parametrize("spec", ["folder:cpu:4", "tape:cpu:4:256", "folder:cpu:4:256:fast", "folder:png:4:256",
                                  "folder:cpu:4:256:graphs:one:NOVALUE"])
def test_a_malformed_row_is_refused(spec):
    with pytest.raises(SystemExit, match="error: row"):
        input_matrix.parse_rows(spec)


def test_the_ddp_row_starts_two_slurm_tasks_on_gpu_0():
    data = {"folder": "/d", "shards": "/s", "per_epoch": 1000}
    args = type("A", (), {"model": "-a resnet50 --fp16", "epochs": 3})()
    procs = input_matrix.command(("folder", "auto", 4, 256, "graphs", "ddp2", "X=1"), args, data, "/o")
    assert all(env["X"] == "1" for env, _ in procs)
    assert [(env["SLURM_PROCID"], env["CUDA_VISIBLE_DEVICES"]) for env, _ in procs] == [("0", "0"), ("1", "0")]
    assert all(line.startswith("main.py /d -a resnet50 --fp16 -b 256") and "--decode" not in line
               and line.endswith("--dist-backend gloo") for _, line in procs)
