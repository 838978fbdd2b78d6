#!/usr/bin/env python
"""The GPU verification matrix, one phase per device call, each ending in a short table.

    python scripts/perf/gpu_verify.py PHASE [options]

PHASES below names each phase, its function and one line on what it measures (--help lists
them); the functions live in scripts/perf/verify/, one module per subject. A new measurement is
a row there and a function ``phase(args)`` of the options parsed here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # there when run as a script, not when a test loads this file by its path
    sys.path.insert(0, HERE)

from verify import accuracy, checks, decode, family, pipeline, shards, speed  # noqa: E402
from verify.common import REPO  # noqa: E402

PHASES = {  # name: (function, what it measures)
    "smoke": (checks.phase_smoke, "GPU tests, every mode for a few steps, the demo's time"),
    "suite": (checks.phase_suite, "GPU tests, the whole suite with the GPU hidden, ResNet-50 per --compile"),
    "e2e": (pipeline.phase_e2e, "ResNet-50 fp16: synthetic step, loader alone, JPEG end to end, one table"),
    "precision": (accuracy.phase_precision, "Fashion-MNIST, 1 GPU: fp32 vs fp16 (static/dynamic) vs amp"),
    "multigpu": (accuracy.phase_multigpu, "the report's commands on 2 GPUs: DataParallel and DDP"),
    "bench": (speed.phase_bench, "resnet50 step throughput: precision x layout; 1 GPU, DP, DDP"),
    "recipe": (accuracy.phase_recipe, "fp16 recipe plain vs weight average + label smoothing, a plot"),
    "jpeg": (pipeline.phase_jpeg, "JPEG input pipelines: classic / CPU decode / GPU decode"),
    "scaling": (speed.phase_scaling, "1/2/4/8 GPUs (as many as visible): DDP vs DP, GPU decode, parity"),
    "largebatch": (accuracy.phase_largebatch, "Fashion-MNIST at 16x the recipe's batch: SGD at scaled lr vs LARS, "
                                              "against the recipe"),
    "shrink": (accuracy.phase_shrink, "Fashion-MNIST as 112 px JPEGs trained at 56 px: pixels and Acc@1 per pipeline"),
    "defaults": (speed.phase_defaults, "with --old DIR: the plain commands, an older tree and this one; "
                                       "cold/warm start"),
    "shards": (shards.phase_shards, "tar shards vs the folder they came from: img/s; --shards-parts accuracy: Acc@1"),
    "decode": (decode.phase_decode, "CPU vs GPU decode at 4/6/15 workers, eager and CUDA graphs, each GPU JPEG decoder"),
    "family": (family.phase_family, "the typed command per ResNet-family arch against eager --fp16 and fp32, "
                                    "with the banner's choices"),
}
OPTIONS = """\
Every run's folder (log, metrics, checkpoints) goes under --out; every command line is printed
with its result, so that the tables in docs/BENCHMARKS.md can cite it."""


def description() -> str:
    lines = [f"    python scripts/perf/gpu_verify.py {name:<10} # {what}" for name, (_, what) in PHASES.items()]
    return "\n".join([__doc__.splitlines()[0], "", *lines, "", OPTIONS])


def parser() -> argparse.ArgumentParser:
    """Every phase's options (a phase's own are named after it: --decode-*, --shards-*, ...)."""
    p = argparse.ArgumentParser(description=description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=tuple(PHASES))
    g = p.add_argument_group("runs and data")
    g.add_argument("--out", default="/tmp/gpu_verify",
                   help="where each run's folder goes (its log, metrics and checkpoints: large)")
    g.add_argument("--data", default="/tmp/fashion-mnist",
                   help="the Fashion-MNIST image folder of the accuracy runs (made from --idx-dir if missing)")
    g.add_argument("--idx-dir", default=os.path.join(REPO, ".data", "fashion-mnist"),
                   help="Fashion-MNIST's IDX files, to make --data from")
    g.add_argument("--epochs", type=int, default=8, help="epochs of the Fashion-MNIST recipe's runs")
    g.add_argument("--workers", type=int, default=6, help="loader workers (-j) of the runs that take them")
    g.add_argument("--max-runs", type=int, default=0,
                   help="runs a phase starts at once, the next as one ends (0: all at once; on an 80 GB card 21 "
                        "Fashion-MNIST runs at once could not all create their CUDA context)")
    g.add_argument("--deadline", type=float, default=0,
                   help="seconds after the start by which every run is ended, cut where it is (its table row says "
                        "so and how far it got, and no mean counts it), and no run starts (0: none); set it under "
                        "the call's own limit so the tables still print")
    g.add_argument("--jpeg-per-class", type=int, default=300,
                   help="jpeg, scaling: training JPEGs per class (100 classes) in the benchmark folder they make")
    g = p.add_argument_group("test suites (smoke, suite)")
    g.add_argument("--compile-modes", default="off,default,reduce-overhead,max-autotune",
                   help="suite: --compile modes of the ResNet-50 run")
    g.add_argument("--budget", type=float, default=540, help="suite, defaults: seconds for the whole phase")
    g = p.add_argument_group("accuracy (precision, multigpu, recipe, shrink)")
    g.add_argument("--recipe-config", default="configs/fashion-mnist.yaml",
                   help="recipe, precision, multigpu: the YAML recipe (configs/fashion-mnist-stem.yaml: a max-pool stem)")
    g.add_argument("--lr", default=".01",
                   help="precision/multigpu/recipe: the learning rate (.01: the report's command line; "
                        "configs/fashion-mnist.yaml's own is 0.05 with 12 epochs)")
    g.add_argument("--recipe-arch", default="resnet18",
                   help="recipe, precision, multigpu: the architecture (-a) of the recipe's runs")
    g.add_argument("--ref-acc", type=float, help="run 1's Acc@1 from the precision phase, for the multigpu table")
    g.add_argument("--only", help="multigpu: run numbers to run, e.g. 5,6a,6b")
    g.add_argument("--concurrent", action="store_true", help="multigpu: start the runs together (accuracy only)")
    g.add_argument("--variants", default="plain,ema-ls",
                   help="recipe: comma list of plain,ema-ls,ema,ls (weight average, label smoothing), "
                        "maxpool-torch,maxpool-triton (--maxpool-kernel; with --recipe-config configs/fashion-mnist-stem.yaml), "
                        "kernels, kernels-ro (both kernels, eager or --compile reduce-overhead; against maxpool-torch), "
                        "default (the command as typed: the speed defaults), ramp, ramp-eager, ramp-triangular, "
                        "ramp-eager-triangular, ramp-step28 (progressive resizing 32 -> 56 px with "
                        "configs/fashion-mnist-stem.yaml: compiled, eager, FFCV's triangular schedule compiled and "
                        "eager, in two sizes instead of four); the first is the table's reference")
    g.add_argument("--seeds", default="0",
                   help="recipe, shrink, largebatch: seeds to run each variant with, e.g. 0,1,2")
    g.add_argument("--largebatch-variants", default="sgd-b128,sgd-b2048-linear,sgd-b2048-sqrt,lars-b2048-lr10-poly",
                   help="largebatch: OPTIMIZER-bBATCH[-linear|-sqrt|-lrX][-poly][-wdX][-wN] each (--lr is the rate at "
                        "batch 128; linear and sqrt scale it; poly: MLPerf's decay; wdX: weight decay X, a plain "
                        "decimal; wN: N warm-up epochs)")
    g.add_argument("--shrink-store", type=int, default=112, help="shrink: px the JPEGs are stored at")
    g.add_argument("--shrink-size", type=int, default=56, help="shrink: px they are trained and validated at")
    g.add_argument("--shrink-pipelines", default="classic,cpu,gpu", help=f"shrink: of {','.join(accuracy.SHRINK_PIPELINES)}")
    g.add_argument("--shrink-epochs", type=int, default=6, help="shrink: epochs of each run (the recipe's own: 12)")
    g.add_argument("--shrink-concurrent", type=int, default=3, help="shrink: runs at once on the one GPU")
    g.add_argument("--shrink-timeout", type=int, default=400, help="shrink: seconds a run may take")
    g = p.add_argument_group("step throughput (bench, scaling, defaults)")
    g.add_argument("--bench-steps", type=int, default=20)
    g.add_argument("--bench-best", default="fp16", help="precision for the DP/DDP scaling rows")
    g.add_argument("--groups", default="matrix,ab,dp,ddp,small",
                   help=f"bench: comma list of {','.join(speed.BENCH_GROUPS)}")
    g.add_argument("--compile-rows", default="",
                   help="bench: PRECISION[:MODE] rows to time compiled, e.g. fp16,fp16:max-autotune,amp-bf16")
    g.add_argument("--old", help="defaults, decode: the tree of the commit to compare against (git archive COMMIT)")
    g.add_argument("--defaults-rows", default=",".join(speed.DEFAULTS_ROWS), help="defaults: rows to time, in order")
    g.add_argument("--defaults-epochs", type=int, default=4, help="defaults: epochs of each timed row")
    g.add_argument("--defaults-steps", type=int, default=30, help="defaults: steps of each epoch")
    g.add_argument("--skip-cold", action="store_true", help="defaults: leave out the cold and warm start runs")
    g.add_argument("--defaults-stage", choices=("all", "compile", "time"), default="all",
                   help="defaults: compile (empty the caches, compile every row) or time (with the caches as "
                        "they are) alone, so that other work can share the GPU while compiling")
    g = p.add_argument_group("input pipelines (jpeg, e2e)")
    g.add_argument("--data-windows", type=int, default=5, help="jpeg: timed windows per input pipeline")
    g.add_argument("--skip-e2e", action="store_true", help="jpeg: the loader benchmark only")
    g.add_argument("--skip-data", action="store_true", help="jpeg: the end-to-end runs only")
    g.add_argument("--data-pipelines", default="classic,fast,gpu", help="jpeg: the loader bench's pipelines")
    g.add_argument("--data-args", default="",
                   help="jpeg: more bench.py data options, e.g. '--train fp16 --profile 4' (a step per batch)")
    g.add_argument("--e2e-rows", default="cpu:amp,gpu:amp",
                   help="jpeg: end-to-end runs, DECODE:PRECISION[:COMPILE] each, e.g. gpu:fp16:reduce-overhead")
    g.add_argument("--parts", default="synthetic,dummy,loader,jpeg",
                   help="e2e: comma list of synthetic (bench.py train), dummy (main.py --dummy), loader, jpeg")
    g.add_argument("--e2e-modes", default="eager,cuda-graphs",
                   help="e2e: the step modes of the synthetic and JPEG rows, eager,cuda-graphs (one a call keeps a call short)")
    g.add_argument("--e2e-epochs", type=int, default=4, help="e2e, shards: epochs of each JPEG run (the first is left out)")
    g.add_argument("--e2e-timeout", type=int, default=240, help="e2e, shards, defaults: seconds one row may take")
    g.add_argument("--e2e-cpu-variants", default="",
                   help="e2e: '|'-separated extra main.py flags, one set of CPU-decode rows each, e.g. "
                        "'--worker-nice 0|--worker-nice 10'")
    g.add_argument("--e2e-repeat", type=int, default=1, help="e2e: run the JPEG rows this many times, alternating")
    g.add_argument("--e2e-skip", default="", help="e2e: JPEG rows to leave out, by part of their name, e.g. cuda-graphs,classic")
    g = p.add_argument_group("tar shards (shards)")
    g.add_argument("--shards-parts", default="speed",
                   help="shards: comma list of speed (benchmark folder vs its shards, img/s), accuracy "
                        "(Fashion-MNIST folder vs its shards, Acc@1 over --shards-seeds)")
    g.add_argument("--shards-modes", default="eager", help="shards: step modes of the speed rows, eager,cuda-graphs")
    g.add_argument("--shards-decode", default="cpu,gpu", help="shards: decoders of the speed rows, cpu,gpu")
    g.add_argument("--shards-workers", type=int, default=15, help="shards: loader workers of the speed rows")
    g.add_argument("--shards-size", default="64MB",
                   help="shards: --shard-size of the benchmark folder's shards (64MB: about 50 shards)")
    g.add_argument("--shards-window", type=int, default=0,
                   help="shards: --shuffle-window of the shard runs (0: main.py's default scaled from ImageNet to the set)")
    g.add_argument("--shards-seeds", default="0,1,2", help="shards: seeds of the accuracy comparison")
    g = p.add_argument_group("GPU decode (decode)")
    g.add_argument("--decode-workers", default="4,6,15", help="decode: the -j of each row")
    g.add_argument("--decode-modes", default="eager,cuda-graphs",
                   help="decode: step modes, of " + ", ".join(f"{k} (main.py{v or ' as typed'})" for k, v in
                                                               decode.DECODE_MODES.items()))
    g.add_argument("--decode-batch", type=int, default=384, help="decode: -b of every row")
    g.add_argument("--decode-jpeg", default="",
                   help="decode: the GPU JPEG decoders (IMAGENET_GPU_JPEG), a --decode gpu row each, e.g. torchvision "
                        "(default: every one the trainer has, torchvision,torchcodec)")
    g.add_argument("--decode-epochs", type=int, default=4, help="decode: epochs of every row (the first is left out)")
    g.add_argument("--decode-per-class", type=int, default=64,
                   help="decode: training JPEGs a class (100 classes) of the benchmark folder each epoch reads")
    g.add_argument("--decode-budget", type=float, default=480,
                   help="decode: seconds for all rows; a row that would start later is not run")
    g.add_argument("--decode-timeout", type=float, default=150, help="decode: seconds one row may take")
    g.add_argument("--decode-tests", default="",
                   help="decode: test paths to run first in the same call, e.g. 'tests/test_gpudecode.py "
                        "tests/test_gpugeometry.py tests/test_input_account.py'")
    g = p.add_argument_group("the ResNet family (family)")
    g.add_argument("--family-archs", default=",".join(family.ARCHS), help="family: the architectures, in order")
    g.add_argument("--family-rows", default=",".join(family.ROWS),
                   help="family: of " + ", ".join(f"{k} (-b 256 {v or 'fp32'})" for k, v in family.ROWS.items()))
    g.add_argument("--family-epochs", type=int, default=2, help="family: epochs of each timed row (the first is left out)")
    g.add_argument("--family-steps", type=int, default=25, help="family: steps of each epoch")
    g.add_argument("--family-gib", type=float, default=100,
                   help="family: estimated GPU GiB the compilations run side by side may take together (an H100: 60)")
    g.add_argument("--family-budget", type=float, default=560,
                   help="family: seconds for the phase; the precompiles stop at half, rows not started by the end "
                        "are reported as not run")
    g.add_argument("--family-warm", action="store_true", help="family: keep the compile caches of an earlier call")
    return p


def main() -> int:
    args = parser().parse_args()
    args.out = os.path.abspath(args.out)  # rows of an --old tree run from there
    args.ends = time.time() + args.deadline if args.deadline > 0 else None  # run_group's deadline
    os.makedirs(args.out, exist_ok=True)
    PHASES[args.phase][0](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
