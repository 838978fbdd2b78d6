#!/usr/bin/env python
"""The GPU verification matrix, one phase per device call, each ending in a short table.

    python scripts/perf/gpu_verify.py smoke      # GPU tests, every mode for a few steps, the demo's time
    python scripts/perf/gpu_verify.py suite      # GPU tests, the whole suite with the GPU hidden, ResNet-50 per --compile
    python scripts/perf/gpu_verify.py e2e        # ResNet-50 fp16: synthetic step, loader alone, JPEG end to end, one table
    python scripts/perf/gpu_verify.py precision  # Fashion-MNIST, 1 GPU: fp32 vs fp16 (static/dynamic) vs amp
    python scripts/perf/gpu_verify.py multigpu   # the report's commands on 2 GPUs: DataParallel and DDP
    python scripts/perf/gpu_verify.py bench      # resnet50 step throughput: precision x layout; 1 GPU, DP, DDP
    python scripts/perf/gpu_verify.py recipe     # fp16 recipe plain vs weight average + label smoothing, a plot
    python scripts/perf/gpu_verify.py jpeg       # JPEG input pipelines: classic / CPU decode / GPU decode
    python scripts/perf/gpu_verify.py scaling    # 1/2/4/8 GPUs (as many as visible): DDP vs DP, GPU decode, parity
    python scripts/perf/gpu_verify.py shrink     # Fashion-MNIST as 112 px JPEGs trained at 56 px: pixels and Acc@1 per pipeline
    python scripts/perf/gpu_verify.py defaults --old DIR  # issue 27: the plain commands, old tree and this one; cold/warm start
    python scripts/perf/gpu_verify.py shards     # tar shards vs the folder they came from: img/s; --shards-parts accuracy: Acc@1
    python scripts/perf/gpu_verify.py decode     # CPU vs GPU decode at 4/6/15 workers, eager and CUDA graphs, each GPU JPEG decoder

Options: --data DIR (a Fashion-MNIST ImageFolder; made from --idx-dir if missing), --epochs,
--out DIR (logs and metrics of every run). Every command line is printed with its result, so
the tables in docs/BENCHMARKS.md can cite them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
BENCH_GROUPS = ("matrix", "ab", "foreach", "profile", "dp", "dp-profile", "ddp", "ddp-nccl", "weak", "small",
                "compile")


def sh(cmd: str, log: str, env_extra: dict | None = None, wait: bool = True):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", **(env_extra or {}))
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, shell=True, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if wait:
        proc.wait()
    return proc


def last_metrics(out_dir: str) -> list:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path)]


def tail(path: str, n: int = 6) -> str:
    try:
        return "".join(open(path).readlines()[-n:])
    except OSError:
        return ""


JPEG_DIR = "/tmp/bench_jpeg"


def ensure_jpeg(args) -> str:
    """The ImageNet-shaped JPEG folder (100 classes, --jpeg-per-class training images each)."""
    if os.path.isdir(os.path.join(JPEG_DIR, "train")):
        return JPEG_DIR
    cmd = (f"{PY} scripts/perf/make_benchmark_imagefolder.py {JPEG_DIR} --classes 100 --train-per-class "
           f"{args.jpeg_per_class} --val-per-class 4 --jobs {os.cpu_count()}")
    print("$", cmd, flush=True)
    if sh(cmd, os.path.join(args.out, "make_jpeg.log")).returncode:
        fail("making the JPEG folder failed:\n" + tail(os.path.join(args.out, "make_jpeg.log"), 20))
    return JPEG_DIR


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def ensure_fashion(args) -> str:
    if os.path.isdir(os.path.join(args.data, "train")):
        return args.data
    cmd = f"{PY} scripts/prepare_dataset.py fashion-mnist --src {args.idx_dir} --out {args.data}"
    print("$", cmd, flush=True)
    t0 = time.time()
    if sh(cmd, os.path.join(args.out, "prepare.log")).returncode:
        fail("preparing Fashion-MNIST failed:\n" + tail(os.path.join(args.out, "prepare.log"), 20))
    print(f"  prepared in {time.time() - t0:.0f} s", flush=True)
    return args.data


def command_line(cmd: str, env: dict) -> str:
    """The command as it ran: its environment settings, then the command."""
    return " ".join([*(f"{k}={v}" for k, v in env.items()), cmd])


def print_commands(results: list) -> None:
    print("\ncommands:")
    for r in results:
        print(f"- {r['name']}: `{command_line(r['cmd'], r['env'])}`")


def run_group(runs: list, args) -> list:
    """Start runs concurrently (each a dict: name, cmd, env), wait, collect results. Each run's
    folder starts empty: its results (metrics.jsonl, rows.json) are this run's, never an earlier
    call's in the same --out."""
    procs = []
    for r in runs:
        out = os.path.join(args.out, r["name"])
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        cmd = r["cmd"].replace("OUT", out)
        print(f"$ {command_line(cmd, r.get('env', {}))}", flush=True)
        procs.append((r, out, cmd, time.time(), sh(cmd, os.path.join(out, "log.txt"), r.get("env"), wait=False)))
    results = []
    for r, out, cmd, t0, proc in procs:
        rc = proc.wait()
        rows = last_metrics(out)
        res = {"name": r["name"], "cmd": cmd, "env": r.get("env", {}), "rc": rc, "seconds": time.time() - t0,
               "acc1": rows[-1]["val_acc1"] if rows else None, "best": max((x["val_acc1"] for x in rows), default=None),
               "val_samples": rows[-1]["val_samples"] if rows else None,
               "img_per_s": statistics.median(x["img_per_s"] for x in rows) if rows else None,
               "skipped_steps": rows[-1].get("skipped_steps_total") if rows else None,
               "loss_scale": rows[-1].get("loss_scale") if rows else None, "epochs": len(rows)}
        if rc:
            print(f"  !! {r['name']} exited {rc}:\n{tail(os.path.join(out, 'log.txt'), 15)}", flush=True)
        elif res["acc1"] is not None:
            print(f"  {r['name']}: Acc@1 {res['acc1']:.2f} in {res['seconds']:.0f} s", flush=True)
        else:
            print(f"  {r['name']}: done in {res['seconds']:.0f} s", flush=True)
        results.append(res)
    return results


