"""The input path's table from one call: ResNet-50 end to end from the benchmark JPEGs with CPU
decode and with --decode gpu (a row per GPU JPEG decoder) at several worker counts, eager and
under CUDA graphs, beside the synthetic step; where a GPU-decode batch's time went, each GPU
JPEG decoder alone (scripts/perf/jpeg_decoders.py), and what --decode auto chooses here."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from .common import (G0, PY, REPO, JpegEngines, epoch_rates, fail, last_metrics, print_commands, run_one, tail,
                     visible_gpus)
from .data import decode_subset

DECODE_MODES = {"eager": " --compile off", "cuda-graphs": ""}  # cuda-graphs: the plain command (speed defaults)


def _median_stages(rows: list) -> dict:
    """Each stage's median over the epochs' input_stages (ms a batch), in the account's order."""
    accounts = [r["input_stages"] for r in rows if r.get("input_stages")]
    if not accounts:
        return {}
    keys = [k for k in accounts[0] if k not in ("batches", "decode_share")]  # milliseconds a batch only
    return {k: statistics.median(a.get(k, 0.0) for a in accounts) for k in keys}


def _decode_auto(workers: list) -> str:
    """What --decode auto chooses on this machine for one GPU at each -j (imagenet.data.gpu.choice)."""
    code = ("import sys; sys.path.insert(0, '.'); import torch; "
            "from imagenet.base.config import Config; "
            "from imagenet.data.gpu.choice import choose, gpu_decoder_available; "
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
    from imagenet.data.gpu.jpeg import BACKENDS
    jpegs = [j for j in spec.split(",") if j] or list(BACKENDS)
    if set(jpegs) - set(BACKENDS):
        fail(f"--decode-jpeg: {spec!r}; give GPU JPEG decoders of the trainer, comma-separated, of {','.join(BACKENDS)}")
    return jpegs


def decode_runs(args, plan: dict) -> list:
    """The rows in order of importance, (name, mode, decode, workers, command): per mode the
    synthetic step, then each GPU decoder (with the --old tree's row right after the first's),
    then CPU decode, each at every --decode-workers."""
    runs = []
    for mode in plan["modes"]:
        flags = DECODE_MODES[mode]
        runs.append((f"synthetic-{mode}", mode, "synthetic", 0,
                     f"{PY} main.py --dummy --dummy-train-size {plan['per_epoch']} "
                     f"--dummy-val-size {args.decode_batch} {plan['common']}{flags}"))
        for decode in [f"gpu:{j}" for j in plan["jpegs"]] + ["cpu"]:
            for w in plan["workers"]:
                cmd = f"{PY} main.py {plan['data']} {plan['common']}{flags} --decode {decode.split(':')[0]} -j {w}"
                runs.append((f"{decode.replace(':', '-')}-j{w}-{mode}", mode, decode, w, cmd))
                if plan["old"] and decode == f"gpu:{plan['jpegs'][0]}":  # the same command from the older tree
                    runs.append((f"old-gpu-j{w}-{mode}", mode, "old-gpu", w,
                                 f"{PY} main.py {plan['data']} {plan['common']}{flags} --decode gpu -j {w}"))
    return runs


def phase_decode(args) -> None:
    """ResNet-50 --fp16 --channels-last -b --decode-batch from the benchmark JPEGs cut to
    --decode-per-class a class: CPU decode and --decode gpu (a row per --decode-jpeg decoder) at
    each --decode-workers, in each --decode-modes (eager: --compile off; cuda-graphs: the plain
    command), beside main.py --dummy's step in the same mode. A rate is the median of the epochs
    after the first (--decode-epochs), with the GPU's idle share and the share of the synthetic
    step. --old DIR runs the first decoder's rows again from an older tree, each right after this
    one's; --decode-tests runs those tests first. Rows run in order of importance within
    --decode-budget seconds (tests included), each under --decode-timeout; a row that would start
    past the budget is reported as not run."""
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
    tested = None
    if args.decode_tests:
        tested = run_one("decode-tests", f"{PY} -m pytest -q -p no:cacheprovider {args.decode_tests}", G0, args)
        print(tail(os.path.join(args.out, "decode-tests", "log.txt"), 3), flush=True)
    data = decode_subset(args)
    workers = [int(w) for w in args.decode_workers.split(",")]
    batch, epochs = args.decode_batch, args.decode_epochs
    classes = len(os.listdir(os.path.join(data, "train")))
    plan = {"modes": modes, "jpegs": jpegs, "workers": workers, "data": data, "old": old,
            "common": f"-a resnet50 -b {batch} --fp16 --channels-last --epochs {epochs} -p 1000 --output-dir OUT",
            "per_epoch": classes * args.decode_per_class // batch * batch}
    runs = decode_runs(args, plan)
    auto = _decode_auto(workers)
    decoders = _decoder_table(data, batch)
    results, engines = [], {}
    for name, mode, decode, w, cmd in runs:
        left = args.decode_budget - (time.time() - t0)
        if left < 45:
            results.append((name, mode, decode, w, None))
            continue
        here = f"cd {old} && " if decode.startswith("old-") else ""  # the older tree's rows run there
        env = dict(G0, IMAGENET_GPU_JPEG=decode.split(":")[1]) if decode.startswith("gpu:") else G0
        with JpegEngines("gpu" in decode) as watched:
            res = run_one(name, f"{here}timeout {int(min(left, args.decode_timeout))} {cmd}", env, args)
        if watched.use is not None:
            engines[name] = watched.use
        results.append((name, mode, decode, w, res))
    _report(args, plan, results, engines)
    print("\nEach GPU JPEG decoder alone and beside a training loop (scripts/perf/jpeg_decoders.py):\n" + decoders)
    print("\n--decode auto here, one GPU:\n" + auto)
    if tested is not None:
        print(f"\ntests ({args.decode_tests}): exit {tested['rc']}, "
              f"{tail(os.path.join(args.out, 'decode-tests', 'log.txt'), 1).strip()}")
    print(f"\nphase: {time.time() - t0:.0f} s")
    print_commands(([tested] if tested else []) + [res for *_, res in results if res is not None])


def _report(args, plan: dict, results: list, engines: dict) -> None:
    """The rate table (a column group per mode), the GPU rows' per-stage account, the input-bound
    lines and the hardware JPEG engines' use."""
    modes, old = plan["modes"], plan["old"]
    synthetic, rows = {}, {}  # rows: (decode, workers, mode) -> (rates, stages, decoded on GPU, fallbacks, result)
    for name, mode, decode, w, res in results:
        out = os.path.join(args.out, name)
        measured = last_metrics(out)[1:] if res is not None else []
        rates = epoch_rates(out, 1) if res is not None else None
        if decode == "synthetic":
            synthetic[mode] = rates[0] if rates else None
            continue
        rows[(decode, w, mode)] = (rates, _median_stages(measured), sum(r.get("decoded_on_gpu", 0) for r in measured),
                                   sum(r.get("decode_fallbacks", 0) for r in measured), res)
    print(f"\nResNet-50 --fp16 --channels-last -b {args.decode_batch}, {plan['per_epoch']} training JPEGs an epoch "
          f"({plan['data']}), {args.decode_epochs} epochs, the first left out; img/s the median of the others (spread), "
          "'idle' the GPU's share waiting for input, '%' of the synthetic step in the same mode:")
    head = " | ".join(f"{m}: img/s | spread | idle | %" for m in modes)
    print(f"\n| input | workers | {head} |\n| --- | ---: |" + " ---: | --- | ---: | ---: |" * len(modes))
    print("| synthetic step (main.py --dummy) | | " + " | ".join(
        f"{synthetic[m]:.0f} | | | 100" if synthetic.get(m) else "not run | | |" for m in modes) + " |")
    for decode in ["cpu"] + [f"gpu:{j}" for j in plan["jpegs"]] + (["old-gpu"] if old else []):
        for w in plan["workers"]:
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
