#!/usr/bin/env python
"""The typed command with and without nvidia-cudnn-frontend, side by side in one call.

    python scripts/perf/frontend_ab.py --wheels DIR [--by-hand WHEEL] [--out DIR]

What pip installs from requirements.txt here (resolved from the wheels in DIR alone, as on a
machine without network: the other requirements must be installed already) goes into a folder
of its own; ``--by-hand`` is a wheel of the package installed alone (``--no-deps``), e.g. a newer
version than requirements.txt allows. Then ``main.py --dummy -a resnet50 -b 256 --fp16`` runs
without the package, with the requirements' install and with the one by hand (each put on
PYTHONPATH in turn), the three one after another, twice: the first round fills the compile
caches (both paths compile), the second is the comparison. A row's rate is the median of its
epochs after the first; the table gives each against the row without the package, and each
run's banner line on the BatchNorm (which statistics it took, and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sh(cmd: str, env: dict, log: str) -> int:
    """``cmd`` in the repository with ``env`` over a copy of this environment (less its PYTHONPATH:
    a row has the package on its path only where ``env`` puts it), its output in ``log``."""
    print(f"$ {cmd}", flush=True)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log, "w") as fh:
        return subprocess.run(cmd, shell=True, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                              env=dict(base, PYTHONUNBUFFERED="1", **env)).returncode


def install(args) -> dict:
    """{row: folder to put on PYTHONPATH} for the rows with the package; prints what pip resolved."""
    pip = f"{shlex.quote(sys.executable)} -m pip install -q --no-index --find-links {shlex.quote(args.wheels)}"
    report = os.path.join(args.out, "requirements-report.json")
    subprocess.run(f"{pip} --dry-run --report {report} -r requirements.txt", shell=True, cwd=REPO, check=True)
    chosen = [f"{i['metadata']['name']} {i['metadata']['version']}" for i in json.load(open(report))["install"]]
    print(f"pip install -r requirements.txt would install here: {', '.join(chosen) or 'nothing'}", flush=True)
    folders = {"requirements": os.path.join(args.out, "site-requirements")}
    line = next(x for x in open(os.path.join(REPO, "requirements.txt")) if x.startswith("nvidia-cudnn-frontend"))
    subprocess.run(f"{pip} --no-deps --target {folders['requirements']} {shlex.quote(line.strip())}", shell=True,
                   cwd=REPO, check=True)
    if args.by_hand:
        folders["by-hand"] = os.path.join(args.out, "site-by-hand")
        subprocess.run(f"{pip} --no-deps --target {folders['by-hand']} {shlex.quote(args.by_hand)}", shell=True,
                       cwd=REPO, check=True)
    return folders


def rate(out: str) -> tuple:
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][1:] if os.path.exists(
        os.path.join(out, "metrics.jsonl")) else []
    rates = sorted(r["img_per_s"] for r in rows)
    return (statistics.median(rates), rates[0], rates[-1]) if rates else None


def bn_line(log: str) -> str:
    lines = [x.strip() for x in open(log, errors="replace") if "BatchNorm" in x and x.startswith("=> ")]
    return lines[0] if lines else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", required=True, help="a folder of wheels: the package's, and any of its dependencies")
    p.add_argument("--by-hand", help="a wheel of the package to install alone (--no-deps) for a third row")
    p.add_argument("--out", default="/tmp/frontend_ab")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    args.wheels = os.path.abspath(args.wheels)
    os.makedirs(args.out, exist_ok=True)
    folders = install(args)
    rows = ["without", *folders]
    caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(args.out, "inductor"),
              "TRITON_CACHE_DIR": os.path.join(args.out, "triton"), "CUDA_VISIBLE_DEVICES": "0"}
    results = {}
    t0 = time.time()
    for round_ in (1, 2):
        for row in rows:
            out = os.path.join(args.out, f"{row}-{round_}")
            env = dict(caches, PYTHONPATH=folders[row]) if row in folders else dict(caches)
            cmd = (f"{shlex.quote(sys.executable)} main.py --dummy -a resnet50 -b 256 --fp16 --epochs {args.epochs} "
                   f"--dummy-train-size {256 * args.steps} --dummy-val-size 1024 -p 1000 -j 0 --output-dir {out}")
            rc = sh(cmd, env, os.path.join(args.out, f"{row}-{round_}.log"))
            results[(row, round_)] = (rc, rate(out), bn_line(os.path.join(args.out, f"{row}-{round_}.log")),
                                      " ".join([*(f"{k}={v}" for k, v in env.items()), cmd]))
            print(f"  {row} round {round_}: exit {rc}, {results[(row, round_)][1]} ({time.time() - t0:.0f} s)",
                  flush=True)
    base = results[("without", 2)][1]
    print("\n| package | round | img/s (median epoch) | spread | vs without |\n| --- | ---: | ---: | --- | ---: |")
    for (row, round_), (rc, r, _, _) in results.items():
        if r is None:
            print(f"| {row} | {round_} | FAILED (exit {rc}) | | |")
            continue
        vs = f"{r[0] / base[0]:.3f}" if base and round_ == 2 else ""
        print(f"| {row} | {round_} | {r[0]:.0f} | {r[1]:.0f}..{r[2]:.0f} | {vs} |")
    print("\nthe banner's BatchNorm line of each row:")
    for row in rows:
        print(f"- {row}: {results[(row, 2)][2]}")
    print("\ncommands:")
    for (row, round_), (*_, cmd) in results.items():
        print(f"- {row}, round {round_}: `{cmd}`")
    return 0 if all(rc == 0 for rc, *_ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
