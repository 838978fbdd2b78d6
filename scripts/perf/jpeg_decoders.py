"""Each GPU JPEG decoder of ``--decode gpu`` alone, then beside a training step on the same GPU.

    python scripts/perf/jpeg_decoders.py DIR [--batch-size 384] [--images 3072] [--passes 5]
        [--decoders torchvision,torchcodec] [--load resnet50|none] [--load-stream default|side] [--profile]

An idle GPU decodes far faster than one that trains: this tool measures both conditions in one
process, as the trainer has them. The decoder (``imagenet.data.gpu.jpeg``, the call ``--decode
gpu`` makes) runs in one thread on a high-priority stream of its own, as the trainer's decode
thread does; with ``--load resnet50`` another thread trains torchvision's ResNet-50 (fp16,
channels_last, batch --load-batch) meanwhile, one step queued ahead of the GPU as a training loop
keeps it, on CUDA's legacy default stream (main.py's loop's) or, with ``--load-stream side``, a
stream of its own. Every decoder is timed alone first, then each beside the load. For each it
prints img/s alone and under the load (the median of --passes passes over --images JPEGs of
DIR's ``train`` folder, after one warm-up pass), the decode thread's CPU time as a share of its
wall time in each case (near 1 while it waits: CUDA's synchronisation spins, so a share that
rises only under the load means waiting for the GPU), and the load's steps a second alone and
beside each decoder (what the decode takes from the step); each row as soon as it is measured.
``--profile`` adds one pass of each beside the load under torch's profiler: the CUDA calls by
host time and the kernels by GPU time. ``--device cpu`` runs the same loop on a CPU device (each
decoder's libjpeg path), to try the tool anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from imagenet.data.gpu import jpeg as gpujpeg  # noqa: E402


class Load(threading.Thread):
    """Trains a model in a loop on its own stream until stopped; counts its steps."""

    def __init__(self, device: torch.device, batch: int, size: int, stream: str = "side"):
        super().__init__(daemon=True)
        import torchvision
        half = device.type == "cuda"
        self.model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
        self.model = self.model.half() if half else self.model
        self.x = torch.randn(batch, 3, size, size, device=device, dtype=torch.half if half else torch.float32)
        self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.device, self.steps, self.running = device, 0, threading.Event()
        # "default": the step on CUDA's legacy default stream, as main.py's loop runs it; "side": a
        # stream of its own (which no other stream waits for implicitly)
        cuda = device.type == "cuda"
        self.stream = (torch.cuda.Stream(device) if stream == "side" else torch.cuda.default_stream(device)) \
            if cuda else None
        self.stop = threading.Event()
        self.error = None

    def step(self) -> None:
        self.model(self.x).float().sum().backward()

    def run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                queued = []  # a step's end, as a trainer's loop keeps one step queued ahead of the GPU
                while not self.stop.is_set():
                    self.step()
                    if self.stream is not None:
                        queued.append(torch.cuda.Event())
                        queued[-1].record(self.stream)
                        if len(queued) > 1:
                            queued.pop(0).synchronize()
                    self.steps += 1
                    self.running.set()
        except Exception as e:  # reported by the main thread, which would wait for the first step
            self.error = e
            self.running.set()

    def rate(self, seconds: float) -> float:
        """Steps a second over ``seconds`` of its running."""
        start, t0 = self.steps, time.perf_counter()
        time.sleep(seconds)
        return (self.steps - start) / (time.perf_counter() - t0)

    def mark(self) -> tuple:
        return self.steps, time.perf_counter()

    def since(self, mark: tuple) -> float:
        """Steps a second since ``mark``."""
        return (self.steps - mark[0]) / (time.perf_counter() - mark[1])


def passes(decoder, datas: list, batch: int, device: torch.device, n: int) -> tuple:
    """img/s of each of ``n`` passes after one warm-up, and the decoding thread's CPU share over them."""
    batches = [datas[i:i + batch] for i in range(0, len(datas), batch)]
    # high priority, as --decode gpu's decode thread's stream (a decoder that queues its kernels on
    # the caller's stream has them scheduled ahead of the load's)
    stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
    rates, wall, cpu = [], 0.0, 0.0
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for rep in range(n + 1):
            t0, c0 = time.perf_counter(), time.thread_time()
            for part in batches:
                decoder.decode(part, device)
            if rep:  # the warm-up pass is left out
                rates.append(len(datas) / (time.perf_counter() - t0))
                wall += time.perf_counter() - t0
                cpu += time.thread_time() - c0
    return rates, cpu / wall if wall else 0.0


def _gpu_us(event) -> float:
    """An averaged profiler event's GPU time in microseconds (``cuda_time_total`` before torch 2.5)."""
    return getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))


