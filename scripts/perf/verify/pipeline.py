"""The input pipelines from ImageNet-shaped JPEGs: the loader alone and training end to end.

jpeg: bench.py data's pipelines side by side, then --e2e-rows training runs (CPU or GPU decode,
a precision, optionally compiled). e2e: one table of the model step on synthetic data, the
loader alone and ResNet-50 trained from the JPEGs with each decode, eager and under CUDA graphs,
each end-to-end rate also as a share of the synthetic step in the same mode."""

from __future__ import annotations

import json
import os

from .common import G0, PY, JpegEngines, epoch_rates, fail, last_metrics, print_commands, run_one, tail
from .data import JPEG_DIR, ensure_jpeg

E2E_MODES = {"eager": "off", "cuda-graphs": "reduce-overhead"}  # the step mode: its --compile
# The end-to-end rows from the JPEGs, (name, main.py flags); {variant}: each --e2e-cpu-variants
# set of flags, its rows named with a -TAG of it
E2E_GPU_ROWS = (("jpeg-gpu-decode-eager", "--decode gpu"),
                ("jpeg-gpu-decode-cuda-graphs", "--decode gpu --compile reduce-overhead"))
E2E_CPU_ROWS = (("jpeg-cpu-decode-eager", "--decode cpu {variant}"),
                ("jpeg-cpu-decode-cuda-graphs", "--decode cpu --compile reduce-overhead {variant}"))
E2E_CLASSIC_ROWS = (("jpeg-trainer-classic-eager", "--data-pipeline classic"),)


