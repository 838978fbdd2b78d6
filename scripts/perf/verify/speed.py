"""The training step's throughput: ResNet-50 per precision, layout and parallel mode through
scripts/perf/bench.py (bench), weak scaling over 1 to 8 GPUs with a parity check (scaling), and
main.py --dummy as a user types it, this tree against an older one, with the first step's wait
cold and warm (defaults)."""

from __future__ import annotations

import json
import os
import shutil
import time

from .common import (G0, PY, REPO, TWO, epoch_rates, fail, first_step, print_commands, recipe_cmd, run_group,
                     run_one, table, tail, visible_gpus)
from .data import ensure_fashion, ensure_jpeg

BENCH_GROUPS = ("matrix", "ab", "foreach", "profile", "dp", "dp-profile", "ddp", "ddp-nccl", "weak", "small",
                "compile")
DEFAULTS_ROWS = {  # name: (tree, launcher, flags); tree "old": the --old tree
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


def bench_plan(args) -> dict:
    """Each --groups group's rows: (name, command, environment)."""
    common = f"scripts/perf/bench.py train --arch resnet50 --batch-size 256 --steps {args.bench_steps} --windows 5"
    common512 = common.replace("--batch-size 256", "--batch-size 512")  # 256 per GPU on two
    one_window = common.replace("--windows 5", "--windows 1")
    short = "scripts/perf/bench.py train --arch resnet50 --batch-size 256 --warmup 3 --steps 5 --windows 2"
    small = "scripts/perf/bench.py train --arch resnet18 --image-size 28 --batch-size 128 --precision fp32"
    best = f"--precision {args.bench_best} --channels-last"
    ddp = f"{PY} -m multiproc --log-dir OUT"
    nccl = dict(TWO, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P")
    # amp and fp16 twice, interleaved: a later row on a warmer GPU is not the slower mode
    ab = "--matrix --precisions amp,fp16,amp-bf16,fp16,amp --layouts channels_last"
    return {
        "matrix": [("1gpu-matrix", f"{PY} {common} --matrix", G0)],
        "ab": [("1gpu-ab-fused", f"{PY} {common} {ab} --optimizer-impl fused", G0)],
        "foreach": [("1gpu-ab-foreach", f"{PY} {common} {ab} --optimizer-impl foreach", G0)],
        "profile": [(f"profile-{p}", f"{PY} {one_window} --precision {p} "
                                     f"--channels-last --profile 5 --profile-json OUT/ops.json", G0) for p in ("amp", "fp16")],
        "dp": [("dp2", f"timeout 150 {PY} {common} {best}", TWO),
               # torch's own DataParallel searches cuDNN's algorithms every step (seconds each): few steps
               ("dp2-torch", f"timeout 90 {PY} {short} {best} --dp-impl torch", TWO)],
        "dp-profile": [("dp2-b512", f"timeout 150 {PY} {common512} {best}", TWO),
                       ("profile-dp2", f"timeout 150 {PY} {one_window} {best} --profile 5", TWO)],
        "ddp": [("1gpu-b256", f"{PY} {common} {best}", G0),
                # each rank's share of a global 256 on one GPU: the ideal per-rank rate, strong scaling
                ("1gpu-b128", f"{PY} {common.replace('--batch-size 256', '--batch-size 128')} {best}", G0),
                ("ddp2-b256", f"{ddp} {common} {best}", nccl),
                # weak scaling: 256 per GPU, as MLPerf counts it
                ("ddp2-b512", f"{ddp} {common512} {best}", TWO),
                ("ddp2-b512-view", f"{ddp} {common512} {best} --ddp-bucket-view --ddp-bucket-mb 100", TWO)],
        # where DDP x2's gap to linear scaling goes: NCCL's kernels share the SMs with the backward
        # pass, so fewer channels (thread blocks) may cost less than they save; and a profile of rank 0
        "ddp-nccl": [("1gpu-b256", f"{PY} {common} {best}", G0),
                     ("ddp2-b512", f"{ddp} {common512} {best}", TWO),
                     ("ddp2-b512-nch4", f"{ddp} {common512} {best}", dict(TWO, NCCL_MAX_NCHANNELS="4")),
                     ("ddp2-b512-nch8", f"{ddp} {common512} {best}", dict(TWO, NCCL_MAX_NCHANNELS="8")),
                     ("profile-ddp2", f"{ddp} {common512.replace('--windows 5', '--windows 1')} {best} --profile 5",
                      TWO)],
        # 256 images per GPU, side by side: one GPU, DDP x2 and DataParallel x2
        "weak": [("1gpu-b256", f"{PY} {common} {best}", G0),
                 ("ddp2-b512", f"{ddp} {common512} {best}", TWO),
                 ("dp2-b512", f"timeout 150 {PY} {common512} {best}", TWO)],
        "small": [("small-1gpu", f"{PY} {small} --warmup 5 --steps 10 --windows 3", G0),
                  ("small-dp2", f"timeout 120 {PY} {small} --warmup 5 --steps 10 --windows 3", TWO),
                  ("small-dp2-torch", f"timeout 90 {PY} {small} --warmup 3 --steps 5 --windows 2 --dp-impl torch",
                   TWO)],
        # PRECISION or PRECISION:MODE (torch.compile mode, default "default")
        "compile": [(f"1gpu-compile-{row.replace(':', '-')}",
                     f"timeout 240 {PY} {common} --precision {row.split(':')[0]} --channels-last "
                     f"--compile {(row.split(':') + ['default'])[1]} --warmup 20", G0)
                    for row in (args.compile_rows.split(",") if args.compile_rows else [])],
    }


def phase_bench(args) -> None:
    """ResNet-50 step throughput, in groups (--groups): the 1-GPU precision x layout matrix; amp
    against --fp16 interleaved (ab), with foreach SGD (foreach), under the profiler (profile);
    DataParallel, ours against torch's (dp); DDP strong and weak scaling (ddp); the small
    resnet18 step on 1 GPU and DataParallel (small); --compile rows. Ends with one table."""
    groups = args.groups.split(",")
    unknown = set(groups) - set(BENCH_GROUPS)
    if unknown:
        fail(f"unknown bench group(s) {sorted(unknown)}; choose from {','.join(BENCH_GROUPS)}")
    plan = bench_plan(args)
    summary = []
    for group in groups:
        for name, cmd, env in plan[group]:
            if "scripts/perf/bench.py" in cmd and "--profile" not in cmd:
                cmd += " --json OUT/rows.json"
            res = run_one(name, cmd, env, args)
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
    per_step = lambda d: {o["name"]: (o["self_device_us"] / d["steps"], o["calls"] / d["steps"]) for o in d["ops"]}  # noqa: E731
    pa, pb = per_step(a), per_step(b)
    print(f"\nprofile, {a['precision']} vs {b['precision']}: the ops (and kernels) whose device time differs most")
    diffs = sorted(set(pa) | set(pb), key=lambda k: -abs(pb.get(k, (0, 0))[0] - pa.get(k, (0, 0))[0]))
    print(f"| op | {a['precision']} us/step | calls | {b['precision']} us/step | calls | difference us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k in diffs[:rows]:
        (ta, ca), (tb, cb) = pa.get(k, (0, 0)), pb.get(k, (0, 0))
        print(f"| {k[:70]} | {ta:.0f} | {ca:.0f} | {tb:.0f} | {cb:.0f} | {tb - ta:+.0f} |")


def phase_scaling(args) -> None:
    """Weak scaling of ResNet-50 over 1, 2, 4, 8 GPUs (as many as are visible): DDP through
    multiproc at 256 images per GPU, DataParallel for comparison, the GPU-decode JPEG pipeline
    on all GPUs, and the parity check (fp16 DDP on all GPUs vs fp32 on one)."""
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
            run_one(name, cmd, env, args)
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
        run_one(f"jpeg-gpu-decode-ddp{n_gpus}",
                f"{PY} -m multiproc --log-dir OUT main.py {jpeg} -a resnet50 -b {256 * n_gpus} --amp "
                f"--channels-last --decode gpu -j {max(2, args.workers // n_gpus)} --epochs 1 --prof 20 "
                f"-p 5 --output-dir OUT", everything, args)
        print(tail(os.path.join(args.out, f"jpeg-gpu-decode-ddp{n_gpus}", "log.txt"), 4), flush=True)
        data = ensure_fashion(args)
        results = [run_one("1-fp32", f"{PY} {recipe_cmd(args, data)}", G0, args),
                   run_one(f"fp16-ddp{n_gpus}", f"{PY} -m multiproc --log-dir OUT {recipe_cmd(args, data)} --fp16 "
                                                f"--dist-backend nccl", everything, args)]
        table(results, "1-fp32")


def phase_defaults(args) -> None:
    """ResNet-50 main.py --dummy as a user types it, this tree against --old (an older commit's
    tree, e.g. `git archive` of it) side by side; the first step's wait with empty caches
    (cold, each of the two starts from empty ones) and again with the caches a run left (warm),
    one process and under multiproc.
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
    def empty_caches() -> None:  # cold means cold: nothing from an earlier call or run
        for env in caches.values():
            for d in env.values():
                shutil.rmtree(d, ignore_errors=True)

    if stage != "time":
        empty_caches()
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
                if label == "cold":  # each cold start alone: multiproc's must not read the first's graphs
                    empty_caches()
                res = run_one(f"{label}-{name}", *cmd_of(name, 1, 30), args)
                waits.append((label, name, first_step(os.path.join(args.out, f"{label}-{name}", "log.txt")), res))
                wait = waits[-1][2]  # printed now: kept if the call ends early
                print(f"  {label}-{name}: " + (f"first step done after {wait} s" if wait is not None else "no first step"),
                      flush=True)
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
        res = run_one(name, *cmd_of(name, args.defaults_epochs, args.defaults_steps), args)
        rates = epoch_rates(os.path.join(args.out, name), 1)
        table_rows.append((name, f"{rates[0]:.0f}" if rates else f"FAILED (exit {res['rc']})",
                           f"{rates[1]:.0f}..{rates[2]:.0f}" if rates else "", res))
        print(f"  {name}: " + (f"{table_rows[-1][1]} img/s ({table_rows[-1][2]})" if rates else table_rows[-1][1])
              + f" at {time.time() - t0:.0f} s", flush=True)
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