def profile(decoder, datas: list, batch: int, device: torch.device, top: int = 10) -> str:
    """One pass of the decoder (beside the load where it runs) under torch's profiler: the CUDA
    runtime and driver calls by their total host time (a synchronisation or an allocation that
    waits for the whole device shows here, with its count), and the GPU kernels by their device
    time (the decode's own SM time against the training step's)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        passes(decoder, datas, batch, device, 0)
    events = prof.key_averages()
    api = sorted((e for e in events if e.key.startswith("cu") and e.cpu_time_total > 0),
                 key=lambda e: -e.cpu_time_total)[:top]
    kernels = sorted((e for e in events
                      if _gpu_us(e) > 0 and not e.key.startswith(("cu", "aten::", "Memcpy", "Memset"))),
                     key=lambda e: -_gpu_us(e))[:top]
    lines = [f"  {e.key[:60]}: {e.count} calls, {e.cpu_time_total / 1000:.1f} ms host" for e in api]
    lines += [f"  kernel {e.key[:60]}: {e.count}, {_gpu_us(e) / 1000:.1f} ms GPU" for e in kernels]
    return "\n".join(lines) or "  (no CUDA call or kernel recorded)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="an ImageFolder root with a train folder of JPEGs")
    p.add_argument("--batch-size", type=int, default=384)
    p.add_argument("--images", type=int, default=3072, help="JPEGs a pass decodes")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--decoders", default=",".join(gpujpeg.BACKENDS),
                   help=f"comma-separated, of {', '.join(gpujpeg.BACKENDS)}")
    p.add_argument("--load", choices=("resnet50", "none"), default="resnet50")
    p.add_argument("--load-batch", type=int, default=256)
    p.add_argument("--load-size", type=int, default=224)
    p.add_argument("--load-stream", choices=("side", "default"), default="default",
                   help="the load's stream: CUDA's legacy default stream (main.py's training loop's) or one of its own")
    p.add_argument("--profile", action="store_true",
                   help="one more pass of each decoder beside the load under torch's profiler: its CUDA calls "
                        "and kernels")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    wanted = [n for n in args.decoders.split(",") if n]
    unknown = [n for n in wanted if n not in gpujpeg.BACKENDS]
    if not wanted or unknown:
        print(f"error: --decoders {args.decoders!r}: give GPU JPEG decoders of the trainer, comma-separated, of "
              f"{', '.join(gpujpeg.BACKENDS)}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible (use --device cpu to try the tool)", file=sys.stderr)
        return 2
    paths = sorted(glob.glob(os.path.join(args.data, "train", "*", "*")))[:args.images]
    if not paths:
        print(f"error: no images under {os.path.join(args.data, 'train')}", file=sys.stderr)
        return 2
    datas = [torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8) for path in paths]
    load = Load(device, args.load_batch, args.load_size, args.load_stream) if args.load != "none" else None
    decoders = [(name, gpujpeg.find(name)) for name in wanted]
    # every decoder alone first, while the load has not started
    alone_rates = {name: passes(decoder, datas, args.batch_size, device, args.passes)
                   for name, decoder in decoders if decoder is not None}
    print(f"{len(datas)} JPEGs of {args.data}, batches of {args.batch_size}, {args.passes} passes after one, on "
          f"{device}; load: {args.load}"
          + (f" (batch {args.load_batch}, {args.load_size} px, {args.load_stream} stream)" if load else ""))
    print("\n| decoder | img/s alone | thread CPU share | img/s beside the load | thread CPU share "
          "| load's steps kept |\n| --- | --- | ---: | --- | ---: | ---: |", flush=True)
    try:
        for name, decoder in decoders:  # each row printed once measured: a run cut short keeps its rows
            if decoder is None:
                print(f"| {name} | not available here | | | | |", flush=True)
                continue
            rates, share = alone_rates[name]
            loaded, loaded_share, kept = "", "", ""
            if load is not None:
                if not load.is_alive() and load.error is None:
                    load.start()
                    load.running.wait()
                    alone = load.rate(3.0) if load.error is None else 0.0  # its steps a second alone, once
                if load.error is not None:
                    print(f"error: the load's training step failed: {load.error}", file=sys.stderr)
                    return 2
                mark = load.mark()
                under, under_share = passes(decoder, datas, args.batch_size, device, args.passes)
                beside = load.since(mark)  # over the warm-up pass too: the decoder ran all along
                loaded = f"{statistics.median(under):.0f} ({min(under):.0f}..{max(under):.0f})"
                loaded_share = f"{under_share:.2f}"
                kept = f"{beside / alone:.2f}" if alone else ""
            print(f"| {name} | {statistics.median(rates):.0f} ({min(rates):.0f}..{max(rates):.0f}) | {share:.2f} "
                  f"| {loaded} | {loaded_share} | {kept} |", flush=True)
            if args.profile:
                print(f"{name}, one pass{' beside the load' if load is not None else ''}:\n"
                      + profile(decoder, datas, args.batch_size, device), flush=True)
    finally:
        if load is not None and load.is_alive():
            load.stop.set()
            load.join()  # a thread left inside a step aborts the interpreter's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
