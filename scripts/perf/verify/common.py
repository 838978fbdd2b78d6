"""Running a phase's commands and reporting them: start runs side by side, wait, read each run's
metrics.jsonl, print the accuracy table and every command line as it ran (so that the log can
cite it), and watch the GPU's hardware JPEG decoders while a run goes."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PY = sys.executable
G0, G1, TWO = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0,1"}


def sh(cmd: str, log: str, env_extra: dict | None = None, wait: bool = True):
    """``cmd`` through the shell in the repository, its output in ``log``; NCCL's NVLink multicast off."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", **(env_extra or {}))
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, shell=True, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if wait:
        proc.wait()
    return proc


def last_metrics(out_dir: str) -> list:
    """The run's rows: metrics.jsonl, or a --prof run's prof.jsonl."""
    for name in ("metrics.jsonl", "prof.jsonl"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            return [json.loads(line) for line in open(path)]
    return []


def tail(path: str, n: int = 6) -> str:
    try:
        return "".join(open(path).readlines()[-n:])
    except OSError:
        return ""


def fail(message: str) -> None:
    """A bad option value or a failed preparation: one line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def command_line(cmd: str, env: dict) -> str:
    """The command as it ran: its environment settings, then the command."""
    return " ".join([*(f"{k}={v}" for k, v in env.items()), cmd])


def print_commands(results: list) -> None:
    print("\ncommands:")
    for r in results:
        print(f"- {r['name']}: `{command_line(r['cmd'], r['env'])}`")


def run_group(runs: list, args) -> list:
    """Start runs concurrently (each a dict: name, cmd, env), at most ``--max-runs`` at a time (0:
    all at once), wait, collect results in the runs' order. Each run's folder starts empty: its
    results (metrics.jsonl, rows.json) are this run's, never an earlier call's in the same --out."""
    limit = getattr(args, "max_runs", 0) or len(runs)
    ends = getattr(args, "ends", None)  # --deadline: when every run is cut where it is
    procs, running, unstarted = [], [], []
    for r in runs:
        while len(running) >= limit and not _past(ends):  # a slot frees when any run ends
            running = [p for p in running if p.poll() is None]
            if len(running) >= limit:
                time.sleep(0.5)
        if _past(ends):
            unstarted.append(r)
            continue
        out = os.path.join(args.out, r["name"])
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        cmd = r["cmd"].replace("OUT", out)
        print(f"$ {command_line(cmd, r.get('env', {}))}", flush=True)
        proc = sh(cmd, os.path.join(out, "log.txt"), r.get("env"), wait=False)
        procs.append((r, out, cmd, time.time(), proc))
        running.append(proc)
    results = []
    for r, out, cmd, t0, proc in procs:
        rc, cut = _wait(proc, ends)
        rows = last_metrics(out)
        res = {"name": r["name"], "cmd": cmd, "env": r.get("env", {}), "rc": rc, "cut": cut, "seconds": time.time() - t0,
               "acc1": rows[-1]["val_acc1"] if rows else None, "best": max((x["val_acc1"] for x in rows if x["val_acc1"] is not None), default=None),
               "val_samples": rows[-1]["val_samples"] if rows else None,
               "img_per_s": statistics.median(x["img_per_s"] for x in rows) if rows else None,
               "skipped_steps": rows[-1].get("skipped_steps_total") if rows else None,
               "loss_scale": rows[-1].get("loss_scale") if rows else None, "epochs": len(rows)}
        if cut:
            print(f"  {r['name']}: cut at --deadline after {len(rows)} epoch(s)", flush=True)
        elif rc:
            print(f"  !! {r['name']} exited {rc}:\n{tail(os.path.join(out, 'log.txt'), 15)}", flush=True)
        elif res["acc1"] is not None:
            print(f"  {r['name']}: Acc@1 {res['acc1']:.2f} in {res['seconds']:.0f} s", flush=True)
        else:
            print(f"  {r['name']}: done in {res['seconds']:.0f} s", flush=True)
        results.append(res)
    for r in unstarted:
        print(f"  {r['name']}: not started (--deadline)", flush=True)
        results.append({"name": r["name"], "cmd": r["cmd"], "env": r.get("env", {}), "rc": None, "cut": True,
                        "seconds": 0.0, "acc1": None, "best": None, "val_samples": None, "img_per_s": None,
                        "skipped_steps": None, "loss_scale": None, "epochs": 0})
    return results


def _past(ends) -> bool:
    return ends is not None and time.time() >= ends


def _wait(proc, ends) -> tuple:
    """(the run's exit status, whether --deadline cut it): past the deadline the run's shell and every
    process under it end. They stay in this process's group, so a timeout or Ctrl-C that ends this
    process ends them too."""
    try:
        return proc.wait(timeout=None if ends is None else max(ends - time.time(), 0.01)), False
    except subprocess.TimeoutExpired:
        for pid in _tree(proc.pid):  # parents first: a shell ended cannot start its next command
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return proc.wait(), True


def _tree(pid: int) -> list:
    """``pid`` and its descendants, parents before children, from /proc (Linux)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children.get(p, [])
    return found


def run_one(name: str, cmd: str, env: dict, args) -> dict:
    """One run alone (run_group of one), its result."""
    return run_group([{"name": name, "cmd": cmd, "env": env}], args)[0]


def run_rows(rows, fill: dict, args) -> list:
    """A table of rows (group, name, command template, environment) run a group at a time, the
    rows of a group side by side; each template is filled from ``fill``. The results in order."""
    results = []
    for _, group in itertools.groupby(rows, key=lambda row: row[0]):
        results += run_group([{"name": name, "cmd": cmd.format(**fill), "env": env} for _, name, cmd, env in group],
                             args)
    return results


def table(results: list, ref: str | None) -> None:
    """The accuracy table of run_group's results, each against the run named ``ref``; then the commands."""
    base = next((r["acc1"] for r in results if r["name"] == ref and r["acc1"] is not None), None)
    print("\n| run | final Acc@1 | best | vs run 1 | val images | train img/s (median epoch) | skipped steps | final loss scale | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if r.get("cut"):  # --deadline: how far it got, never a final figure
            last = f"{r['acc1']:.2f} after {r['epochs']} epoch(s)" if r["acc1"] is not None else "no epoch"
            print(f"| {r['name']} | cut at --deadline: {last} | | | | | | | {r['seconds']:.0f} |")
            continue
        if r["acc1"] is None:
            print(f"| {r['name']} | FAILED (exit {r['rc']}) | | | | | | | {r['seconds']:.0f} |")
            continue
        diff = f"{r['acc1'] - base:+.2f}" if base is not None else "-"
        print(f"| {r['name']} | {r['acc1']:.2f} | {r['best']:.2f} | {diff} | {r['val_samples']} | "
              f"{r['img_per_s']:.0f} | {r['skipped_steps']} | {r['loss_scale']} | {r['seconds']:.0f} |")
    print_commands(results)


def seed_accs(results: list, prefix: str) -> list:
    """The final Acc@1 of every run whose name minus its ``-sSEED`` tail is ``prefix``."""
    return [r["acc1"] for r in results if r["name"].rsplit("-s", 1)[0] == prefix and r["acc1"] is not None
            and not r.get("cut")]


def recipe_cmd(args, data: str) -> str:
    """The Fashion-MNIST recipe (--recipe-config, --recipe-arch: ResNet-18 unless asked, batch 128)
    on ``data``: the accuracy phases' base."""
    arch = getattr(args, "recipe_arch", "resnet18")
    return (f"main.py {data} --config {args.recipe_config} -a {arch} -b 128 --lr={args.lr} "
            f"--epochs {args.epochs} -j {args.workers} --output-dir OUT")


def epoch_rates(out_dir: str, skip: int) -> tuple:
    """(median img/s, min, max, median data_wait_frac) over the epochs after the first ``skip``."""
    rows = last_metrics(out_dir)[skip:]
    if not rows:
        return None
    rates = sorted(r["img_per_s"] for r in rows)
    waits = sorted(r.get("data_wait_frac", float("nan")) for r in rows)
    return statistics.median(rates), rates[0], rates[-1], statistics.median(waits)


def first_step(log: str):
    """The "first step done N s after start" of a main.py log (None if it has none, or no log)."""
    try:
        for line in open(log, errors="replace"):
            if "=> first step done" in line:
                return float(line.split("done")[1].split("s after")[0])
    except OSError:
        pass
    return None


def visible_gpus() -> int:
    out = subprocess.run([PY, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                         text=True)
    return int(out.stdout.strip() or 0)


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