def phase_jpeg(args) -> None:
    """Input pipelines on ImageNet-shaped JPEGs: loader throughput (classic / fast CPU decode /
    GPU decode) and end-to-end ResNet-50 training epochs with CPU and with GPU decode."""
    data = JPEG_DIR  # made below, once the rows are known to be valid
    w = args.workers
    runs = [] if args.skip_data else [
        ("data-pipelines", f"{PY} scripts/perf/bench.py data {data} --workers {w} --batch-size 256 "
                           f"--windows {args.data_windows} --pipelines {args.data_pipelines} {args.data_args}".rstrip(), G0)]
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
            runs.append((f"e2e-{row.replace(':', '-')}", cmd, G0))
    ensure_jpeg(args)
    results = []
    for name, cmd, env in runs:
        results.append(run_one(name, cmd, env, args))
        print(tail(os.path.join(args.out, name, "log.txt"), 8), flush=True)
    print("\n| run | train img/s per epoch | median | decoded on GPU | CPU fallbacks | the workers' share |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        if r["name"] == "data-pipelines":
            continue
        rows = last_metrics(os.path.join(args.out, r["name"]))
        rates = ", ".join(f"{x['img_per_s']:.0f}" for x in rows)
        gpu = sum(x.get("decoded_on_gpu", 0) for x in rows)
        cpu = sum(x.get("decode_fallbacks", 0) for x in rows)
        share = sum(x.get("decoded_by_workers", 0) for x in rows)
        print(f"| {r['name']} | {rates or 'FAILED'} | {r['img_per_s'] or 0:.0f} | {gpu} | {cpu} | {share} |")
    print_commands(results)


def _variant_tag(flags: str) -> str:
    """A row-name suffix for a set of flags: '--worker-nice 10' -> '-worker-nice-10'."""
    tag = "".join(c if c.isalnum() else "-" for c in flags).strip("-")
    return f"-{'-'.join(filter(None, tag.split('-')))}" if tag else ""


def e2e_runs(args, modes: list) -> list:
    """The e2e phase's runs, (name, kind, command), kind bench|main|loader, in --parts' order."""
    parts = args.parts.split(",")
    w = args.workers
    model = "-a resnet50 -b 256 --fp16 --channels-last"
    bench = f"scripts/perf/bench.py train --arch resnet50 --batch-size 256 --precision fp16 --channels-last " \
            f"--steps {args.bench_steps} --windows 5 --json OUT/rows.json"
    dummy = (f"main.py --dummy {model} --epochs 3 --dummy-train-size {256 * 60} --dummy-val-size 2560 -p 100 "
             "--output-dir OUT")
    timeout = f"timeout {args.e2e_timeout} {PY}"
    runs = []
    for label, mode in E2E_MODES.items():
        if label not in modes:
            continue
        if "synthetic" in parts:
            runs.append((f"synthetic-bench-{label}", "bench", f"{timeout} {bench} --compile {mode}"))
        if "dummy" in parts:
            runs.append((f"synthetic-main-{label}", "main", f"{timeout} {dummy} --compile {mode}"))
    if "loader" in parts:
        runs.append(("loader-alone", "loader", f"{timeout} scripts/perf/bench.py data {JPEG_DIR} "
                                               f"--workers {w} --batch-size 256 --windows {args.data_windows} "
                                               "--pipelines classic,fast,fast-worker-resize,gpu"))
    if "jpeg" in parts:
        e2e = f"main.py {JPEG_DIR} {model} -j {w} --epochs {args.e2e_epochs} -p 50 --output-dir OUT"
        variants = [v.strip() for v in args.e2e_cpu_variants.split("|")] if args.e2e_cpu_variants else [""]
        jpeg_rows = list(E2E_GPU_ROWS)
        for v in variants:  # the CPU-decode rows once per variant, e.g. --worker-nice 10
            jpeg_rows += [(name + _variant_tag(v), flags.format(variant=v)) for name, flags in E2E_CPU_ROWS]
        jpeg_rows += E2E_CLASSIC_ROWS
        for rep in range(1, args.e2e_repeat + 1):  # repeats alternate the rows, so drift hits all alike
            for name, extra in jpeg_rows:
                if any(part and part in name for part in args.e2e_skip.split(",")) or \
                        ("cuda-graphs" if "cuda-graphs" in name else "eager") not in modes:
                    continue
                runs.append((name + (f"-r{rep}" if rep > 1 else ""), "main", f"{timeout} {e2e} {extra.strip()}"))
    return runs


def phase_e2e(args) -> None:
    """ResNet-50 --fp16 --channels-last, batch 256, one GPU, side by side in one call (--parts):
    the model step on synthetic data (bench.py train, and main.py --dummy), eager and CUDA
    graphs (--e2e-modes); the loader alone (plain torchvision, the fast CPU decode with the
    resize on the GPU and in the workers, GPU decode); and training end to end from the JPEG
    folder with GPU decode and CPU decode (eager, CUDA graphs) and the trainer's classic
    pipeline. Every rate is a median over windows (bench.py) or epochs after the first
    (main.py), with the spread; main.py's epochs leave out their first 10 steps."""
    modes = args.e2e_modes.split(",")
    if set(modes) - set(E2E_MODES):
        fail(f"--e2e-modes: {args.e2e_modes!r}; choose from eager,cuda-graphs")
    runs = e2e_runs(args, modes)
    if {"loader", "jpeg"} & set(args.parts.split(",")):
        ensure_jpeg(args)
    rows, results = [], []
    engines = []  # nvidia-smi's hardware JPEG decoder utilisation while each GPU-decode row ran
    for name, kind, cmd in runs:
        with JpegEngines(kind == "loader" or "gpu-decode" in name) as watched:
            res = run_one(name, cmd, G0, args)
        if watched.use is not None:
            engines.append((name, watched.use))
        results.append(res)
        before = len(rows)
        out = os.path.join(args.out, name)
        print(tail(os.path.join(out, "log.txt"), 3), flush=True)
        if kind == "bench" and os.path.exists(os.path.join(out, "rows.json")):
            r = json.load(open(os.path.join(out, "rows.json")))[0]
            rows.append((name, f"{r['img_per_s']:.0f}", f"{r['min']:.0f}..{r['max']:.0f}", "", res))
        elif kind == "main" and epoch_rates(out, 1):
            med, lo, hi, wait = epoch_rates(out, 1)
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
