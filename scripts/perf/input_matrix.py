#!/usr/bin/env python
"""The typed command from JPEG files, as a matrix of rows, beside the synthetic step, in one call.

    python scripts/perf/input_matrix.py --rows 'synthetic:256;folder:auto:4:256;shards:gpu:2:384'
    python scripts/perf/input_matrix.py --rows 'folder:cpu,gpu:2,4,6:256:eager'

A row is SOURCE:DECODE:WORKERS:BATCH[:MODE[:LAUNCH[:ENV]]] (each field but ENV may list values,
comma-separated; their product is run): SOURCE ``folder`` (the benchmark JPEGs, scripts/perf/make_benchmark_imagefolder.py),
``shards`` (the same folder through scripts/make_shards.py) or ``synthetic`` (``main.py --dummy``,
then SYNTHETIC:BATCH[:MODE]); DECODE ``cpu|gpu|auto``; MODE ``graphs`` (the plain command: speed
defaults, CUDA graphs) or ``eager`` (``--compile off``); LAUNCH ``one`` (``main.py``) or
``ddp2`` (two DDP processes on GPU 0 over gloo, mapped there by SLURM's task variables); ENV
``VAR=VALUE+VAR=VALUE`` for the row's processes. Every
row is ResNet-50 ``--fp16`` (``--model``), ``--epochs`` epochs; its rate is the median of the epochs after the
first (main.py leaves each epoch's first steps out), its share of the synthetic step of the same
batch and mode measured in the same call, and for ``auto`` what auto chose (from the banner).
Rows run in the order given, each printed when done, within ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # there when run as a script, not when a test loads this file by its path
    sys.path.insert(0, HERE)

from verify.common import PY, REPO, last_metrics  # noqa: E402
from verify.data import ensure_shards  # noqa: E402

MODES = {"graphs": "", "eager": " --compile off"}


def parse_rows(spec: str) -> list:
    """Each ``;``-separated row spec expanded into (source, decode, workers, batch, mode, launch)."""
    rows = []
    for row in filter(None, spec.split(";")):
        f = row.split(":")
        if f[0] == "synthetic":
            f = ["synthetic", "-", "0"] + f[1:]
        f += ["graphs", "one", ""][len(f) - 4:] if len(f) < 7 else []
        if len(f) != 7 or not all(f[:6]) or any("=" not in kv for kv in filter(None, f[6].split("+"))):
            raise SystemExit(f"error: row {row!r}: SOURCE:DECODE:WORKERS:BATCH[:MODE[:LAUNCH[:VAR=VALUE+...]]]")
        for combo in itertools.product(*(x.split(",") for x in f[:6])):
            source, decode, workers, batch, mode, launch = combo
            if source not in ("folder", "shards", "synthetic") or mode not in MODES or launch not in ("one", "ddp2") \
                    or decode not in ("cpu", "gpu", "auto", "-"):
                raise SystemExit(f"error: row {row!r}: unknown value in {combo}")
            rows.append((source, decode, int(workers), int(batch), mode, launch, f[6]))
    return rows


def row_name(source, decode, workers, batch, mode, launch, extra="") -> str:
    env = "".join(f"-{kv.split('=', 1)[1]}" for kv in filter(None, extra.split("+")))
    if source == "synthetic":
        return f"synthetic-b{batch}-{mode}{env}"
    return f"{source}-{decode}-j{workers}-b{batch}-{mode}" + ("-ddp2" if launch == "ddp2" else "") + env


def ensure_data(args) -> tuple:
    """The benchmark JPEG folder and its shards, made once (reused by later calls on the machine)."""
    folder, shards = args.data, args.data.rstrip("/") + "-shards"
    if not os.path.isdir(os.path.join(folder, "train")):
        subprocess.run([PY, "scripts/perf/make_benchmark_imagefolder.py", folder, "--classes", "100",
                        "--train-per-class", str(args.per_class), "--val-per-class", "2", "--jobs",
                        str(os.cpu_count())], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return folder, ensure_shards(args, folder, shards, "64MB")


def command(row, args, data: dict, out: str) -> list:
    """(environment, command line) of each process of the row."""
    source, decode, workers, batch, mode, launch, extra = row
    common = f"{args.model} -b {batch} --epochs {args.epochs} -p 1000 --output-dir {out}{MODES[mode]}"
    if source == "synthetic":
        line = f"main.py --dummy --dummy-train-size {data['per_epoch'] // batch * batch} --dummy-val-size {batch} {common}"
    else:
        line = f"main.py {data[source]} {common} -j {workers}" + ("" if decode == "auto" else f" --decode {decode}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               **dict(kv.split("=", 1) for kv in filter(None, extra.split("+"))))
    if launch == "one":
        return [(env, line)]
    port = str(20000 + os.getpid() % 10000)
    return [(dict(env, SLURM_NTASKS="2", SLURM_PROCID=str(r), SLURM_LOCALID=str(r), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=port), f"{line} --dist-backend gloo") for r in range(2)]


def run_row(row, args, data: dict) -> dict:
    name = row_name(*row)
    out = os.path.join(args.out, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    t0 = time.time()
    procs = []
    for rank, (env, line) in enumerate(command(row, args, data, out)):
        with open(os.path.join(args.out, f"{name}.{rank}.log"), "w") as log:
            procs.append(subprocess.Popen(f"timeout {args.timeout} {PY} {line}", shell=True, cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    rc = max(p.wait() for p in procs)
    with open(os.path.join(args.out, f"{name}.0.log")) as fh:
        text = fh.read()
    epochs = last_metrics(out)[1:]
    chose = re.search(r"=> default: JPEGs decoded (on the GPU|in the CPU workers)", text)
    res = {"name": name, "row": row, "rc": rc, "seconds": time.time() - t0, "cmd": command(row, args, data, out)[0][1],
           "chose": {"on the GPU": "gpu", "in the CPU workers": "cpu"}[chose.group(1)] if chose else "",
           "rates": [e["img_per_s"] for e in epochs], "wait": [e.get("data_wait_frac", 0.0) for e in epochs]}
    if rc or not epochs:
        res["tail"] = text[-1500:]
    return res


def cell(res: dict, synthetic: dict) -> str:
    source, decode, workers, batch, mode, launch, extra = res["row"]
    if not res["rates"]:
        return f"| {res['name']} | FAILED (exit {res['rc']}) | | | | | {res['seconds']:.0f} |"
    med = statistics.median(res["rates"])
    step = synthetic.get((batch, mode))
    share = f"{med / step:.3f}" if step and source != "synthetic" else ""
    return (f"| {res['name']} | {med:.0f} | {min(res['rates']):.0f}..{max(res['rates']):.0f} | "
            f"{statistics.median(res['wait']):.3f} | {share} | {res['chose']} | {res['seconds']:.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="rows, ';'-separated (see above)")
    p.add_argument("--data", default="/tmp/bench_jpeg_matrix", help="the benchmark JPEG folder (made if missing)")
    p.add_argument("--per-class", type=int, default=128, help="training JPEGs a class (100 classes)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--model", default="-a resnet50 --fp16", help="the flags every row shares besides -b and -j")
    p.add_argument("--timeout", type=int, default=150, help="seconds one row may take")
    p.add_argument("--budget", type=float, default=520, help="seconds for the whole matrix")
    p.add_argument("--out", default="/tmp/input_matrix")
    p.add_argument("--table", help="also write the table to this file")
    args = p.parse_args()
    rows = parse_rows(args.rows)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    folder, shards = ensure_data(args)
    data = {"folder": folder, "shards": shards, "per_epoch": 100 * args.per_class}
    print(f"data ready in {time.time() - t0:.0f} s: {folder} ({data['per_epoch']} training JPEGs), {shards}",
          flush=True)
    head = ("| row | img/s (median) | spread | data wait | of the synthetic step | auto chose | wall s |\n"
            "| --- | ---: | --- | ---: | ---: | --- | ---: |")
    print(head, flush=True)
    results, synthetic = [], {}
    for row in rows:
        if time.time() - t0 > args.budget:
            print(f"| {row_name(*row)} | not run (--budget) | | | | | |", flush=True)
            continue
        res = run_row(row, args, data)
        if row[0] == "synthetic" and res["rates"] and not row[6]:
            synthetic[(row[3], row[4])] = statistics.median(res["rates"])
        results.append(res)
        print(cell(res, synthetic), flush=True)
        if "tail" in res:
            print("    " + res["tail"][-600:].replace("\n", "\n    "), flush=True)
    lines = [head] + [cell(r, synthetic) for r in results]
    print("\nthe table again, every share against the synthetic step of this call:\n" + "\n".join(lines))
    print("\ncommands (OUT is each row's folder):")
    for r in results:
        print(f"- {r['name']}: python {r['cmd'].replace(os.path.join(args.out, r['name']), 'OUT')}")
    if args.table:
        with open(args.table, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    print(f"\nmatrix: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
