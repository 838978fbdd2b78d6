"""main.py end to end on one GPU with the speed defaults its plain command takes there
(channels_last, the Triton max-pool and BatchNorm kernels, torch.compile with CUDA graphs): the
runs of tests/gpuruns.py, which start with the session.

The DDP runs must train as the one-process run does. Their training images come in pairs of
identical pixels that the sampler hands to rank 0 and to rank 1 at the same step (each crop the
whole image, no flips), under labels that mostly differ: every rank's BatchNorm statistics are
then those of the global batch, as in the one-process run, while the ranks' gradients differ.
On a CPU, with this data and these steps, the fp32 runs agreed to 1e-5, while a rank that skipped
the all-reduce moved the loss by 3% and the weights' updates by 135%, and gradients summed instead
of averaged by 3% and 163%.
"""

import json
import math
import re

import pytest

from tests.gpuruns import BATCH, STEPS

pytestmark = pytest.mark.gpu

SPEED_DEFAULTS = ("channels_last", "stem max-pool on Triton kernels", "BatchNorm + add + ReLU fused in Triton",
                  "torch.compile with CUDA graphs (reduce-overhead)")


def _took_the_speed_defaults(banner: str) -> None:
    for what in SPEED_DEFAULTS:
        # "BatchNorm + add + ReLU fused in Triton, statistics made by cuDNN's ..." where the frontend is installed
        assert re.search(rf"^=> default: {re.escape(what)}[:,] ", banner, re.M), f"no '{what}' line:\n{banner[-3000:]}"
    assert "=> first step done" in banner


def test_two_processes_on_one_gpu_train_as_one_with_the_speed_defaults(training_runs):
    one, two = training_runs.output("one"), training_runs.output("two.0")
    training_runs.output("two.1")  # rank 1 logs warnings only: it ended well
    _took_the_speed_defaults(one)
    _took_the_speed_defaults(two)
    assert "=> mode: single cuda:0" in one and "=> mode: DistributedDataParallel, rank 0 of 2 (gloo, cuda:0)" in two
    row = training_runs.row("two")
    # both ranks' images: the totals are summed over the ranks
    assert (row["world_size"], row["steps"], row["train_samples"]) == (2, STEPS, STEPS * BATCH), row
    a, b = training_runs.losses("one"), training_runs.losses("two.0")
    # On an H200 the two ran 0.6% apart at most over the 5 steps (cuDNN's algorithms and the
    # kernels' reductions are not bit-reproducible); a rank skipping the all-reduce, or summing
    # the gradients, moved the loss 3% on a CPU and the updates over 100%
    assert len(a) == len(b) == STEPS and b == pytest.approx(a, rel=1.5e-2), (a, b)
    ua, ub = training_runs.updates("one"), training_runs.updates("two")
    assert float((ub - ua).norm() / ua.norm()) < 0.1


def test_fp16_under_ddp_trains_as_fp32_does_within_fp16s_rounding(training_runs):
    """The two processes in fp16 (masters in fp32, a dynamic loss scale low enough that no step
    overflows) against the one fp32 process: the first step's loss (the forward alone), the
    classifier's bias (whose gradient goes through no BatchNorm, where fp16 rounding grows: the
    other weights' updates are tens of percents apart in fp16) and the loss's course."""
    two = training_runs.output("two-fp16.0")
    training_runs.output("two-fp16.1")
    _took_the_speed_defaults(two)
    assert "=> precision: fp16, loss scale 1024 (dynamic)" in two
    assert "=> default: --fp16's optimizer step in two Triton kernels: " in two
    assert "runs torch's kernels (not --optimizer-impl triton's)" not in two
    row = training_runs.row("two-fp16")
    assert (row["world_size"], row["steps"], row["skipped_steps"]) == (2, STEPS, 0), row
    a, b = training_runs.losses("one"), training_runs.losses("two-fp16.0")
    assert len(b) == STEPS and b[0] == pytest.approx(a[0], rel=5e-3) and b == pytest.approx(a, rel=0.05), (a, b)
    ua, ub = training_runs.updates("one", ["fc.bias"]), training_runs.updates("two-fp16", ["fc.bias"])
    assert float((ub - ua).norm() / ua.norm()) < 0.2


def test_mixed_precision_trains_with_the_kernels_under_compile_default(training_runs):
    out = training_runs.output("amp")
    assert "=> kernels: stem max-pool on Triton kernels; BatchNorm + add + ReLU fused in Triton" in out
    assert "=> compile: torch.compile default" in out
    row = training_runs.row("amp")
    assert row["steps"] == 3 and math.isfinite(row["train_loss"]) and row["val_samples"] == 32, row


def test_progressive_resizing_compiles_each_size_once_under_cuda_graphs(training_runs):
    """The speed defaults with --progressive-resize: CUDA graphs, a graph per training size and
    one for the flip-averaged validation (72 images, its last batch of 8 padded to 32), none in the
    epoch that repeats a size."""
    out = training_runs.output("sizes")
    assert "=> default: torch.compile with CUDA graphs (reduce-overhead)" in out
    assert "2 training sizes, 32, 64 px" in out and "first step at 64 px done" in out
    rows = [json.loads(line) for line in open(training_runs.root / "sizes" / "metrics.jsonl")]
    assert [r["image_size"] for r in rows] == [32, 32, 64], rows
    compiles = [r["compiles"] for r in rows]
    assert compiles[0] >= 2 and compiles[1] == 0 and compiles[2] >= 1, compiles
    assert all(math.isfinite(r["train_loss"]) and r["val_samples"] == 72 for r in rows), rows
    assert "a size already compiled" not in out
