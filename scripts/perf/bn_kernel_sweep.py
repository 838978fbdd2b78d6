#!/usr/bin/env python
"""Launch settings of the fused BatchNorm kernels (imagenet/kernels/bntriton.py, launched by bnlaunch.py), timed on ResNet-50's layers.

    python scripts/perf/bn_kernel_sweep.py --out DIR          # on a GPU; batch 256, fp16 activations

For each of the kernels' four phases (statistics, normalise, gradient sums, input gradients)
and each candidate ``bnlaunch.Launch`` (tile, warps, programs per multiprocessor), the phase
runs over every BatchNorm layer of one ResNet-50 training step (53 layers, their shapes,
residuals and ReLUs as the fused model has them) on random fp16 channels_last activations with
float32 parameters, as ``--fp16`` runs them; the table gives the phase's milliseconds per step
(median of the repeats), its memory traffic in TB/s, and marks the fastest setting, which is
what ``bnlaunch.LAUNCH`` should hold (``--out`` writes them as bn_launch.json, the value for
IMAGENET_BN_LAUNCH). The phases' bests add up to the kernels' share of a step. Each phase's
launches over the 53 layers are replayed as one CUDA graph, so the time is the device's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as stats
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torchvision  # noqa: E402
from torchvision.models.resnet import Bottleneck  # noqa: E402

from imagenet.kernels import bnlaunch, bntriton  # noqa: E402
from imagenet.models import fusedresnet  # noqa: E402

# Stages > 1 pipeline the row loop's loads (more bytes in flight a program, more registers)
REDUCTIONS = ([bnlaunch.Launch(t, w, p, s) for t, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)) for p in (2, 3, 4)
               for s in (1, 2, 3, 4)] + [bnlaunch.Launch(4096, 4, 8, s) for s in (1, 3)])
POINTWISE = [bnlaunch.Launch(t, w) for t, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16))]


def resnet50_layers(batch: int) -> list:
    """(N, C, H, W, relu, residual, forked, shortcut) of every BatchNorm of a ResNet-50 step at 224
    px, in order; forked: the backward takes two gradients (a block's last BatchNorm whose output
    fusedresnet.fuse_resnet forks); shortcut: "applies" for a block's last BatchNorm whose residual
    add applies the downsample's BatchNorm, "folded" for that BatchNorm (its normalise and
    gradient sums are the add's; its input gradient is its own pass), else "". The fused model
    runs torch's modules here (no kernels on the CPU)."""
    model = fusedresnet.fuse_resnet(torchvision.models.resnet50())
    shapes = {}

    def record(module, _inputs, output) -> None:  # a hook returning a value would replace the output
        shapes[module] = tuple(output.shape[1:])
    for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        bn.register_forward_hook(record)
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    roles = {model.bn1: (True, False, False, "")}
    for block in (m for m in model.modules() if isinstance(m, Bottleneck)):
        shortcut = block.downsample is not None
        roles.update({block.bn1: (True, False, False, ""), block.bn2: (True, False, False, ""),
                      block.bn3: (True, True, block.fork_output, "applies" if shortcut else "")})
        if shortcut:
            roles[block.downsample[1]] = (False, False, False, "folded")
    return [(batch, *shapes[bn], *roles[bn]) for bn in roles]


def make_tensors(layers: list, device) -> list:
    out = []
    for n, c, h, w, relu, res, forked, shortcut in layers:
        def act():
            return torch.randn(n, c, h, w, device=device, dtype=torch.float16).contiguous(
                memory_format=torch.channels_last)
        t = {"x": act(), "r": act() if res else None, "dy": act(), "dy2": act() if forked else None, "relu": relu,
             "w": torch.rand(c, device=device) + 0.5, "b": torch.randn(c, device=device) * 0.1,
             "rm": torch.zeros(c, device=device), "rv": torch.ones(c, device=device)}
        t["mean"], t["invstd"] = bnlaunch.statistics(t["x"], t["rm"], t["rv"], 0.1, 1e-5)
        t["mask"] = bnlaunch.mask_kind(relu, res)
        t["shortcut"] = shortcut
        t["sc"] = None
        if shortcut == "applies":  # the residual is the raw input of the downsample's BatchNorm
            rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
            t["sc"] = bnlaunch.Shortcut(torch.rand(c, device=device) + 0.5, torch.randn(c, device=device) * 0.1,
                                       *bnlaunch.statistics(t["r"], rm, rv, 0.1, 1e-5))
        t["y"], t["bits"] = bnlaunch.normalise(t["x"], t["r"], t["mean"], t["invstd"], t["w"], t["b"], relu, t["sc"])
        t["sums"] = bnlaunch.gradient_sums(t["dy"], t["x"], t["bits"], t["mean"], t["invstd"], t["w"], t["b"],
                                          t["mask"], t["dy2"], keep_g=res,
                                          shortcut=(t["r"], t["sc"]) if t["sc"] is not None else None)
        out.append(t)
    return out


