"""The test suites on the GPU machine, and every training mode for a few steps.

smoke: the tests that hold GPU cases, then each precision and parallel mode for 30 steps, one
recipe epoch on one GPU (to size the parity runs) and the README's demo. suite: the GPU tests
on the GPU beside the whole suite with the GPU hidden, then the README's ResNet-50 command
under every --compile mode, all within --budget seconds."""

from __future__ import annotations

import importlib.util
import os
import time

from .common import G0, G1, PY, TWO, command_line, recipe_cmd, run_group, run_rows, sh, table, tail
from .data import ensure_fashion

# (group, name, command, environment): the rows of a group run at once, the groups in turn.
# {quick}: 30 steps of one Fashion-MNIST epoch; {epoch}: one epoch of the accuracy recipe.
SMOKE_ROWS = (
    (1, "s-gpu-fp32", "{py} {quick}", G0),
    (1, "s-gpu-fp16", "{py} {quick} --fp16 --channels-last", G1),
    (2, "s-gpu-amp-bf16", "{py} {quick} --amp --amp-dtype bfloat16", G0),
    (2, "s-gpu-amp", "{py} {quick} --amp", G1),
    (3, "s-dp-fp16", "{py} {quick} --fp16 --loss-scale 256", TWO),
    (4, "s-ddp-fp16", "{py} -m multiproc --log-dir OUT {quick} --fp16", TWO),
    (5, "s-epoch-fp32", "{py} {epoch}", G0),
    (6, "demo", "{py} main.py --config configs/demo.yaml --output-dir OUT",  # the README promises < 30 s on a GPU
     dict(G0, IMAGENET_TRAINER_CACHE="/tmp/itcache")),
)
# test_gpu.py is GPU-only; the others hold GPU cases among CPU ones (the background and
# prefetching loaders on a device, nvJPEG's decode path)
SMOKE_TESTS = "tests/test_gpu.py tests/test_precision.py tests/test_pipeline.py tests/test_gpudecode.py"
SUITE_GPU_TESTS = "-m gpu tests"  # every GPU test, as scripts/test_gpu.sh runs them


def phase_smoke(args) -> None:
    data = ensure_fashion(args)
    print(f"$ pytest {SMOKE_TESTS}", flush=True)
    log = os.path.join(args.out, "pytest.log")
    rc = sh(f"{PY} -m pytest -q -p no:cacheprovider --tb=short {SMOKE_TESTS}", log).returncode
    print(tail(log, 60 if rc else 3), flush=True)
    fill = {"py": PY,
            "quick": (f"main.py {data} --config configs/fashion-mnist.yaml -b 128 --epochs 1 --warmup-epochs 0 "
                      "--prof 30 -j 4 --output-dir OUT"),
            "epoch": recipe_cmd(args, data).replace(f"--epochs {args.epochs}", "--epochs 1 --warmup-epochs 0")}
    table(run_rows(SMOKE_ROWS, fill, args), None)
    print(f"\npytest exit {rc}")


def phase_suite(args) -> None:
    """The GPU tests on the GPU, the whole suite with the GPU hidden (the CPU suite on a machine
    without the demo's mlxtend wheel), and the README's ResNet-50 command under every --compile
    mode, all with nothing installed beyond the machine's own packages."""
    t0 = time.time()
    xdist = importlib.util.find_spec("xdist") is not None
    per_test = " --timeout 240" if importlib.util.find_spec("pytest_timeout") else ""
    jobs = max(2, (os.cpu_count() or 4) // 4)
    # Each step is bounded, so a hang costs its share of --budget, not the device call: an
    # unbounded suite (8 workers of 16 threads each beside the GPU tests) can outlast the call.
    limit = int(args.budget * 0.6)
    steps = [
        ("gpu tests", f"timeout {limit} {PY} -m pytest -q -p no:cacheprovider --tb=short{per_test} {SUITE_GPU_TESTS}", {}),
        ("cpu suite, no GPU, no mlxtend",
         f"timeout {limit} {PY} -m pytest -q -p no:cacheprovider --tb=short{per_test} "
         f"{'-n ' + str(jobs) if xdist else ''} tests",
         {"CUDA_VISIBLE_DEVICES": "", "IMAGENET_TRAINER_CACHE": "/tmp/itcache-suite", "OMP_NUM_THREADS": "2"}),
    ]
    procs = [(name, cmd, env, time.time(), sh(cmd, os.path.join(args.out, f"{i}.log"), env, wait=False))
             for i, (name, cmd, env) in enumerate(steps)]  # the suite keeps off the GPU: side by side
    rows = []
    for i, (name, cmd, env, start, proc) in enumerate(procs):
        rc = proc.wait()
        last = tail(os.path.join(args.out, f"{i}.log"), 1).strip()
        rows.append((name, command_line(cmd, env), rc, last, time.time() - start))
        print(tail(os.path.join(args.out, f"{i}.log"), 40 if rc else 2), flush=True)
    r50 = (f"main.py --dummy -a resnet50 -b 256 --fp16 --channels-last --epochs 1 --prof {args.bench_steps} -j 8 "
           "--dummy-train-size 25600 --dummy-val-size 2560 --output-dir OUT")
    runs = [{"name": f"r50-compile-{mode}", "cmd": f"{PY} {r50} --compile {mode}", "env": G0}
            for mode in args.compile_modes.split(",") if mode]
    for r in runs:  # one at a time: compile workers and timings of their own
        left = args.budget - (time.time() - t0)
        if left < 60:
            rows.append((r["name"], command_line(r["cmd"], r["env"]), "not run", "time budget spent", 0.0))
            continue
        r = dict(r, cmd=f"timeout {int(left)} {r['cmd']}")
        res = run_group([r], args)[0]
        log = os.path.join(args.out, r["name"], "log.txt")
        done = [line for line in open(log) if line.startswith("=> done")] if os.path.exists(log) else []
        rows.append((r["name"], command_line(res["cmd"], r["env"]), res["rc"],
                     done[-1].strip() if done else tail(log, 1).strip(), res["seconds"]))
    print("\n| step | exit | result | s |\n| --- | ---: | --- | ---: |")
    for name, _cmd, rc, last, secs in rows:
        print(f"| {name} | {rc} | {last[:150]} | {secs:.0f} |")
    print("\ncommands:")
    for name, cmd, *_ in rows:
        print(f"- {name}: `{cmd}`")
