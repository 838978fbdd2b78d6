#!/usr/bin/env python
"""The ResNet-50 training step's speed per mode, side by side in one call, with a kernel-class account.

    python scripts/perf/step_matrix.py --rows eager,ro,ro-b384,ro-cdt-mp --out DIR   # bench.py train rows
    python scripts/perf/step_matrix.py --rows eager+prof,default+prof --out DIR       # + a kernel-class account
    python scripts/perf/step_matrix.py --rows ro-mp,dummy:ro-mp --out DIR             # the same flags through main.py
    python scripts/perf/step_matrix.py --tests tests/test_maxpool.py --rows eager,eager-mp   # GPU tests first
    python scripts/perf/step_matrix.py --rows dummy:typed-b256,dummy:typed-b400-lars --out DIR  # main.py as typed

Every row is one process (``scripts/perf/bench.py train`` on synthetic on-device data, or ``main.py
--dummy`` for a ``dummy:`` row), ResNet-50 224 px ``--channels-last``, run one after another
under a time budget; the table at the end gives each row's median img/s over its windows, the
spread, and the ratio to the first row. A ``+prof`` row also profiles a few steps and prints
the device time per step by kernel class (convolutions, BatchNorm, Inductor's fused kernels,
elementwise, optimizer, copies) and the GPU's idle time: the account of where a step goes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A row's name is a mode and modifiers joined by "-", e.g. ro-b384-cdt-mp: the mode is eager
# (no compile), default, ro (reduce-overhead: CUDA graphs) or ma (max-autotune); the modifiers
# add flags. Every row is --fp16 and the stem's max-pool on torch's kernel unless it says.
# typed (dummy: rows only): main.py --fp16 as a user types it, every speed setting left to auto.
MODES = {"eager": "--compile off", "default": "--compile default", "ro": "--compile reduce-overhead",
         "ma": "--compile max-autotune", "typed": ""}
MODIFIERS = {
    "amp": "--precision amp", "bf16": "--precision amp-bf16",
    "cdt": "--tune-kernels",  # Inductor's coordinate-descent tuning of every generated kernel
    "mp": "--maxpool-kernel triton",  # imagenet/kernels/maxpool.py
    "bn": "--bn-kernel triton",  # imagenet/kernels/fusedbn.py
    "cbn": "--bn-kernel cudnn",  # ... with the statistics from cuDNN's fused convolutions (kernels/convstats.py)
    "1x1mm": "--inductor conv_1x1_as_mm=True",
    "mapw": "--inductor max_autotune_pointwise=True",
    "noconv": "--inductor max_autotune_conv_backends=ATEN",
    "lars": "--optimizer lars",  # imagenet/precision/lars.py (--fp16: the Triton step's LARS kernels)
}
# b<N>: --batch-size N; accum<N> (dummy: rows only): --accum-steps N, N passes of b / N a step


def row_flags(name: str) -> str:
    """bench.py train flags of a row name (SystemExit naming the unknown part)."""
    mode, *mods = name.split("-")
    if mode not in MODES:
        raise SystemExit(f"row {name!r}: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    # every speed setting named: main.py's defaults (dummy: rows) would otherwise choose for the row
    flags = {"precision": "--precision fp16", "maxpool": "--maxpool-kernel torch", "bn": "--bn-kernel torch",
             "mode": MODES[mode]}
    if mode == "typed":  # main.py decides each speed setting itself
        flags = {"precision": "--precision fp16"}
    for mod in mods:
        if re.fullmatch(r"b\d+", mod):
            flags["batch"] = f"--batch-size {mod[1:]}"
        elif re.fullmatch(r"accum\d+", mod):
            flags["accum"] = f"--accum-steps {mod[5:]}"
        elif mod in ("amp", "bf16"):
            flags["precision"] = MODIFIERS[mod]
        elif mod == "mp":
            flags["maxpool"] = MODIFIERS[mod]
        elif mod == "cbn":
            flags["bn"] = MODIFIERS[mod]
        elif mod in MODIFIERS:
            flags[mod] = MODIFIERS[mod]
        else:
            raise SystemExit(f"row {name!r}: unknown modifier {mod!r}; choose from b<batch>, accum<passes>, "
                             f"{', '.join(MODIFIERS)}")
    return " ".join(f for f in flags.values() if f)


# Kernel classes, first match wins (lower-case kernel names of cuDNN, cuBLAS, ATen and Inductor).
CLASSES = (
    ("max-pool", r"max_?pool"),
    ("fused BN + add + ReLU (ours, --bn-kernel triton)",
     r"^_(partial_stats|finish_stats|apply|partial_grad|finish_grad|grad_input)"),
    ("inductor reduction (BN statistics, BN gradient sums)", r"^triton_(red|per)"),
    ("inductor pointwise (BN apply, ReLU, add, their gradients)", r"^triton_"),
    ("batchnorm (cuDNN, ATen)", r"batch_?norm|bn_fw|bn_bw|welford|cudnn::bn"),
    ("convolution", r"conv|fprop|dgrad|wgrad|implicit|xmma(?!.*gemm)|nhwc|nchw|nvjet|cask"),
    ("gemm (fc)", r"gemm|cublas|cutlass"),
    ("optimizer", r"sgd|multi_tensor|foreach|unscale|amp_update|^_master_"),
    ("copy / memset", r"memcpy|memset|copy"),
    ("elementwise / other aten", r"."),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, pattern in CLASSES:
        if re.search(pattern, low):
            return cls
    return CLASSES[-1][0]


def kernel_account(profile_json: str, step_ms: float) -> list:
    """(class, ms per step, share of the step) from bench.py's --profile-json, plus the idle time."""
    data = json.load(open(profile_json))
    steps = data["steps"]
    per: dict = {}
    for op in data["ops"]:
        if op.get("kernel"):
            cls = classify(op["name"])
            per[cls] = per.get(cls, 0.0) + op["self_device_us"] / 1000.0 / steps
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    busy = sum(per.values())
    rows.append(("GPU idle (step - kernels)", step_ms - busy))
    return [(cls, ms, ms / step_ms) for cls, ms in rows]