def phase_call(phase: str, t: dict):
    """The phase's call as the fused model makes it (None where it has none: a folded shortcut
    BatchNorm's normalise and gradient sums): with a residual, the gradient sums write the masked
    gradient and the input gradients read it alone."""
    res = t["r"] is not None
    if t["shortcut"] == "folded" and phase in ("apply", "grad"):
        return None
    sc = (t["r"], t["sc"]) if t["sc"] is not None else None
    if phase == "stats":
        return lambda: bnlaunch.statistics(t["x"], t["rm"], t["rv"], 0.1, 1e-5)
    if phase == "apply":
        return lambda: bnlaunch.normalise(t["x"], t["r"], t["mean"], t["invstd"], t["w"], t["b"], t["relu"], t["sc"])
    if phase == "grad":
        return lambda: bnlaunch.gradient_sums(t["dy"], t["x"], t["bits"], t["mean"], t["invstd"], t["w"], t["b"],
                                             t["mask"], t["dy2"], keep_g=res, shortcut=sc)
    sg, sgx, g = t["sums"][0], t["sums"][1], t["sums"][4]
    if res:
        return lambda: bnlaunch.input_gradients(g, t["x"], None, t["mean"], t["invstd"], t["w"], t["b"], sg, sgx,
                                               bnlaunch.MASK_NONE)
    return lambda: bnlaunch.input_gradients(t["dy"], t["x"], t["bits"], t["mean"], t["invstd"], t["w"], t["b"], sg,
                                           sgx, t["mask"], t["dy2"])


def phase_bytes(phase: str, t: dict) -> int:
    """Bytes the phase must move for one layer (2 a value: fp16 activations; the ReLU's mask bits,
    written by the normalise pass and read by the gradient sums, a sixteenth of that)."""
    if t.get("shortcut") == "folded" and phase in ("apply", "grad"):
        return 0  # the residual add's passes do it
    two = t["dy2"] is not None  # a forked output's second gradient, read by the gradient sums
    res = t["r"] is not None  # the gradient sums write the masked gradient; the input gradients read it alone
    bits = t["mask"] == bnlaunch.MASK_FROM_BITS
    raw = t.get("shortcut") == "applies"  # the gradient sums read the shortcut's raw input too
    sixteenths = {"stats": 16, "apply": 16 * (2 + res) + bits, "grad": 16 * (2 + two + res + raw) + bits,
                  "grad_input": 16 * 3 if res else 16 * (3 + two) + bits}[phase]
    return sixteenths * t["x"].numel() * 2 // 16


PHASE_KERNELS = {"stats": "_partial_stats", "apply": "_apply", "grad": "_partial_grad", "grad_input": "_grad_input"}


