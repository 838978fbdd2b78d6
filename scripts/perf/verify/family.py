"""The ResNet family as a user types it (family): ``main.py --dummy -a ARCH -b 256 --fp16`` per
architecture, beside the eager fp16 trainer (no compile, contiguous tensors, torch's BatchNorm
and max-pool) and fp32 as typed, in one call, with the banner's choices of each typed run.

Compilation is what costs a call: every compiled row is first compiled side by side with
others (a precompile group: one epoch of a few steps, the rows packed by their estimated GPU
memory under --family-gib), which fills Inductor's and Triton's caches; then every row runs
alone, from those caches, timed. A row whose precompile failed (memory) compiles when timed.
Rows not started within --family-budget are reported as not run, so one call never runs past
its limit; the archs run in order, each arch's rows together."""

from __future__ import annotations

import os
import shutil
import sys
import time

from .common import PY, REPO, epoch_rates, fail, first_step, print_commands, run_group, run_one

ARCHS = ("resnet18", "resnet34", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2")
ROWS = {  # name: the flags after -a ARCH -b 256; compiled: whether its first steps compile
    "typed": "--fp16",
    "eager": "--fp16 --compile off --no-channels-last --bn-kernel torch --maxpool-kernel torch",
    "fp32": "",
}
COMPILED = ("typed", "fp32")
# Peak GiB at -b 256, compiled, estimated from ResNet-50's (11 GiB in --fp16, 27 in fp32) by each
# architecture's activations; only the precompile groups' packing reads them.
GIB_FP16 = {"resnet18": 5, "resnet34": 7, "resnet50": 11, "resnet101": 18, "resnet152": 25,
            "resnext50_32x4d": 17, "wide_resnet50_2": 18}
BANNER = ("=> kernels:", "=> default:", "=> note:", "=> warning:")


def estimate_gib(arch: str, row: str) -> float:
    """The GPU memory a compiled row is packed by (unknown archs as the largest)."""
    fp16 = GIB_FP16.get(arch, max(GIB_FP16.values()))
    return fp16 * (2.5 if row == "fp32" else 1.0) + 2  # + the context and the CUDA graphs' pools


def command(arch: str, row: str, epochs: int, steps: int) -> str:
    """The row's main.py command line (OUT: its run folder)."""
    return (f"{PY} main.py --dummy -a {arch} -b 256 {ROWS[row]} --epochs {epochs} --dummy-train-size {256 * steps} "
            f"--dummy-val-size 256 -p 1000 -j 0 --output-dir OUT").replace("  ", " ")


def pack(rows: list, gib: float) -> list:
    """``rows`` ((arch, row) pairs) in groups whose estimated memory adds up to at most ``gib``
    (a row larger than that alone), largest first, so a group's compilations end together."""
    groups: list = []
    for arch, row in sorted(rows, key=lambda r: -estimate_gib(*r)):
        need = estimate_gib(arch, row)
        for group in groups:
            if sum(estimate_gib(*r) for r in group) + need <= gib:
                group.append((arch, row))
                break
        else:
            groups.append([(arch, row)])
    return groups


def banner(log: str) -> list:
    """The run's banner lines that say what it chose (kernels, defaults, notes), in order, once each."""
    seen = []
    try:
        for line in open(log, errors="replace"):
            line = line.strip()
            if line.startswith(BANNER) and line not in seen:
                seen.append(line)
    except OSError:
        pass
    return seen


def parse(args) -> tuple:
    archs = [a for a in args.family_archs.split(",") if a]
    rows = [r for r in args.family_rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        fail(f"--family-rows: unknown {unknown}; choose from {','.join(ROWS)}")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from imagenet.base.config import ARCHS as KNOWN  # no torch: a typo fails at once
    if not archs or set(archs) - set(KNOWN):
        fail(f"--family-archs: unknown {sorted(set(archs) - set(KNOWN))}; choose from {','.join(KNOWN)}")
    if args.family_steps < 10:
        fail("--family-steps: at least 10 (each epoch leaves its first steps out of its rate)")
    return archs, rows


def phase_family(args) -> None:
    """Each of --family-archs as typed in --fp16, eager --fp16 and fp32 (--family-rows), timed alone
    from filled compile caches; a table (img/s, the typed row against eager and fp32, the first
    step's wait from the caches), then each typed run's banner choices and every command."""
    archs, rows = parse(args)
    t0 = time.time()
    caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(args.out, "cache", "inductor"),
              "TRITON_CACHE_DIR": os.path.join(args.out, "cache", "triton"), "CUDA_VISIBLE_DEVICES": "0"}
    if not args.family_warm:  # a fresh machine's caches are empty: so are ours
        shutil.rmtree(os.path.join(args.out, "cache"), ignore_errors=True)
    compiled = [(a, r) for a in archs for r in rows if r in COMPILED]
    precompiled = {}
    for group in pack(compiled, args.family_gib):
        if time.time() - t0 > args.family_budget / 2:  # the timed rows need the rest
            break
        results = run_group([{"name": f"compile-{a}-{r}", "cmd": command(a, r, 1, 3), "env": caches}
                             for a, r in group], args)
        precompiled.update({(a, r): res for (a, r), res in zip(group, results)})
    print(f"  (compilations done at {time.time() - t0:.0f} s)", flush=True)
    timed = {}
    for arch in archs:
        for row in rows:
            if time.time() - t0 > args.family_budget:
                timed[(arch, row)] = None
                continue
            name = f"{arch}-{row}"
            res = run_one(name, command(arch, row, args.family_epochs, args.family_steps), caches, args)
            rates = epoch_rates(os.path.join(args.out, name), 1 if args.family_epochs > 1 else 0)
            log = os.path.join(args.out, name, "log.txt")
            timed[(arch, row)] = {"res": res, "rate": rates[0] if rates else None,
                                  "spread": f"{rates[1]:.0f}..{rates[2]:.0f}" if rates else "",
                                  "first": first_step(log), "banner": banner(log)}
            print(f"  {name}: {rates[0] if rates else 'FAILED'} img/s ({time.time() - t0:.0f} s)", flush=True)
    report(archs, rows, timed, precompiled)


def _rate(cell) -> str:
    if cell is None:
        return "not run (--family-budget)"
    return f"{cell['rate']:.0f}" if cell["rate"] else f"FAILED (exit {cell['res']['rc']})"


def report(archs: list, rows: list, timed: dict, precompiled: dict) -> None:
    """The table, the typed runs' banner lines, the commands."""
    print(f"\n| arch | {' | '.join(f'{r} img/s' for r in rows)} | typed / eager | typed / fp32 | "
          "first step from the caches (s) |")
    print("| --- |" + " ---: |" * (len(rows) + 3))
    for arch in archs:
        cells = [timed.get((arch, r)) for r in rows]
        rate = {r: (c["rate"] if c else None) for r, c in zip(rows, cells)}
        ratio = [f"{rate['typed'] / rate[other]:.3f}" if rate.get("typed") and rate.get(other) else ""
                 for other in ("eager", "fp32")]
        typed = timed.get((arch, "typed"))
        wait = typed["first"] if typed and typed["first"] is not None else ""
        print(f"| {arch} | {' | '.join(_rate(c) for c in cells)} | {ratio[0]} | {ratio[1]} | {wait} |")
    for arch in archs:
        typed = timed.get((arch, "typed"))
        if typed:
            print(f"\n{arch}, as typed (`-b 256 --fp16`):")
            print("\n".join(f"    {line}" for line in typed["banner"]) or "    (no banner: see its log)")
    failed = [f"{a}-{r}" for (a, r), res in precompiled.items() if res["rc"]]
    if failed:
        print(f"\nprecompiles that failed (those rows compiled when timed): {', '.join(failed)}")
    print_commands([c["res"] for c in timed.values() if c] + list(precompiled.values()))