def top_kernels(profile_json: str, n: int = 8) -> list:
    data = json.load(open(profile_json))
    ks = [op for op in data["ops"] if op.get("kernel")]
    ks.sort(key=lambda op: -op["self_device_us"])
    return [(op["name"][:90], op["self_device_us"] / 1000.0 / data["steps"], op["calls"] // data["steps"])
            for op in ks[:n]]


DUMMY_FLAGS = {"--precision fp16": "--fp16", "--precision amp-bf16": "--amp --amp-dtype bfloat16",
               "--precision amp": "--amp"}  # bench.py's spelling -> main.py's


def dummy_command(flags: str, args, batch: int, steps: int, out: str) -> str:
    for bench, trainer in DUMMY_FLAGS.items():
        flags = flags.replace(bench, trainer)
    m = re.search(r"--batch-size (\d+)", flags)
    if m:
        batch = int(m.group(1))
        flags = flags.replace(m.group(0), "")
    flags = re.sub(r"--inductor \S+", "", flags)
    return (f"{shlex.quote(sys.executable)} main.py --dummy -a {args.arch} -b {batch} --channels-last {flags} "
            f"--image-size {args.image_size} "
            f"--epochs 2 --dummy-train-size {batch * steps} --dummy-val-size {batch} -p 1000 -j 0 "
            f"--output-dir {shlex.quote(out)}")


def check_row(spec: str) -> str:
    """A row's flags (SystemExit naming what is wrong with it): typed and accum<N> exist in main.py only."""
    name = spec[:-5] if spec.endswith("+prof") else spec
    dummy = name.startswith("dummy:")
    base = name[6:] if dummy else name
    flags = row_flags(base)
    if not dummy and (base.split("-")[0] == "typed" or "--accum-steps" in flags):
        raise SystemExit(f"row {spec!r}: typed and accum<N> are main.py's (dummy:{base}); bench.py has neither")
    return flags


def run_row(spec: str, args, remaining: float, log) -> dict:
    profile = spec.endswith("+prof")
    name = spec[:-5] if profile else spec
    dummy = name.startswith("dummy:")
    base = name[6:] if dummy else name
    flags = check_row(spec)
    limit = max(10, min(args.row_timeout, remaining))
    row = {"row": spec, "flags": flags}
    if dummy:
        out = os.path.join(args.work, spec.replace(":", "_"))
        cmd = dummy_command(flags, args, args.batch, args.steps * args.windows + args.warmup, out)
    else:
        jpath = os.path.join(args.work, f"{spec}.json")
        cmd = (f"{shlex.quote(sys.executable)} scripts/perf/bench.py train --arch {args.arch} --channels-last "
               f"--image-size {args.image_size} --batch-size {args.batch} "
               f"--steps {args.steps} --windows {args.windows} --warmup {args.warmup} {flags} --json {jpath}")
        if profile:
            ppath = os.path.join(args.out, f"profile-{base}.json")
            cmd += f" --profile {args.profile_steps} --profile-json {ppath}"
    row["command"] = cmd
    output, row["rc"], row["seconds"] = _run(spec, cmd, limit, log)
    log.write(output[-6000:] if row["rc"] == 0 else output[-12000:])
    log.flush()
    if row["rc"] != 0:
        return row
    if dummy:
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        row["img_per_s"] = rows[-1]["img_per_s"]
        row["min"] = row["max"] = None
        return row
    r = json.load(open(jpath))[0]
    row.update(img_per_s=r["img_per_s"], min=r["min"], max=r["max"], peak=r["peak_gib"], mfu=r["mfu"],
               batch=r["batch"])
    if profile:
        step_ms = 1000.0 * r["batch"] / r["img_per_s"]
        row["account"] = kernel_account(ppath, step_ms)
        row["top"] = top_kernels(ppath)
        row["step_ms"] = step_ms
    return row


def _run(label: str, cmd: str, limit: float, log) -> tuple:
    """Run ``cmd`` in the repository within ``limit`` s: (its output, exit status or "timeout", seconds)."""
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {cmd}", flush=True)
    log.write(f"\n===== {label}\n$ {cmd}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, shell=True, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=limit, env=dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0"))
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""), "timeout"
    return output, rc, time.perf_counter() - t0