def compiled(kernel) -> list:
    """The compiled variants of a Triton kernel so far (Triton 3.x keeps them per device)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return [k for entry in caches.values() for k in entry[0].values()]
    return [k for per_device in getattr(kernel, "cache", {}).values() for k in per_device.values()]


def resources(phase: str, launch, known: dict, seen: set) -> tuple:
    """(most registers a thread, most spilled registers, most shared memory bytes) of the phase's
    main kernel's variants for ``launch``: those compiled since ``seen`` (which this updates),
    else the ones ``known`` holds for the same compiled settings (tile, warps, stages: programs
    a multiprocessor only size the grid), which this fills; Nones where Triton does not say."""
    key = (phase, launch.tile, launch.warps, launch.stages)
    new = [k for k in compiled(getattr(bntriton, PHASE_KERNELS[phase])) if id(k) not in seen]
    seen.update(id(k) for k in new)
    regs = [getattr(k, "n_regs", None) for k in new]
    if new and None not in regs:
        spills = [getattr(k, "n_spills", None) or 0 for k in new]
        shared = [getattr(getattr(k, "metadata", None), "shared", None) or 0 for k in new]
        known[key] = (max(regs), max(spills), max(shared))
    return known.get(key, (None, None, None))


def resident(regs, shared, warps: int) -> Optional[int]:
    """Programs of ``warps`` warps that fit on one multiprocessor of a Hopper GPU: by registers
    (64K, allocated 256 a warp at a time), warps (64) and shared memory (228 KB, 1 KB of it
    reserved a program)."""
    if regs is None:
        return None
    per_warp = -(-regs * 32 // 256) * 256
    fit = min(65536 // (per_warp * warps), 64 // warps)
    return min(fit, 233472 // (shared + 1024)) if shared else fit


def time_phase(calls: list, repeats: int) -> float:
    """Device milliseconds of the calls in order: replayed as one CUDA graph, as a compiled step
    runs them, so the launches' host time (several times the small layers' kernels) is not counted."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compiles this setting's kernels
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return stats.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--phases", default="stats,apply,grad,grad_input", help="the phases to sweep, comma-separated")
    p.add_argument("--out", default=None, help="directory for bn_kernel_sweep.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bn_kernel_sweep.py times the kernels on a GPU; none is here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    layers = resnet50_layers(args.batch)
    phases = list(dict.fromkeys(phase for phase in args.phases.split(",") if phase))
    unknown = sorted(set(phases) - set(PHASE_KERNELS))
    if unknown:
        print(f"--phases: unknown {unknown}; choose from {', '.join(PHASE_KERNELS)}", file=sys.stderr)
        return 2
    tensors = make_tensors(layers, device)  # compiles every phase's kernels with bnlaunch.LAUNCH's settings
    known, seen = {}, set()
    for phase in PHASE_KERNELS:
        resources(phase, bnlaunch.LAUNCH[phase], known, seen)
    ceiling = read = None
    if "stats" in phases:  # the read rate a plain reduction reaches on these tensors: torch's sum of each
        read = sum(t["x"].numel() * 2 for t in tensors)
        ceiling = time_phase([lambda t=t: t["x"].sum() for t in tensors], args.repeats)
        print(f"ceiling: torch.sum over every layer's input once, {ceiling:.3f} ms, {read / ceiling / 1e9:.2f} TB/s",
              flush=True)
    rows = []
    for phase in phases:
        shipped = bnlaunch.LAUNCH[phase]
        candidates = REDUCTIONS if phase in ("stats", "grad") else POINTWISE
        moved = sum(phase_bytes(phase, t) for t in tensors)
        # the shipped settings always get a row: the table and the totals compare against them
        for launch in candidates + ([shipped] if shipped not in candidates else []):
            bnlaunch.LAUNCH[phase] = launch
            ms = time_phase([call for call in (phase_call(phase, t) for t in tensors) if call], args.repeats)
            regs, spills, shared = resources(phase, launch, known, seen)
            rows.append({"phase": phase, "tile": launch.tile, "warps": launch.warps,
                         "programs_per_sm": launch.programs_per_sm, "stages": launch.stages, "ms": ms,
                         "tb_s": moved / ms / 1e9, "regs": regs, "spills": spills, "shared": shared,
                         "resident": resident(regs, shared, launch.warps), "shipped": launch == shipped})
            print(f"{phase} {launch}: {ms:.3f} ms, {rows[-1]['tb_s']:.2f} TB/s, {regs} registers ({spills} spilled)",
                  flush=True)
        bnlaunch.LAUNCH[phase] = shipped
    print(f"\nResNet-50 batch {args.batch}: {len(layers)} BatchNorm layers, fp16 activations; ms per training step")
    print("| phase | tile | warps | programs/SM | stages | ms/step | TB/s | registers (spilled) | shared KB | fit/SM "
          "| |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    best_total = shipped_total = 0.0
    for phase in phases:
        mine = [r for r in rows if r["phase"] == phase]
        best = min(mine, key=lambda r: r["ms"])
        best_total += best["ms"]
        shipped_total += next(r["ms"] for r in mine if r["shipped"])
        for r in mine:
            mark = " ".join(m for m, on in (("fastest", r is best), ("shipped", r["shipped"])) if on)
            print(f"| {phase} | {r['tile']} | {r['warps']} | {r['programs_per_sm'] or '-'} | {r['stages']} | "
                  f"{r['ms']:.3f} | {r['tb_s']:.2f} | {r['regs']} ({r['spills']}) | "
                  f"{'-' if r['shared'] is None else round(r['shared'] / 1024)} | {r['resident']} | {mark} |")
    print(f"\nthe phases swept: {shipped_total:.2f} ms a step with bnlaunch.LAUNCH, {best_total:.2f} with each "
          f"phase's fastest setting")
    fastest = {phase: min((r for r in rows if r["phase"] == phase), key=lambda r: r["ms"]) for phase in phases}
    launch = {phase: [r["tile"], r["warps"], r["programs_per_sm"], r["stages"]] for phase, r in fastest.items()}
    print(f"IMAGENET_BN_LAUNCH='{json.dumps(launch)}' runs the fastest settings")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bn_kernel_sweep.json"), "w") as f:
            json.dump({"batch": args.batch, "rows": rows, "ceiling_ms": ceiling,
                       "ceiling_tb_s": read / ceiling / 1e9 if ceiling else None}, f, indent=1)
        with open(os.path.join(args.out, "bn_launch.json"), "w") as f:
            json.dump(launch, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