def table(results: list, ref: str | None) -> None:
    base = next((r["acc1"] for r in results if r["name"] == ref and r["acc1"] is not None), None)
    print("\n| run | final Acc@1 | best | vs run 1 | val images | train img/s (median epoch) | skipped steps | final loss scale | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if r["acc1"] is None:
            print(f"| {r['name']} | FAILED (exit {r['rc']}) | | | | | | | {r['seconds']:.0f} |")
            continue
        diff = f"{r['acc1'] - base:+.2f}" if base is not None else "-"
        print(f"| {r['name']} | {r['acc1']:.2f} | {r['best']:.2f} | {diff} | {r['val_samples']} | "
              f"{r['img_per_s']:.0f} | {r['skipped_steps']} | {r['loss_scale']} | {r['seconds']:.0f} |")
    print_commands(results)


def recipe(args, data: str) -> str:
    return (f"main.py {data} --config {args.recipe_config} -a resnet18 -b 128 --lr={args.lr} "
            f"--epochs {args.epochs} -j {args.workers} --output-dir OUT")


def phase_smoke(args) -> None:
    data = ensure_fashion(args)
    # test_gpu.py is GPU-only; the others hold GPU cases among CPU ones (the background and
    # prefetching loaders on a device, nvJPEG's decode path)
    tests = "tests/test_gpu.py tests/test_precision.py tests/test_pipeline.py tests/test_gpudecode.py"
    print(f"$ pytest {tests}", flush=True)
    log = os.path.join(args.out, "pytest.log")
    rc = sh(f"{PY} -m pytest -q -p no:cacheprovider --tb=short {tests}", log).returncode
    print(tail(log, 60 if rc else 3), flush=True)
    quick = (f"main.py {data} --config configs/fashion-mnist.yaml -b 128 --epochs 1 --warmup-epochs 0 --prof 30 -j 4 "
             "--output-dir OUT")
    runs = [
        {"name": "s-gpu-fp32", "cmd": f"{PY} {quick}", "env": {"CUDA_VISIBLE_DEVICES": "0"}},
        {"name": "s-gpu-fp16", "cmd": f"{PY} {quick} --fp16 --channels-last", "env": {"CUDA_VISIBLE_DEVICES": "1"}},
    ]
    results = run_group(runs, args)
    runs = [
        {"name": "s-gpu-amp-bf16", "cmd": f"{PY} {quick} --amp --amp-dtype bfloat16", "env": {"CUDA_VISIBLE_DEVICES": "0"}},
        {"name": "s-gpu-amp", "cmd": f"{PY} {quick} --amp", "env": {"CUDA_VISIBLE_DEVICES": "1"}},
    ]
    results += run_group(runs, args)
    results += run_group([{"name": "s-dp-fp16", "cmd": f"{PY} {quick} --fp16 --loss-scale 256",
                           "env": {"CUDA_VISIBLE_DEVICES": "0,1"}}], args)
    results += run_group([{"name": "s-ddp-fp16", "cmd": f"{PY} -m multiproc --log-dir OUT {quick} --fp16",
                           "env": {"CUDA_VISIBLE_DEVICES": "0,1"}}], args)
    # One full epoch on one GPU, to size the parity runs.
    results += run_group([{"name": "s-epoch-fp32", "cmd": f"{PY} {recipe(args, data).replace(f'--epochs {args.epochs}', '--epochs 1 --warmup-epochs 0')}",
                           "env": {"CUDA_VISIBLE_DEVICES": "0"}}], args)
    # The README's demo on one GPU (issue: under 30 s on a GPU).
    results += run_group([{"name": "demo", "cmd": f"{PY} main.py --config configs/demo.yaml --output-dir OUT",
                           "env": {"CUDA_VISIBLE_DEVICES": "0", "IMAGENET_TRAINER_CACHE": "/tmp/itcache"}}], args)
    table(results, None)
    print(f"\npytest exit {rc}")


def phase_suite(args) -> None:
    """Issue 13's record: the GPU tests on the GPU, the whole suite with the GPU hidden (the CPU
    suite on a machine without the demo's mlxtend wheel), and the README's ResNet-50 command
    under every --compile mode, all with nothing installed beyond the machine's own packages."""
    import importlib.util
    t0 = time.time()
    gpu_tests = "-m gpu tests"  # every GPU test, as scripts/test_gpu.sh runs them
    xdist = importlib.util.find_spec("xdist") is not None
    per_test = " --timeout 240" if importlib.util.find_spec("pytest_timeout") else ""
    jobs = max(2, (os.cpu_count() or 4) // 4)
    # Each step is bounded, so a hang costs its share of --budget, not the device call: a first
    # unbounded call (8 workers of 16 threads each beside the GPU tests) returned nothing in 600 s.
    limit = int(args.budget * 0.6)
    steps = [
        ("gpu tests", f"timeout {limit} {PY} -m pytest -q -p no:cacheprovider --tb=short{per_test} {gpu_tests}", {}),
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
    runs = [{"name": f"r50-compile-{mode}", "cmd": f"{PY} {r50} --compile {mode}", "env": {"CUDA_VISIBLE_DEVICES": "0"}}
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


def phase_precision(args) -> None:
    data = ensure_fashion(args)
    base = f"{PY} {recipe(args, data)}"
    g0, g1 = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}
    results = run_group([{"name": "1-fp32", "cmd": base, "env": g0},
                         {"name": "2-fp16-static256", "cmd": f"{base} --fp16 --loss-scale=256", "env": g1}], args)
    results += run_group([{"name": "fp16-dynamic", "cmd": f"{base} --fp16", "env": g0},
                          {"name": "amp-fp16", "cmd": f"{base} --amp", "env": g1}], args)
    results += run_group([{"name": "amp-bf16", "cmd": f"{base} --amp --amp-dtype bfloat16", "env": g0}], args)
    table(results, "1-fp32")


def phase_multigpu(args) -> None:
    data = ensure_fashion(args)
    base = f"{PY} {recipe(args, data)}"
    two = {"CUDA_VISIBLE_DEVICES": "0,1"}
    runs = [("3-dp-fp32", base), ("4-dp-fp16-static256", f"{base} --fp16 --loss-scale=256"),
            ("5-ddp-fp16-static256", f"{PY} -m multiproc --log-dir OUT {recipe(args, data)} --fp16 --loss-scale=256 --dist-backend nccl"),
            ("6a-ddp-fp16-dynamic", f"{PY} -m multiproc --log-dir OUT {recipe(args, data)} --fp16 --dist-backend nccl"),
            ("6b-ddp-amp", f"{PY} -m multiproc --log-dir OUT {recipe(args, data)} --amp --dist-backend nccl")]
    if args.only:
        runs = [r for r in runs if r[0].split("-")[0] in args.only.split(",")]
    results = []
    if args.concurrent:  # accuracy only: runs share the GPUs, so their img/s figures mean little
        results = run_group([{"name": name, "cmd": cmd, "env": two} for name, cmd in runs], args)
    for name, cmd in ([] if args.concurrent else runs):
        results += run_group([{"name": name, "cmd": cmd, "env": two}], args)
    ref = args.ref_acc
    if ref is not None:
        results.insert(0, {"name": "1-fp32", "acc1": ref, "best": ref, "val_samples": 10000, "img_per_s": 0,
                           "skipped_steps": 0, "loss_scale": None, "seconds": 0, "rc": 0, "cmd": "(precision phase)",
                           "env": {}})
    table(results, "1-fp32")


def phase_bench(args) -> None:
    """ResNet-50 step throughput, in groups (--groups): the 1-GPU precision x layout matrix; amp
    against --fp16 interleaved (ab), with foreach SGD (foreach), under the profiler (profile);
    DataParallel, ours against torch's (dp); DDP strong and weak scaling (ddp); the report's small
    resnet18 step on 1 GPU and DataParallel (small); --compile rows. Ends with one table."""
    groups = args.groups.split(",")
    unknown = set(groups) - set(BENCH_GROUPS)
    if unknown:
        fail(f"unknown bench group(s) {sorted(unknown)}; choose from {','.join(BENCH_GROUPS)}")
    common = f"scripts/perf/bench.py train --arch resnet50 --batch-size 256 --steps {args.bench_steps} --windows 5"
    common512 = common.replace("--batch-size 256", "--batch-size 512")  # 256 per GPU on two
    short = "scripts/perf/bench.py train --arch resnet50 --batch-size 256 --warmup 3 --steps 5 --windows 2"
    small = "scripts/perf/bench.py train --arch resnet18 --image-size 28 --batch-size 128 --precision fp32"
    best = f"--precision {args.bench_best} --channels-last"
    g0, two = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0,1"}
    nccl = dict(two, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P")
    # amp and fp16 twice, interleaved: a later row on a warmer GPU is not the slower mode
    ab = "--matrix --precisions amp,fp16,amp-bf16,fp16,amp --layouts channels_last"
    plan = {
        "matrix": [("1gpu-matrix", f"{PY} {common} --matrix", g0)],
        "ab": [("1gpu-ab-fused", f"{PY} {common} {ab} --optimizer-impl fused", g0)],
        "foreach": [("1gpu-ab-foreach", f"{PY} {common} {ab} --optimizer-impl foreach", g0)],
        "profile": [(f"profile-{p}", f"{PY} {common.replace('--windows 5', '--windows 1')} --precision {p} "
                                     f"--channels-last --profile 5 --profile-json OUT/ops.json", g0) for p in ("amp", "fp16")],
        "dp": [("dp2", f"timeout 150 {PY} {common} {best}", two),
               # torch's own DataParallel searched cuDNN algorithms every step (~1.7 s): few steps
               ("dp2-torch", f"timeout 90 {PY} {short} {best} --dp-impl torch", two)],
        "dp-profile": [("dp2-b512", f"timeout 150 {PY} {common512} {best}",
                        two),
                       ("profile-dp2", f"timeout 150 {PY} {common.replace('--windows 5', '--windows 1')} {best} "
                                       f"--profile 5", two)],
        "ddp": [("1gpu-b256", f"{PY} {common} {best}", g0),
                # each rank's share of a global 256 on one GPU: the ideal per-rank rate, strong scaling
                ("1gpu-b128", f"{PY} {common.replace('--batch-size 256', '--batch-size 128')} {best}", g0),
                ("ddp2-b256", f"{PY} -m multiproc --log-dir OUT {common} {best}", nccl),
                # weak scaling: 256 per GPU, as MLPerf and the scaling goal count it
                ("ddp2-b512", f"{PY} -m multiproc --log-dir OUT {common512} "
                              f"{best}", two),
                ("ddp2-b512-view", f"{PY} -m multiproc --log-dir OUT "
                                   f"{common512} {best} "
                                   f"--ddp-bucket-view --ddp-bucket-mb 100", two)],
        # where DDP x2's last 4% goes: NCCL's kernels share the SMs with the backward pass, so
        # fewer channels (thread blocks) may cost less than they save; and a profile of rank 0
        "ddp-nccl": [("1gpu-b256", f"{PY} {common} {best}", g0),
                     ("ddp2-b512", f"{PY} -m multiproc --log-dir OUT {common512} {best}", two),
                     ("ddp2-b512-nch4", f"{PY} -m multiproc --log-dir OUT {common512} {best}",
                      dict(two, NCCL_MAX_NCHANNELS="4")),
                     ("ddp2-b512-nch8", f"{PY} -m multiproc --log-dir OUT {common512} {best}",
                      dict(two, NCCL_MAX_NCHANNELS="8")),
                     ("profile-ddp2", f"{PY} -m multiproc --log-dir OUT "
                                      f"{common512.replace('--windows 5', '--windows 1')} {best} --profile 5", two)],
        # 256 images per GPU, side by side: one GPU, DDP x2 and DataParallel x2
        "weak": [("1gpu-b256", f"{PY} {common} {best}", g0),
                 ("ddp2-b512", f"{PY} -m multiproc --log-dir OUT {common512} "
                               f"{best}", two),
                 ("dp2-b512", f"timeout 150 {PY} {common512} {best}", two)],
        "small": [("small-1gpu", f"{PY} {small} --warmup 5 --steps 10 --windows 3", g0),
                  ("small-dp2", f"timeout 120 {PY} {small} --warmup 5 --steps 10 --windows 3", two),
                  ("small-dp2-torch", f"timeout 90 {PY} {small} --warmup 3 --steps 5 --windows 2 --dp-impl torch",
                   two)],
        # PRECISION or PRECISION:MODE (torch.compile mode, default "default")
        "compile": [(f"1gpu-compile-{row.replace(':', '-')}",
                     f"timeout 240 {PY} {common} --precision {row.split(':')[0]} --channels-last "
                     f"--compile {(row.split(':') + ['default'])[1]} --warmup 20", g0)
                    for row in (args.compile_rows.split(",") if args.compile_rows else [])],
    }
    summary = []
    for group in groups:
        for name, cmd, env in plan[group]:
            if "scripts/perf/bench.py" in cmd and "--profile" not in cmd:
                cmd += " --json OUT/rows.json"
            res = run_group([{"name": name, "cmd": cmd, "env": env}], args)[0]
            log = os.path.join(args.out, name, "log.txt")
            print(tail(log, 40 if name.startswith("profile") else 6), flush=True)
            path = os.path.join(args.out, name, "rows.json")
            if "--profile" in cmd and not res["rc"]:
                continue  # printed above; no throughput row
            for row in (json.load(open(path)) if os.path.exists(path) else [{}]):
                summary.append((name, row, res))
            if "NCCL_DEBUG" in env and os.path.exists(log):
                # which transport NCCL chose between the GPUs (P2P over NVLink, or SHM through the host)
                lines = {ln.split("NCCL INFO")[-1].strip() for ln in open(log) if " via " in ln}
                print("NCCL transport:", *sorted(lines)[:8], sep="\n  ", flush=True)
    if "profile" in groups:
        profile_diff(*(os.path.join(args.out, f"profile-{p}", "ops.json") for p in ("amp", "fp16")))
    print("\n| run | precision | layout | compile | optimizer | devices | global batch | img/s (median) | spread | peak GiB |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: |")
    for name, row, res in summary:
        if not row:
            failed = "timed out" if res["rc"] in (124, 137) else f"exit {res['rc']}"
            print(f"| {name} | | | | | | | {failed} | | |")
            continue
        print(f"| {name} | {row['precision']} | {'channels_last' if row['channels_last'] else 'contiguous'} | "
              f"{row['compile']} | {row['optimizer']} | {row['devices']} {row['mode']} | {row['batch']} | {row['img_per_s']:.0f} | "
              f"{row['min']:.0f}..{row['max']:.0f} | {row['peak_gib']:.1f} |")
    print_commands(list({res["name"]: res for _, _, res in summary}.values()))


def profile_diff(path_a: str, path_b: str, rows: int = 20) -> None:
    """The ops whose device time per step differs most between two --profile-json files."""
    if not (os.path.exists(path_a) and os.path.exists(path_b)):
        print("profile diff: missing", path_a if not os.path.exists(path_a) else path_b)
        return
    a, b = json.load(open(path_a)), json.load(open(path_b))
    per_step = lambda d: {o["name"]: (o["self_device_us"] / d["steps"], o["calls"] / d["steps"]) for o in d["ops"]}
    pa, pb = per_step(a), per_step(b)
    print(f"\nprofile, {a['precision']} vs {b['precision']}: the ops (and kernels) whose device time differs most")
    diffs = sorted(set(pa) | set(pb), key=lambda k: -abs(pb.get(k, (0, 0))[0] - pa.get(k, (0, 0))[0]))
    print(f"| op | {a['precision']} us/step | calls | {b['precision']} us/step | calls | difference us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k in diffs[:rows]:
        (ta, ca), (tb, cb) = pa.get(k, (0, 0)), pb.get(k, (0, 0))
        print(f"| {k[:70]} | {ta:.0f} | {ca:.0f} | {tb:.0f} | {cb:.0f} | {tb - ta:+.0f} |")


def phase_jpeg(args) -> None:
    """Input pipelines on ImageNet-shaped JPEGs: loader throughput (classic / fast CPU decode /
    GPU decode) and end-to-end ResNet-50 training epochs with CPU and with GPU decode."""
    data = JPEG_DIR  # made below, once the rows are known to be valid
    g0 = {"CUDA_VISIBLE_DEVICES": "0"}
    w = args.workers
    runs = [] if args.skip_data else [
        ("data-pipelines", f"{PY} scripts/perf/bench.py data {data} --workers {w} --batch-size 256 "
                           f"--windows {args.data_windows} --pipelines {args.data_pipelines} {args.data_args}".rstrip(), g0)]
    # Three epochs of (100 x --jpeg-per-class) images each; the table reports the median epoch's
    # rate. Rows are DECODE:PRECISION[:COMPILE], e.g. gpu:fp16:reduce-overhead.
    train = (f"main.py {data} -a resnet50 -b 256 --channels-last -j {w} --epochs 3 -p 20 "
             f"--output-dir OUT")
    if not args.skip_e2e:
        for row in args.e2e_rows.split(","):
            parts = row.split(":")
            if len(parts) not in (2, 3) or parts[0] not in ("cpu", "gpu") or parts[1] not in ("amp", "fp16"):
                fail(f"--e2e-rows: {row!r} is not DECODE:PRECISION[:COMPILE] with DECODE cpu|gpu and "
                     f"PRECISION amp|fp16, e.g. gpu:fp16:reduce-overhead")
            decode, precision, *compiled = parts
            cmd = f"{PY} {train} --{precision} --decode {decode}"
            if compiled:  # compiling takes a minute or two of the run
                cmd = f"timeout 300 {cmd} --compile {compiled[0]}"
            runs.append((f"e2e-{row.replace(':', '-')}", cmd, g0))
    ensure_jpeg(args)
    results = []
    for name, cmd, env in runs:
        results += run_group([{"name": name, "cmd": cmd, "env": env}], args)
        print(tail(os.path.join(args.out, name, "log.txt"), 8), flush=True)
    print("\n| run | train img/s per epoch | median | decoded on GPU | CPU fallbacks |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        if r["name"] == "data-pipelines":
            continue
        rows = last_metrics(os.path.join(args.out, r["name"]))
        rates = ", ".join(f"{x['img_per_s']:.0f}" for x in rows)
        gpu = sum(x.get("decoded_on_gpu", 0) for x in rows)
        cpu = sum(x.get("decode_fallbacks", 0) for x in rows)
        print(f"| {r['name']} | {rates or 'FAILED'} | {r['img_per_s'] or 0:.0f} | {gpu} | {cpu} |")
    print_commands(results)


def _epoch_rates(out_dir: str, skip: int) -> tuple:
    """(median img/s, min, max, median data_wait_frac) over the epochs after the first ``skip``."""
    rows = last_metrics(out_dir)[skip:]
    if not rows:
        return None
    rates = sorted(r["img_per_s"] for r in rows)
    waits = sorted(r.get("data_wait_frac", float("nan")) for r in rows)
    return statistics.median(rates), rates[0], rates[-1], statistics.median(waits)


def phase_e2e(args) -> None:
    """ResNet-50 --fp16 --channels-last, batch 256, one GPU, side by side in one call (--parts):
    the model step on synthetic data (bench.py train, and main.py --dummy), eager and CUDA
    graphs (--e2e-modes); the loader alone (plain torchvision, the fast CPU decode with the
    resize on the GPU and in the workers, GPU decode); and training end to end from the JPEG
    folder with GPU decode and CPU decode (eager, CUDA graphs) and the trainer's classic pipeline. Every rate is a median over windows (bench.py) or epochs after
    the first (main.py), with the spread; main.py's epochs leave out their first 10 steps."""
    parts = args.parts.split(",")
    g0 = {"CUDA_VISIBLE_DEVICES": "0"}
    w = args.workers
    model = "-a resnet50 -b 256 --fp16 --channels-last"
    bench = f"scripts/perf/bench.py train --arch resnet50 --batch-size 256 --precision fp16 --channels-last " \
            f"--steps {args.bench_steps} --windows 5 --json OUT/rows.json"
    dummy = (f"main.py --dummy {model} --epochs 3 --dummy-train-size {256 * 60} --dummy-val-size 2560 -p 100 "
             "--output-dir OUT")
    runs = []  # (name, kind, cmd)
    modes = args.e2e_modes.split(",")
    if set(modes) - {"eager", "cuda-graphs"}:
        fail(f"--e2e-modes: {args.e2e_modes!r}; choose from eager,cuda-graphs")
    for mode in ("off", "reduce-overhead"):
        label = "eager" if mode == "off" else "cuda-graphs"
        if label not in modes:
            continue
        if "synthetic" in parts:
            runs.append((f"synthetic-bench-{label}", "bench", f"timeout {args.e2e_timeout} {PY} {bench} --compile {mode}"))
        if "dummy" in parts:
            runs.append((f"synthetic-main-{label}", "main", f"timeout {args.e2e_timeout} {PY} {dummy} --compile {mode}"))
    if "loader" in parts:
        runs.append(("loader-alone", "loader", f"timeout {args.e2e_timeout} {PY} scripts/perf/bench.py data {JPEG_DIR} "
                                              f"--workers {w} --batch-size 256 --windows {args.data_windows} "
                                              "--pipelines classic,fast,fast-worker-resize,gpu"))
    if "jpeg" in parts:
        e2e = f"main.py {JPEG_DIR} {model} -j {w} --epochs {args.e2e_epochs} -p 50 --output-dir OUT"
        variants = [v.strip() for v in args.e2e_cpu_variants.split("|")] if args.e2e_cpu_variants else [""]
        jpeg_rows = [("jpeg-gpu-decode-eager", "--decode gpu"),
                     ("jpeg-gpu-decode-cuda-graphs", "--decode gpu --compile reduce-overhead")]
        for v in variants:  # the CPU-decode rows once per variant, e.g. --worker-nice 10
            tag = "".join(c if c.isalnum() else "-" for c in v).strip("-")
            tag = f"-{'-'.join(filter(None, tag.split('-')))}" if tag else ""
            jpeg_rows += [(f"jpeg-cpu-decode-eager{tag}", f"--decode cpu {v}"),
                          (f"jpeg-cpu-decode-cuda-graphs{tag}", f"--decode cpu --compile reduce-overhead {v}")]
        jpeg_rows.append(("jpeg-trainer-classic-eager", "--data-pipeline classic"))
        for rep in range(1, args.e2e_repeat + 1):  # repeats alternate the rows, so drift hits all alike
            for name, extra in jpeg_rows:
                if any(part and part in name for part in args.e2e_skip.split(",")) or \
                        ("cuda-graphs" if "cuda-graphs" in name else "eager") not in modes:
                    continue
                runs.append((name + (f"-r{rep}" if rep > 1 else ""), "main",
                             f"timeout {args.e2e_timeout} {PY} {e2e} {extra.strip()}"))
    if "loader" in parts or "jpeg" in parts:
        ensure_jpeg(args)
    rows, results = [], []
    engines = []  # nvidia-smi's hardware JPEG decoder utilisation while each GPU-decode row ran
    for name, kind, cmd in runs:
        with JpegEngines(kind == "loader" or "gpu-decode" in name) as watched:
            res = run_group([{"name": name, "cmd": cmd, "env": g0}], args)[0]
        if watched.use is not None:
            engines.append((name, watched.use))
        results.append(res)
        before = len(rows)
        out = os.path.join(args.out, name)
        print(tail(os.path.join(out, "log.txt"), 3), flush=True)
        if kind == "bench" and os.path.exists(os.path.join(out, "rows.json")):
            r = json.load(open(os.path.join(out, "rows.json")))[0]
            rows.append((name, f"{r['img_per_s']:.0f}", f"{r['min']:.0f}..{r['max']:.0f}", "", res))
        elif kind == "main" and _epoch_rates(out, 1):
            med, lo, hi, wait = _epoch_rates(out, 1)
            rows.append((name, f"{med:.0f}", f"{lo:.0f}..{hi:.0f}", f"{wait:.3f}", res))
        elif kind == "loader":
            for line in open(os.path.join(out, "log.txt")):
                if line.startswith("bench data:"):
                    words = line.split()
                    rows.append((f"loader-{words[2]}", words[4], words[7].strip("(,;"), "", res))
        if len(rows) == before:
            rows.append((name, f"FAILED (exit {res['rc']})", "", "", res))
    synthetic = {}  # the model step's rate per mode, for the end-to-end rows' share of it
    for name, med, *_ in rows:
        if name.startswith("synthetic-bench-") and med.isdigit():
            synthetic["graphs" if name.endswith("cuda-graphs") else "eager"] = float(med)
    print("\n| row | img/s (median) | spread | data wait | vs synthetic step, same mode | wall s |\n"
          "| --- | ---: | --- | ---: | ---: | ---: |")
    for name, med, spread, wait, res in rows:
        mode = "graphs" if "cuda-graphs" in name else "eager"
        ratio = (f"{100 * float(med) / synthetic[mode]:.1f}%" if name.startswith("jpeg-") and mode in synthetic
                 and med.isdigit() else "")
        print(f"| {name} | {med} | {spread} | {wait} | {ratio} | {res['seconds']:.0f} |")
    for name, use in engines:
        print(f"hardware JPEG engines during {name}: {use}")
    print_commands(results)


class JpegEngines:
    """``with JpegEngines(on) as e: ...`` then ``e.use``: the hardware JPEG decoders' use
    (:func:`jpeg_engine_use`) over the block, read by ``nvidia-smi dmon`` where ``on`` and
    nvidia-smi is here (``e.use`` is None otherwise)."""

    def __init__(self, on: bool = True):
        self.on, self.use, self._dmon = on and shutil.which("nvidia-smi") is not None, None, None

    def __enter__(self) -> "JpegEngines":
        if self.on:
            self._dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1"], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> bool:
        if self._dmon is not None:
            self._dmon.terminate()
            self.use = jpeg_engine_use(self._dmon.communicate()[0])
        return False


def jpeg_engine_use(dmon: str) -> str:
    """The ``jpg`` column of ``nvidia-smi dmon -s u`` (percent busy, one sample a second):
    whether nvJPEG ran on the GPU's hardware JPEG decoders."""
    header = next((line.lstrip("#").split() for line in dmon.splitlines() if line.startswith("#") and "jpg" in line), None)
    if header is None:
        return "not reported (no jpg column in nvidia-smi dmon)"
    col = header.index("jpg")
    values = [int(parts[col]) for parts in (line.split() for line in dmon.splitlines() if not line.startswith("#"))
              if len(parts) > col and parts[col].isdigit()]
    if not values:
        return "no samples"
    return f"busy {statistics.median(values):.0f}% median, {max(values)}% peak over {len(values)} s"


EAGER = " --compile off --bn-kernel torch"  # what --fp16 ran before the speed defaults (issue 27)
RECIPE_VARIANTS = {"plain": "", "ema-ls": " --model-ema 0.999 --label-smoothing 0.1",
                   "ema": " --model-ema 0.999", "ls": " --label-smoothing 0.1",
                   # with configs/fashion-mnist-stem.yaml (a stem with a max-pool, channels_last):
                   "maxpool-torch": EAGER + " --maxpool-kernel torch",
                   "maxpool-triton": EAGER + " --maxpool-kernel triton",
                   # issue 17's fastest mode against maxpool-torch (eager, torch's kernels)
                   "kernels-ro": " --maxpool-kernel triton --bn-kernel triton --compile reduce-overhead",
                   "kernels": " --compile off --maxpool-kernel triton --bn-kernel triton",
                   # issue 27: the command as typed (the speed defaults) against maxpool-torch
                   "default": ""}


def phase_recipe(args) -> None:
    """The plain fp16 recipe vs the same with a weight average and/or label smoothing
    (--variants), for each of --seeds (runs alternate between the GPUs, all at once: accuracy
    only), then the mean of each."""
    names = args.variants.split(",")
    unknown = set(names) - set(RECIPE_VARIANTS)
    if unknown:
        fail(f"unknown recipe variant(s) {sorted(unknown)}; choose from {','.join(RECIPE_VARIANTS)}")
    data = ensure_fashion(args)
    base = f"{PY} {recipe(args, data)} --fp16"
    variants = [(v, RECIPE_VARIANTS[v]) for v in names]
    seeds = [int(x) for x in args.seeds.split(",")]
    gpus = max(visible_gpus(), 1)
    runs = [{"name": f"r-fp16-{v}-s{seed}", "cmd": f"{base}{extra} --seed {seed}",
             "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}}
            for k, (seed, (v, extra)) in enumerate((s_, v_) for s_ in seeds for v_ in variants)]
    results = run_group(runs, args)
    for r in results:
        rows = last_metrics(os.path.join(args.out, r["name"]))
        if rows and "val_acc1_ema" in rows[-1]:
            print(f"{r['name']}: weight average final Acc@1 {rows[-1]['val_acc1_ema']:.2f}, "
                  f"best {max(x['val_acc1_ema'] for x in rows):.2f}")
    table(results, f"r-fp16-plain-s{seeds[0]}")
    for v, _ in variants:
        accs = [r["acc1"] for r in results if r["name"].rsplit("-s", 1)[0] == f"r-fp16-{v}" and r["acc1"] is not None]
        if accs:
            print(f"{v}: final Acc@1 mean {sum(accs) / len(accs):.2f} over {len(accs)} seed(s), "
                  f"min {min(accs):.2f}, max {max(accs):.2f}")
    png = os.path.join(args.out, "recipe-fp16-ema-ls.png")
    dirs = " ".join(os.path.join(args.out, f"r-fp16-{v}-s{seeds[0]}") for v, _ in variants)
    sh(f"{PY} scripts/plot_metrics.py {dirs} --out {png} --title 'ResNet-18 fp16 on Fashion-MNIST, 1 H200: "
       f"{' vs '.join(names)}'", os.path.join(args.out, "plot.log"))
    print(f"plot: {png}" if os.path.exists(png) else f"plot failed: {tail(os.path.join(args.out, 'plot.log'))}")


SHRINK_PIPELINES = {"classic": "--data-pipeline classic", "cpu": "--decode cpu", "gpu": "--decode gpu"}


def ensure_fashion_jpeg(args) -> str:
    """Fashion-MNIST stored as --shrink-store px RGB JPEGs (a real set stored larger than it trains)."""
    root = f"/tmp/fashion-mnist-jpeg{args.shrink_store}"
    if os.path.isdir(os.path.join(root, "train")):
        return root
    cmd = (f"{PY} scripts/prepare_dataset.py fashion-mnist --src {args.idx_dir} --out {root} --format jpeg "
           f"--size {args.shrink_store} -q")
    print("$", cmd, flush=True)
    t0 = time.time()
    if sh(cmd, os.path.join(args.out, "prepare-jpeg.log")).returncode:
        fail("exporting Fashion-MNIST as JPEGs failed:\n" + tail(os.path.join(args.out, "prepare-jpeg.log"), 20))
    print(f"  exported in {time.time() - t0:.0f} s", flush=True)
    return root


def pixel_comparison(root: str, size: int, min_scale: float, n: int = 1024) -> None:
    """The same seeded crops and flips of ``n`` training images through each pipeline, against
    torchvision's classic transforms (PIL decode, PIL resize): how far each departs, whether it
    is brighter or darker, and how sharp it is (mean absolute difference of neighbouring pixels,
    relative to classic's). The decoders alone too: nvJPEG's full image vs PIL's."""
    import numpy as np
    import torch
    from PIL import Image
    from torchvision import datasets, transforms

    sys.path.insert(0, REPO)
    from imagenet.data.cropbatch import CropBatch, TrainCropReader
    from imagenet.data.decode import TrainDecoder
    from imagenet.data.gpudecode import JpegBatch, TrainJpegReader, decode_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU: TRITON_INTERPRET=1
    paths = [p for p, _ in datasets.ImageFolder(os.path.join(root, "train")).samples[::50][:n]]
    classic = transforms.Compose([transforms.RandomResizedCrop(size, scale=(min_scale, 1.0)),
                                  transforms.RandomHorizontalFlip(0.5)])
    make = lambda: TrainDecoder(size, min_scale, 0.5)  # noqa: E731

    def seeded(fn):
        out = []
        for k, path in enumerate(paths):
            torch.default_generator.manual_seed(1000 + k)
            out.append(fn(path))
        return out

    ref = torch.stack(seeded(lambda p: torch.from_numpy(np.asarray(classic(Image.open(p).convert("RGB"))).copy())))
    worker = torch.stack(seeded(make()))
    crops = CropBatch.collate(seeded(TrainCropReader(make()))).to_device(device).cpu()
    gpu_items = seeded(TrainJpegReader(make()))
    gpu = decode_batch(JpegBatch.collate(gpu_items), device)[0].cpu()
    full_pil = [torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()) for p in paths[:256]]
    from imagenet.data import gpujpeg
    full_nv = [img.permute(1, 2, 0).cpu() for img in gpujpeg.require().decode(
        [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths[:256]], device)]

    def sharp(x):
        x = x.float()
        return float((x[:, 1:] - x[:, :-1]).abs().mean() + (x[:, :, 1:] - x[:, :, :-1]).abs().mean())

    print(f"\npixels: {len(paths)} training images of {root}, {size} px crops (scale {min_scale}..1), "
          "the same seeds in every pipeline, against torchvision's classic transforms")
    print("| pipeline | mean abs diff | mean diff (brightness) | pixels > 1 level off | sharpness vs classic |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = sharp(ref)
    for name, x in (("classic (PIL decode, PIL resize)", ref), ("fast, worker resize (CPU-only machines)", worker),
                    ("--decode cpu (PIL decode, GPU kernel resize)", crops), ("--decode gpu (nvJPEG, GPU kernel)", gpu)):
        d = x.int() - ref.int()
        print(f"| {name} | {d.abs().float().mean():.3f} | {d.float().mean():+.3f} | "
              f"{(d.abs() > 1).float().mean():.4f} | {sharp(x) / base:.4f} |")
    d = torch.cat([(a.int() - b.int()).reshape(-1) for a, b in zip(full_nv, full_pil)])
    print(f"| decoders alone, nvJPEG vs PIL, {len(full_pil)} whole images | {d.abs().float().mean():.3f} | "
          f"{d.float().mean():+.3f} | {(d.abs() > 1).float().mean():.4f} | |", flush=True)


def phase_shrink(args) -> None:
    """Accuracy when images are shrunk: Fashion-MNIST stored as --shrink-store px JPEGs, the
    Fashion recipe trained at --shrink-size px for --shrink-epochs, --fp16 --channels-last, each input pipeline x
    --seeds, --shrink-concurrent runs at once on the GPU (accuracy only); first, the pixels each
    pipeline makes from the same seeds."""
    root = ensure_fashion_jpeg(args)
    size = args.shrink_size
    pixel_comparison(root, size, 0.6)
    base = (f"{PY} main.py {root} --config configs/fashion-mnist.yaml --image-size {size} --val-resize {size} "
            f"--epochs {args.shrink_epochs} --fp16 --channels-last -j {args.workers} --output-dir OUT")
    names = args.shrink_pipelines.split(",")
    unknown = set(names) - set(SHRINK_PIPELINES)
    if unknown:
        fail(f"--shrink-pipelines: unknown {sorted(unknown)}; choose from {','.join(SHRINK_PIPELINES)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = [{"name": f"shrink-{name}-s{seed}", "cmd": f"timeout {args.shrink_timeout} {base} "
             f"{SHRINK_PIPELINES[name]} --seed {seed}", "env": {"CUDA_VISIBLE_DEVICES": "0"}}
            for seed in seeds for name in names]
    results = []
    for i in range(0, len(runs), args.shrink_concurrent):
        results += run_group(runs[i:i + args.shrink_concurrent], args)
    table(results, runs[0]["name"])
    print("\n| pipeline | final Acc@1 per seed | mean | spread |\n| --- | --- | ---: | ---: |")
    for name in names:
        accs = [r["acc1"] for r in results if r["name"].rsplit("-s", 1)[0] == f"shrink-{name}" and r["acc1"] is not None]
        if accs:
            print(f"| {name} | {' / '.join(f'{a:.2f}' for a in accs)} | {sum(accs) / len(accs):.2f} | "
                  f"{max(accs) - min(accs):.2f} |")


IMAGENET_TRAIN = 1_281_167
SHARD_WINDOW = 65_536  # main.py's default --shuffle-window: ImageNet's order mixes 1/20 of the set at a time


def ensure_shards(args, src: str, out: str, shard_size: str) -> str:
    """``src`` converted by scripts/make_shards.py into ``out`` (reused when already finished)."""
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    cmd = f"{PY} scripts/make_shards.py {src} {out} --shard-size {shard_size} --workers {os.cpu_count()} -q"
    print("$", cmd, flush=True)
    t0 = time.time()
    log = os.path.join(args.out, f"make_shards-{os.path.basename(out)}.log")
    if sh(cmd, log).returncode:
        fail(f"converting {src} into shards failed:\n" + tail(log, 20))
    print(f"  converted in {time.time() - t0:.0f} s: {tail(log, 1).strip()}", flush=True)
    return out


def scaled_window(train_images: int, args) -> int:
    """--shards-window, or the default window scaled to the set: the share of it ImageNet's default mixes."""
    return args.shards_window or max(1, round(train_images * SHARD_WINDOW / IMAGENET_TRAIN))


def _train_images(shards: str) -> int:
    return json.load(open(os.path.join(shards, "index.json")))["splits"]["train"]["samples"]


def phase_shards(args) -> None:
    """Tar shards (scripts/make_shards.py) against the image folder they were made from, --shards-parts:
    speed: ResNet-50 --fp16 --channels-last end to end from the benchmark folder (ensure_jpeg) and
    from its shards, --shards-decode (CPU and/or --decode gpu), --shards-workers workers, each mode's synthetic
    step (main.py --dummy) for reference, one run at a time; accuracy: Fashion-MNIST as shards vs
    the same folder, the fp16 recipe, --shards-seeds. The shard runs use a window scaled to the set
    as main.py's default is to ImageNet's (--shards-window)."""
    parts = args.shards_parts.split(",")
    if set(parts) - {"speed", "accuracy"}:
        fail(f"--shards-parts: {args.shards_parts!r}; choose from speed,accuracy")
    modes = args.shards_modes.split(",")
    if set(modes) - {"eager", "cuda-graphs"}:
        fail(f"--shards-modes: {args.shards_modes!r}; choose from eager,cuda-graphs")
    if not args.shards_decode or set(args.shards_decode.split(",")) - {"cpu", "gpu"}:
        fail(f"--shards-decode: {args.shards_decode!r}; choose from cpu,gpu")
    if "speed" in parts:
        _shards_speed(args, modes)
    if "accuracy" in parts:
        _shards_accuracy(args)


def _shards_speed(args, modes: list) -> None:
    ensure_jpeg(args)
    shards = ensure_shards(args, JPEG_DIR, JPEG_DIR + "-shards", args.shards_size)
    window = scaled_window(_train_images(shards), args)
    g0 = {"CUDA_VISIBLE_DEVICES": "0"}
    model = "-a resnet50 -b 256 --fp16 --channels-last"
    runs = []  # (name, mode, cmd)
    for mode in modes:
        compiled = "" if mode == "cuda-graphs" else " --compile off"  # the speed defaults compile on a GPU
        runs.append((f"synthetic-main-{mode}", mode, f"timeout {args.e2e_timeout} {PY} main.py --dummy {model} "
                     f"--epochs 3 --dummy-train-size {256 * 60} --dummy-val-size 2560 -p 100 --output-dir OUT{compiled}"))
        for decode in args.shards_decode.split(","):
            for source, data, extra in (("folder", JPEG_DIR, ""), ("shards", shards, f" --shuffle-window {window}")):
                runs.append((f"{source}-{decode}-decode-{mode}", mode,
                             f"timeout {args.e2e_timeout} {PY} main.py {data} {model} -j {args.shards_workers} "
                             f"--epochs {args.e2e_epochs} -p 50 --decode {decode} --output-dir OUT{compiled}{extra}"))
    rows, results = {}, []
    for name, mode, cmd in runs:
        res = run_group([{"name": name, "cmd": cmd, "env": g0}], args)[0]
        results.append(res)
        print(tail(os.path.join(args.out, name, "log.txt"), 3), flush=True)
        rows[name] = (mode, _epoch_rates(os.path.join(args.out, name), 1), res)
    print(f"\nshards: {shards} (window {window} images); median epoch after the first")
    print("| row | img/s (median) | spread | data wait | vs synthetic step, same mode | shards vs folder | wall s |\n"
          "| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, (mode, rates, res) in rows.items():
        if rates is None:
            print(f"| {name} | FAILED (exit {res['rc']}) | | | | | {res['seconds']:.0f} |")
            continue
        med, lo, hi, wait = rates
        synthetic = rows.get(f"synthetic-main-{mode}", (None, None))[1]
        folder = rows.get(name.replace("shards-", "folder-"), (None, None))[1] if name.startswith("shards-") else None
        vs_syn = f"{100 * med / synthetic[0]:.1f}%" if synthetic and not name.startswith("synthetic") else ""
        vs_folder = f"{100 * med / folder[0]:.1f}%" if folder else ""
        print(f"| {name} | {med:.0f} | {lo:.0f}..{hi:.0f} | {wait:.3f} | {vs_syn} | {vs_folder} | {res['seconds']:.0f} |")
    print_commands(results)


def _folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) + 1536 for d, _, files in os.walk(root) for f in files)


def _shards_accuracy(args) -> None:
    """Fashion-MNIST: the fp16 recipe from the folder and from its shards, three seeds (all at once,
    alternating over the GPUs); shards as many as ImageNet's 1 GB ones are to its set (about 140)."""
    data = ensure_fashion(args)
    size = max(_folder_bytes(os.path.join(data, "train")) // 140, 1 << 16)
    shards = ensure_shards(args, data, args.data.rstrip("/") + "-shards", str(size))
    window = scaled_window(_train_images(shards), args)
    seeds = [int(x) for x in args.shards_seeds.split(",")]
    gpus = max(visible_gpus(), 1)
    runs = []
    for k, (seed, source) in enumerate((s, src) for s in seeds for src in ("folder", "shards")):
        root, extra = (data, "") if source == "folder" else (shards, f" --shuffle-window {window}")
        runs.append({"name": f"acc-{source}-s{seed}", "cmd": f"{PY} {recipe(args, root)} --fp16 --seed {seed}{extra}",
                     "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}})
    results = run_group(runs, args)
    table(results, f"acc-folder-s{seeds[0]}")
    means = {}
    for source in ("folder", "shards"):
        accs = [r["acc1"] for r in results if r["name"].startswith(f"acc-{source}-") and r["acc1"] is not None]
        if accs:
            means[source] = sum(accs) / len(accs)
            print(f"{source}: final Acc@1 mean {means[source]:.2f} over {len(accs)} seed(s), min {min(accs):.2f}, "
                  f"max {max(accs):.2f}")
    if len(means) == 2:
        diff = means["shards"] - means["folder"]
        print(f"shards - folder: {diff:+.2f} points ({'within' if abs(diff) <= 0.2 else 'NOT within'} 0.2); "
              f"{_train_images(shards)} training images in {size / 1e6:.1f} MB shards, window {window}")


def visible_gpus() -> int:
    out = subprocess.run([PY, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                         text=True)
    return int(out.stdout.strip() or 0)


DECODE_MODES = {"eager": " --compile off", "cuda-graphs": ""}  # cuda-graphs: the plain command (speed defaults)


def decode_subset(args) -> str:
    """The benchmark folder cut to --decode-per-class training images and one validation image a
    class (links, made in a second): short epochs, so that every row of the phase fits one call."""
    root = f"{JPEG_DIR}_decode{args.decode_per_class}"
    if os.path.isdir(os.path.join(root, "val")):
        return root
    src = ensure_jpeg(args)
    shutil.rmtree(root + ".tmp", ignore_errors=True)
    for split, keep in (("train", args.decode_per_class), ("val", 1)):
        for cls in sorted(os.listdir(os.path.join(src, split))):
            os.makedirs(os.path.join(root + ".tmp", split, cls), exist_ok=True)
            for name in sorted(os.listdir(os.path.join(src, split, cls)))[:keep]:
                os.symlink(os.path.join(src, split, cls, name), os.path.join(root + ".tmp", split, cls, name))
    os.rename(root + ".tmp", root)
    return root


def _median_stages(rows: list) -> dict:
    """Each stage's median over the epochs' input_stages (ms a batch), in the account's order."""
    accounts = [r["input_stages"] for r in rows if r.get("input_stages")]
    if not accounts:
        return {}
    keys = [k for k in accounts[0] if k != "batches"]
    return {k: statistics.median(a.get(k, 0.0) for a in accounts) for k in keys}


def _decode_auto(workers: list) -> str:
    """What --decode auto chooses on this machine for one GPU at each -j (imagenet.data.decodechoice)."""
    code = ("import sys; sys.path.insert(0, '.'); import torch; "
            "from imagenet.base.config import Config; "
            "from imagenet.data.decodechoice import choose, gpu_decoder_available; "
            "from imagenet.training.defaults import usable_cpus; "
            "cuda, cpus, dec = torch.cuda.is_available(), usable_cpus(), gpu_decoder_available(); "
            f"[print(f'-j {{w}}: --decode', c.decode, '--', c.why) for w in {workers!r} for c in "
            "[choose(Config(decode='auto', workers=w), cuda=cuda, cpus_per_gpu=cpus, gpu_decoder=dec)]]")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"))
    return out.stdout.strip() or out.stderr.strip()[-500:]


def _decoder_table(data: str, batch: int) -> str:
    """Every GPU JPEG decoder alone on the idle GPU and beside a ResNet-50 training loop on the same
    GPU, with the decode thread's CPU share in each (scripts/perf/jpeg_decoders.py), over 8
    batches of the folder's training JPEGs; the hardware JPEG engines' use over all of it."""
    with JpegEngines() as watched:
        try:
            out = subprocess.run([PY, "scripts/perf/jpeg_decoders.py", data, "--batch-size", str(batch), "--images",
                                  str(8 * batch), "--passes", "3"],
                                 cwd=REPO, capture_output=True, text=True, timeout=300,
                                 env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"))
            table = out.stdout.strip() or out.stderr.strip()[-800:]
        except subprocess.TimeoutExpired as e:  # the rows measured so far (the tool prints each when done)
            got = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            table = got.strip() + "\n(cut off after 300 s)"
    engines = f"\n- hardware JPEG engines over all of it: {watched.use}" if watched.use else ""
    return table + engines


def _decode_jpegs(spec: str) -> list:
    """--decode-jpeg as a list of the trainer's GPU JPEG decoders (empty: all of them), or exit 2."""
    sys.path.insert(0, REPO)
    from imagenet.data.gpujpeg import BACKENDS
    jpegs = [j for j in spec.split(",") if j] or list(BACKENDS)
    if set(jpegs) - set(BACKENDS):
        fail(f"--decode-jpeg: {spec!r}; give GPU JPEG decoders of the trainer, comma-separated, of {','.join(BACKENDS)}")
    return jpegs


def phase_decode(args) -> None:
    """The input path's table from one call: ResNet-50 --fp16 --channels-last -b --decode-batch end to end
    from the benchmark JPEGs (cut to --decode-per-class a class) with CPU decode and --decode gpu
    (a row per --decode-jpeg decoder) at each of --decode-workers workers, in each of --decode-modes (eager: --compile off;
    cuda-graphs: the plain command, the speed defaults' fastest mode), beside main.py --dummy's
    synthetic step in the same mode. Each rate is the median of the epochs after the first
    (--decode-epochs; main.py leaves each epoch's first steps out), with the GPU's idle share and
    the share of the synthetic step; then where a --decode gpu batch's time went (input_stages,
    medians of the same epochs), what each input-bound epoch's line said, the hardware JPEG
    engines' use, and what --decode auto chooses here. With --old DIR (an older commit's tree) each
    --decode gpu row also runs from that tree right after this one's, for a before/after column.
    --decode-tests runs those tests first, in the same call. Rows run in order of importance (per mode: synthetic, GPU decode, CPU decode)
    within --decode-budget seconds (the tests' time included), each under --decode-timeout; a row
    that would start past the budget is reported as not run."""
    jpegs = _decode_jpegs(args.decode_jpeg)  # GPU JPEG decoders, a row each (IMAGENET_GPU_JPEG)
    if visible_gpus() == 0:
        fail("the decode phase trains on a CUDA GPU (main.py --decode gpu); none is visible here")
    modes = args.decode_modes.split(",")
    if set(modes) - set(DECODE_MODES):
        fail(f"--decode-modes: {args.decode_modes!r}; choose from {','.join(DECODE_MODES)}")
    old = os.path.abspath(args.old) if args.old else None
    if old and not os.path.isfile(os.path.join(old, "main.py")):
        fail(f"--old {args.old!r} holds no main.py: give the older commit's tree (git archive COMMIT | tar -x -C DIR)")
    t0 = time.time()
    g0 = {"CUDA_VISIBLE_DEVICES": "0"}
    tested = None
    if args.decode_tests:
        tested = run_group([{"name": "decode-tests", "cmd": f"{PY} -m pytest -q -p no:cacheprovider {args.decode_tests}",
                             "env": g0}], args)[0]
        print(tail(os.path.join(args.out, "decode-tests", "log.txt"), 3), flush=True)
    data = decode_subset(args)
    workers = [int(w) for w in args.decode_workers.split(",")]
    batch, epochs = args.decode_batch, args.decode_epochs
    common = f"-a resnet50 -b {batch} --fp16 --channels-last --epochs {epochs} -p 1000 --output-dir OUT"
    classes = len(os.listdir(os.path.join(data, "train")))
    per_epoch = classes * args.decode_per_class // batch * batch
    runs = []  # (name, mode, decode, workers, cmd): per mode the synthetic step, then GPU decode, then CPU decode
    for mode in modes:
        flags = DECODE_MODES[mode]
        runs.append((f"synthetic-{mode}", mode, "synthetic", 0,
                     f"{PY} main.py --dummy --dummy-train-size {per_epoch} --dummy-val-size {batch} {common}{flags}"))
        for decode in [f"gpu:{j}" for j in jpegs] + ["cpu"]:
            for w in workers:
                runs.append((f"{decode.replace(':', '-')}-j{w}-{mode}", mode, decode, w,
                             f"{PY} main.py {data} {common}{flags} --decode {decode.split(':')[0]} -j {w}"))
                if old and decode == f"gpu:{jpegs[0]}":  # the same command from the older tree, right after
                    runs.append((f"old-gpu-j{w}-{mode}", mode, "old-gpu", w,
                                 f"{PY} main.py {data} {common}{flags} --decode gpu -j {w}"))
    auto = _decode_auto(workers)
    decoders = _decoder_table(data, batch)
    results, engines = [], {}
    for name, mode, decode, w, cmd in runs:
        left = args.decode_budget - (time.time() - t0)
        if left < 45:
            results.append((name, mode, decode, w, None))
            continue
        here = f"cd {old} && " if decode.startswith("old-") else ""  # the older tree's rows run there
        env = dict(g0, IMAGENET_GPU_JPEG=decode.split(":")[1]) if decode.startswith("gpu:") else g0
        with JpegEngines("gpu" in decode) as watched:
            res = run_group([{"name": name, "cmd": f"{here}timeout {int(min(left, args.decode_timeout))} {cmd}",
                              "env": env}], args)[0]
        if watched.use is not None:
            engines[name] = watched.use
        results.append((name, mode, decode, w, res))
    synthetic, rows = {}, {}  # rows: (decode, workers, mode) -> (rates, stages, decoded on GPU, fallbacks, result)
    for name, mode, decode, w, res in results:
        out = os.path.join(args.out, name)
        measured = last_metrics(out)[1:] if res is not None else []
        rates = _epoch_rates(out, 1) if res is not None else None
        if decode == "synthetic":
            synthetic[mode] = rates[0] if rates else None
            continue
        rows[(decode, w, mode)] = (rates, _median_stages(measured), sum(r.get("decoded_on_gpu", 0) for r in measured),
                                   sum(r.get("decode_fallbacks", 0) for r in measured), res)
    print(f"\nResNet-50 --fp16 --channels-last -b {batch}, {per_epoch} training JPEGs an epoch ({data}), {epochs} "
          "epochs, the first left out; img/s the median of the others (spread), 'idle' the GPU's share waiting for "
          "input, '%' of the synthetic step in the same mode:")
    head = " | ".join(f"{m}: img/s | spread | idle | %" for m in modes)
    print(f"\n| input | workers | {head} |\n| --- | ---: |" + " ---: | --- | ---: | ---: |" * len(modes))
    print("| synthetic step (main.py --dummy) | | " + " | ".join(
        f"{synthetic[m]:.0f} | | | 100" if synthetic.get(m) else "not run | | |" for m in modes) + " |")
    for decode in ["cpu"] + [f"gpu:{j}" for j in jpegs] + (["old-gpu"] if old else []):
        for w in workers:
            cells = []
            for m in modes:
                rates, _, _, _, res = rows.get((decode, w, m), (None, {}, 0, 0, None))
                if res is None:
                    cells.append("not run (budget) | | |")
                elif not rates:
                    cells.append(f"FAILED (exit {res['rc']}) | | |")
                else:
                    med, lo, hi, wait = rates
                    share = f"{100 * med / synthetic[m]:.1f}" if synthetic.get(m) else ""
                    cells.append(f"{med:.0f} | {lo:.0f}..{hi:.0f} | {wait:.3f} | {share}")
            label = {"cpu": "CPU decode", "old-gpu": f"`--decode gpu`, {old}"}.get(
                decode, f"`--decode gpu`, {decode.split(':')[-1]}")
            print(f"| {label} | {w} | " + " | ".join(cells) + " |")
    accounts = {(decode[4:], w, m): v for (decode, w, m), v in rows.items() if decode.startswith("gpu:") and v[1]}
    keys = next(iter(accounts.values()))[1].keys() if accounts else []
    print("\n--decode gpu, where a batch's time went (input_stages: ms a batch, medians of the measured epochs; "
          "worker stages are one worker's time for a batch; geometry and normalise are GPU time):")
    print("\n| row | " + " | ".join(keys) + " | decoded on GPU | fallbacks |")
    print("| --- |" + " ---: |" * (len(keys) + 2))
    for (jpeg, w, m), (_, stages, gpu, cpu, _) in accounts.items():
        print(f"| gpu-{jpeg}-j{w}-{m} | " + " | ".join(f"{stages.get(k, 0.0):.2f}" for k in keys) + f" | {gpu} | {cpu} |")
    print("\ninput-bound lines (the last of each row):")
    for name, *_, res in results:
        log = os.path.join(args.out, name, "log.txt")
        lines = [ln.strip() for ln in open(log) if "was input-bound" in ln] if res is not None and os.path.exists(log) \
            else []
        if lines:
            print(f"- {name}: {lines[-1]}")
    for name, use in engines.items():
        print(f"hardware JPEG engines during {name}: {use}")
    print("\nEach GPU JPEG decoder alone and beside a training loop (scripts/perf/jpeg_decoders.py):\n" + decoders)
    print("\n--decode auto here, one GPU:\n" + auto)
    if tested is not None:
        print(f"\ntests ({args.decode_tests}): exit {tested['rc']}, "
              f"{tail(os.path.join(args.out, 'decode-tests', 'log.txt'), 1).strip()}")
    print(f"\nphase: {time.time() - t0:.0f} s")
    print_commands(([tested] if tested else []) + [res for *_, res in results if res is not None])


def phase_scaling(args) -> None:
    """Weak scaling of ResNet-50 over 1, 2, 4, 8 GPUs (as many as are visible): DDP through
    multiproc at 256 images per GPU, DataParallel for comparison, the GPU-decode JPEG pipeline
    on all GPUs, and the report's parity check (fp16 DDP on all GPUs vs fp32 on one)."""
    n_gpus = visible_gpus()
    best = args.bench_best
    counts = [n for n in (1, 2, 4, 8) if n <= n_gpus]
    rows = []
    for n in counts:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n)))}
        common = (f"scripts/perf/bench.py train --arch resnet50 --batch-size {256 * n} --steps {args.bench_steps} "
                  f"--windows 5 --precision {best} --channels-last --json OUT/rows.json")
        runs = [(f"scale-ddp{n}", f"{PY} -m multiproc --log-dir OUT {common}" if n > 1 else f"{PY} {common}")]
        if n > 1 and n in (2, n_gpus):
            runs.append((f"scale-dp{n}", f"{PY} {common}"))
        for name, cmd in runs:
            run_group([{"name": name, "cmd": cmd, "env": env}], args)
            path = os.path.join(args.out, name, "rows.json")
            rate = json.load(open(path))[0]["img_per_s"] if os.path.exists(path) else None
            rows.append((name, n, rate))
            print(f"  {name}: {rate if rate is None else round(rate)} img/s", flush=True)
    base = next((r for name, n, r in rows if n == 1 and r), None)
    print("\n| run | GPUs | img/s (median of 5 windows) | per GPU | scaling efficiency |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, n, rate in rows:
        eff = f"{rate / (n * base):.3f}" if rate and base else "-"
        print(f"| {name} | {n} | {rate:.0f} | {rate / n:.0f} | {eff} |" if rate else f"| {name} | {n} | FAILED | | |")
    if n_gpus > 1:
        everything = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n_gpus)))}
        jpeg = ensure_jpeg(args)
        run_group([{"name": f"jpeg-gpu-decode-ddp{n_gpus}", "env": everything,
                    "cmd": f"{PY} -m multiproc --log-dir OUT main.py {jpeg} -a resnet50 -b {256 * n_gpus} --amp "
                           f"--channels-last --decode gpu -j {max(2, args.workers // n_gpus)} --epochs 1 --prof 20 "
                           f"-p 5 --output-dir OUT"}], args)
        print(tail(os.path.join(args.out, f"jpeg-gpu-decode-ddp{n_gpus}", "log.txt"), 4), flush=True)
        data = ensure_fashion(args)
        results = run_group([{"name": "1-fp32", "cmd": f"{PY} {recipe(args, data)}", "env": {"CUDA_VISIBLE_DEVICES": "0"}}],
                            args)
        results += run_group([{"name": f"fp16-ddp{n_gpus}", "env": everything,
                               "cmd": f"{PY} -m multiproc --log-dir OUT {recipe(args, data)} --fp16 "
                                      f"--dist-backend nccl"}], args)
        table(results, "1-fp32")


def _first_step(log: str):
    """The "first step done N s after start" of a main.py log (None if it has none)."""
    for line in open(log, errors="replace"):
        if "=> first step done" in line:
            return float(line.split("done")[1].split("s after")[0])
    return None


DEFAULTS_ROWS = {  # name: (tree, launcher, flags) -- issue 27's table; "old": the --old tree
    "old-multiproc-fp16": ("old", "multiproc", "-b 256 --fp16"),
    "old-fp16": ("old", "", "-b 256 --fp16"),
    "old-amp": ("old", "", "-b 256 --amp"),
    "old-fp32": ("old", "", "-b 256"),
    "old-fp16-cl": ("old", "", "-b 256 --fp16 --channels-last"),
    "old-fastest-b256": ("old", "", "-b 256 --fp16 --channels-last --compile reduce-overhead --bn-kernel triton "
                                    "--maxpool-kernel triton"),
    "new-multiproc-fp16": ("new", "multiproc", "-b 256 --fp16"),
    "new-fp16": ("new", "", "-b 256 --fp16"),
    "new-amp": ("new", "", "-b 256 --amp"),
    "new-amp-bf16": ("new", "", "-b 256 --amp --amp-dtype bfloat16"),
    "new-fp32": ("new", "", "-b 256"),
    "new-fp16-b384": ("new", "", "-b 384 --fp16"),
    "new-fp16-eager": ("new", "", "-b 256 --fp16 --compile off"),
}


def phase_defaults(args) -> None:
    """Issue 27: ResNet-50 main.py --dummy as a user types it, this tree against --old (the commit
    before, e.g. `git archive` of it) side by side; the first step's wait with empty caches
    (cold) and again with the caches the first run left (warm), one process and under multiproc.
    Each row: --defaults-epochs epochs of --defaults-steps steps, the rate the median of the
    epochs after the first (each epoch leaves out its first steps: compilation, cuDNN's search)."""
    rows = [r for r in args.defaults_rows.split(",") if r]
    unknown = set(rows) - set(DEFAULTS_ROWS)
    if unknown:
        fail(f"--defaults-rows: unknown {sorted(unknown)}; choose from {','.join(DEFAULTS_ROWS)}")
    old = os.path.abspath(args.old) if args.old else None
    if any(DEFAULTS_ROWS[r][0] == "old" for r in rows) and not (old and os.path.isfile(os.path.join(old, "main.py"))):
        fail(f"--old {args.old!r} holds no main.py: give the older commit's tree (git archive COMMIT | tar -x -C DIR)")
    caches = {tree: {"TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor-{tree}", "TRITON_CACHE_DIR": f"/tmp/triton-{tree}"}
              for tree in ("old", "new")}
    stage = args.defaults_stage
    for env in caches.values():  # cold means cold: nothing from an earlier call
        for d in env.values():
            if stage != "time":
                shutil.rmtree(d, ignore_errors=True)
    t0 = time.time()

    def cmd_of(name: str, epochs: int, steps: int) -> tuple:
        tree, launcher, flags = DEFAULTS_ROWS[name]
        batch = int(flags.split("-b ")[1].split()[0])
        here = REPO if tree == "new" else old
        main = (f"main.py --dummy -a resnet50 {flags} --epochs {epochs} --dummy-train-size {batch * steps} "
                f"--dummy-val-size {batch * 4} -p 1000 -j 0 --output-dir OUT")
        run = f"{PY} -m multiproc --nproc-per-node 1 {main}" if launcher else f"{PY} {main}"
        return f"cd {here} && timeout {args.e2e_timeout} {run}", dict(caches[tree], CUDA_VISIBLE_DEVICES="0")

    waits = []
    if not args.skip_cold and stage != "time":
        for label in ("cold", "warm"):
            for name in ("new-fp16", "new-multiproc-fp16"):
                cmd, env = cmd_of(name, 1, 30)
                res = run_group([{"name": f"{label}-{name}", "cmd": cmd, "env": env}], args)[0]
                waits.append((label, name, _first_step(os.path.join(args.out, f"{label}-{name}", "log.txt")), res))
        print(f"  (cold and warm starts: {time.time() - t0:.0f} s)", flush=True)
    # the rows' compilations at once, so the timed rows below start from warm caches
    warmed = () if args.skip_cold else ("new-fp16", "new-multiproc-fp16")
    compiled = [r for r in rows if r not in warmed and
                ("--compile reduce-overhead" in DEFAULTS_ROWS[r][2] or
                 (DEFAULTS_ROWS[r][0] == "new" and "--compile off" not in DEFAULTS_ROWS[r][2]))]
    if compiled and stage != "time":
        run_group([{"name": f"precompile-{r}", "cmd": cmd_of(r, 1, 12)[0], "env": cmd_of(r, 1, 12)[1]}
                   for r in compiled], args)
        print(f"  (compilations done at {time.time() - t0:.0f} s)", flush=True)
    if stage == "compile":
        return
    table_rows = []
    for name in rows:
        if time.time() - t0 > args.budget:
            table_rows.append((name, "not run (--budget)", "", None))
            continue
        cmd, env = cmd_of(name, args.defaults_epochs, args.defaults_steps)
        res = run_group([{"name": name, "cmd": cmd, "env": env}], args)[0]
        rates = _epoch_rates(os.path.join(args.out, name), 1)
        table_rows.append((name, f"{rates[0]:.0f}" if rates else f"FAILED (exit {res['rc']})",
                           f"{rates[1]:.0f}..{rates[2]:.0f}" if rates else "", res))
    fastest = max((float(r[1]) for r in table_rows if r[1].replace(".", "").isdigit() and "b384" not in r[0]),
                  default=None)
    print("\n| row | command (main.py --dummy -a resnet50 ...) | img/s (median epoch) | spread | of the fastest b256 |")
    print("| --- | --- | ---: | --- | ---: |")
    for name, rate, spread, _ in table_rows:
        tree, launcher, flags = DEFAULTS_ROWS[name]
        ratio = f"{float(rate) / fastest:.3f}" if fastest and rate.replace(".", "").isdigit() else ""
        print(f"| {name} | {'python -m multiproc ' if launcher else ''}{flags} | {rate} | {spread} | {ratio} |")
    if waits:
        print("\n| start | command | first step done after (s) | run's wall s |")
        print("| --- | --- | ---: | ---: |")
        for label, name, wait, res in waits:
            print(f"| {label} | {name} | {wait if wait is not None else 'n/a'} | {res['seconds']:.0f} |")
    print_commands([r[3] for r in table_rows if r[3]] + [w[3] for w in waits])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("smoke", "suite", "e2e", "precision", "multigpu", "bench", "recipe", "jpeg", "scaling",
                                     "shrink", "defaults", "shards", "decode"))
    p.add_argument("--data", default="/tmp/fashion-mnist")
    p.add_argument("--idx-dir", default=os.path.join(REPO, ".data", "fashion-mnist"))
    p.add_argument("--out", default="/tmp/gpu_verify", help="run folders (checkpoints are large: not $OUT)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ref-acc", type=float, help="run 1's Acc@1 from the precision phase, for the multigpu table")
    p.add_argument("--bench-best", default="fp16", help="precision for the DP/DDP scaling rows")
    p.add_argument("--only", help="multigpu: run numbers to run, e.g. 5,6a,6b")
    p.add_argument("--bench-steps", type=int, default=20)
    p.add_argument("--groups", default="matrix,ab,dp,ddp,small",
                   help=f"bench: comma list of {','.join(BENCH_GROUPS)}")
    p.add_argument("--compile-rows", default="",
                   help="bench: PRECISION[:MODE] rows to time compiled, e.g. fp16,fp16:max-autotune,amp-bf16")
    p.add_argument("--data-windows", type=int, default=5, help="jpeg: timed windows per input pipeline")
    p.add_argument("--skip-e2e", action="store_true", help="jpeg: the loader benchmark only")
    p.add_argument("--skip-data", action="store_true", help="jpeg: the end-to-end runs only")
    p.add_argument("--data-pipelines", default="classic,fast,gpu", help="jpeg: the loader bench's pipelines")
    p.add_argument("--data-args", default="",
                   help="jpeg: more bench.py data options, e.g. '--train fp16 --profile 4' (a step per batch)")
    p.add_argument("--e2e-rows", default="cpu:amp,gpu:amp",
                   help="jpeg: end-to-end runs, DECODE:PRECISION[:COMPILE] each, e.g. gpu:fp16:reduce-overhead")
    p.add_argument("--jpeg-per-class", type=int, default=300,
                   help="jpeg, scaling: training JPEGs per class (100 classes) in the benchmark folder they make")
    p.add_argument("--lr", default=".01",
                   help="precision/multigpu/recipe: the learning rate (.01: the report's command line; "
                        "configs/fashion-mnist.yaml's own is 0.05 with 12 epochs)")
    p.add_argument("--seeds", default="0", help="recipe, shrink: seeds to run each variant with, e.g. 0,1,2")
    p.add_argument("--shrink-store", type=int, default=112, help="shrink: px the JPEGs are stored at")
    p.add_argument("--shrink-size", type=int, default=56, help="shrink: px they are trained and validated at")
    p.add_argument("--shrink-pipelines", default="classic,cpu,gpu", help=f"shrink: of {','.join(SHRINK_PIPELINES)}")
    p.add_argument("--shrink-epochs", type=int, default=6, help="shrink: epochs of each run (the recipe's own: 12)")
    p.add_argument("--shrink-concurrent", type=int, default=3, help="shrink: runs at once on the one GPU")
    p.add_argument("--shrink-timeout", type=int, default=400, help="shrink: seconds a run may take")
    p.add_argument("--recipe-config", default="configs/fashion-mnist.yaml",
                   help="recipe, precision, multigpu: the YAML recipe (configs/fashion-mnist-stem.yaml: a max-pool stem)")
    p.add_argument("--variants", default="plain,ema-ls",
                   help="recipe: comma list of plain,ema-ls,ema,ls (weight average, label smoothing), "
                        "maxpool-torch,maxpool-triton (--maxpool-kernel; with --recipe-config configs/fashion-mnist-stem.yaml), "
                        "kernels, kernels-ro (both kernels, eager or --compile reduce-overhead; against maxpool-torch)")
    p.add_argument("--e2e-epochs", type=int, default=4, help="e2e: epochs of each JPEG run (the first is left out)")
    p.add_argument("--e2e-modes", default="eager,cuda-graphs",
                   help="e2e: the step modes of the synthetic and JPEG rows (one call each fits the 10-minute limit)")
    p.add_argument("--e2e-timeout", type=int, default=240, help="e2e: seconds one row may take")
    p.add_argument("--e2e-cpu-variants", default="",
                   help="e2e: '|'-separated extra main.py flags, one set of CPU-decode rows each, e.g. "
                        "'--worker-nice 0|--worker-nice 10'")
    p.add_argument("--e2e-repeat", type=int, default=1, help="e2e: run the JPEG rows this many times, alternating")
    p.add_argument("--e2e-skip", default="", help="e2e: JPEG rows to leave out, by part of their name, e.g. cuda-graphs,classic")
    p.add_argument("--parts", default="synthetic,dummy,loader,jpeg",
                   help="e2e: comma list of synthetic (bench.py train), dummy (main.py --dummy), loader, jpeg")
    p.add_argument("--compile-modes", default="off,default,reduce-overhead,max-autotune",
                   help="suite: --compile modes of the ResNet-50 run")
    p.add_argument("--budget", type=float, default=540, help="suite: seconds for the whole phase")
    p.add_argument("--old", help="defaults, decode: the tree of the commit to compare against (git archive COMMIT)")
    p.add_argument("--defaults-rows", default=",".join(DEFAULTS_ROWS), help="defaults: rows to time, in order")
    p.add_argument("--defaults-epochs", type=int, default=4, help="defaults: epochs of each timed row")
    p.add_argument("--defaults-steps", type=int, default=30, help="defaults: steps of each epoch")
    p.add_argument("--skip-cold", action="store_true", help="defaults: leave out the cold and warm start runs")
    p.add_argument("--defaults-stage", choices=("all", "compile", "time"), default="all",
                   help="defaults: compile (empty the caches, compile every row) or time (with the caches as "
                        "they are) alone, so that other work can share the GPU while compiling")
    p.add_argument("--concurrent", action="store_true", help="multigpu: start the runs together (accuracy only)")
    p.add_argument("--shards-parts", default="speed",
                   help="shards: comma list of speed (benchmark folder vs its shards, img/s), accuracy "
                        "(Fashion-MNIST folder vs its shards, Acc@1 over --shards-seeds)")
    p.add_argument("--shards-modes", default="eager", help="shards: step modes of the speed rows, eager,cuda-graphs")
    p.add_argument("--shards-decode", default="cpu,gpu", help="shards: decoders of the speed rows, cpu,gpu")
    p.add_argument("--shards-workers", type=int, default=15, help="shards: loader workers of the speed rows")
    p.add_argument("--shards-size", default="64MB",
                   help="shards: --shard-size of the benchmark folder's shards (64MB: about 50 shards)")
    p.add_argument("--shards-window", type=int, default=0,
                   help="shards: --shuffle-window of the shard runs (0: main.py's default scaled from ImageNet to the set)")
    p.add_argument("--shards-seeds", default="0,1,2", help="shards: seeds of the accuracy comparison")
    p.add_argument("--decode-workers", default="4,6,15", help="decode: the -j of each row")
    p.add_argument("--decode-modes", default="eager,cuda-graphs",
                   help="decode: step modes, of " + ", ".join(f"{k} (main.py{v or ' as typed'})" for k, v in
                                                               DECODE_MODES.items()))
    p.add_argument("--decode-batch", type=int, default=384, help="decode: -b of every row")
    p.add_argument("--decode-jpeg", default="",
                   help="decode: the GPU JPEG decoders (IMAGENET_GPU_JPEG), a --decode gpu row each, e.g. torchvision "
                        "(default: every one the trainer has, torchvision,torchcodec)")
    p.add_argument("--decode-epochs", type=int, default=4, help="decode: epochs of every row (the first is left out)")
    p.add_argument("--decode-per-class", type=int, default=64,
                   help="decode: training JPEGs a class (100 classes) of the benchmark folder each epoch reads")
    p.add_argument("--decode-budget", type=float, default=480,
                   help="decode: seconds for all rows; a row that would start later is not run")
    p.add_argument("--decode-timeout", type=float, default=150, help="decode: seconds one row may take")
    p.add_argument("--decode-tests", default="",
                   help="decode: test paths to run first in the same call, e.g. 'tests/test_gpudecode.py "
                        "tests/test_gpugeometry.py tests/test_input_account.py'")
    args = p.parse_args()
    args.out = os.path.abspath(args.out)  # rows of an --old tree run from there
    os.makedirs(args.out, exist_ok=True)
    {"smoke": phase_smoke, "suite": phase_suite, "e2e": phase_e2e, "precision": phase_precision, "multigpu": phase_multigpu, "bench": phase_bench,
     "recipe": phase_recipe, "jpeg": phase_jpeg, "scaling": phase_scaling, "shrink": phase_shrink,
     "defaults": phase_defaults, "shards": phase_shards, "decode": phase_decode}[args.phase](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