def run_tests(paths: str, limit: float, log) -> dict:
    """``python -m pytest -q PATHS`` (the GPU tests of what the rows measure), within ``limit`` s."""
    output, rc, seconds = _run("tests", f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider {paths}",
                               limit, log)
    log.write(output[-20000:])
    lines = [line for line in output.splitlines() if line.strip()]
    return {"rc": rc, "summary": lines[-1] if lines else "", "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="comma list of row names (MODE[-MODIFIER...], see MODIFIERS); "
                                                "+prof to profile, dummy:NAME for main.py --dummy with the same flags")
    p.add_argument("--out", default="/tmp/step_matrix", help="the log and profiles")
    p.add_argument("--work", default="/tmp/step_matrix_work", help="run folders and row JSONs")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--tests", help="test files to run with pytest before the rows (within the budget)")
    p.add_argument("--budget", type=float, default=540, help="seconds for the tests and all rows")
    p.add_argument("--row-timeout", type=float, default=300)
    args = p.parse_args()
    for spec in args.rows.split(","):  # every row's name checked before the first one runs
        check_row(spec)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    start = time.perf_counter()
    results, tests = [], None
    with open(os.path.join(args.out, "step_matrix.log"), "w") as log:
        if args.tests:
            tests = run_tests(args.tests, args.budget, log)
        for spec in args.rows.split(","):
            remaining = args.budget - (time.perf_counter() - start)
            if remaining < 20:
                results.append({"row": spec, "rc": "no time left"})
                continue
            results.append(run_row(spec, args, remaining, log))
    json.dump(results, open(os.path.join(args.out, "step_matrix.json"), "w"), indent=1)
    ref = next((r["img_per_s"] for r in results if "img_per_s" in r), None)
    if tests is not None:
        print(f"\ntests ({args.tests}): {tests['summary']} (exit {tests['rc']}, {tests['seconds']:.0f} s)")
    print(f"\n{args.arch} {args.image_size} px --channels-last, batch {args.batch} unless the row says; "
          f"{args.windows} windows x {args.steps} steps after {args.warmup} warm-up steps")
    print("| row | img/s (median) | spread | vs first | peak GiB | wall s |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for r in results:
        if "img_per_s" not in r:
            print(f"| {r['row']} | failed: {r.get('rc')} | | | | {r.get('seconds', 0):.0f} |")
            continue
        spread = f"{r['min']:.0f}..{r['max']:.0f}" if r.get("min") else "-"
        peak = f"{r['peak']:.1f}" if r.get("peak") else "-"
        print(f"| {r['row']} | {r['img_per_s']:.0f} | {spread} | {r['img_per_s'] / ref:.3f}x | {peak} | "
              f"{r['seconds']:.0f} |")
    for r in results:
        if "account" in r:
            print(f"\n{r['row']}: {r['step_ms']:.2f} ms per step of {r['batch']} images, device time by kernel class")
            print("| class | ms/step | share |")
            print("| --- | ---: | ---: |")
            for cls, ms, share in r["account"]:
                print(f"| {cls} | {ms:.2f} | {100 * share:.1f}% |")
            for name, ms, calls in r["top"]:
                print(f"    {ms:6.2f} ms  x{calls:<4d} {name}")
    return 0 if all(r.get("rc") == 0 for r in results) and (tests is None or tests["rc"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
