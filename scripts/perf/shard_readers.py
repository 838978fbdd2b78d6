"""Reading tar shards: the trainer's reader against webdataset's, side by side, on one shard folder.

    python scripts/perf/shard_readers.py SHARDS [--workers 2] [--window 1000] [--passes 3]

SHARDS is a folder written by ``scripts/make_shards.py``. Both readers go through a DataLoader
with the same workers, batch size and per-image work, so only the reading differs:

- ``ours``: ``ShardDataset`` (one ``pread`` per sample, at the offset ``index.json``'s table gives)
  in the order of ``ShardWindowSampler`` (shards shuffled, ``--window`` samples permuted together);
- ``webdataset``: ``wds.WebDataset(tars, shardshuffle=len(tars), ...)`` streaming each
  tar from its start, then ``.shuffle(--window)``, the usual way to read this layout.

Two kinds of work per sample: ``read`` (the encoded bytes and the label only: what the reader
itself costs) and ``decode`` (PIL decode, torchvision's RandomResizedCrop(224) and flip, uint8
tensor: a CPU training pipeline's work). Prints img/s, the median of ``--passes`` passes over the
training split (spread in brackets). webdataset is optional: ``pip install webdataset``.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import transforms  # noqa: E402

from imagenet.data.samplers import ShardWindowSampler  # noqa: E402
from imagenet.data.shards.dataset import ShardDataset, find_shards  # noqa: E402

AUGMENT = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                              transforms.PILToTensor()])


def decoded(data: bytes):
    return AUGMENT(Image.open(io.BytesIO(data)).convert("RGB"))


def encoded_size(data: bytes):
    return torch.tensor(len(data))


def first(samples):
    return torch.stack([s[0] for s in samples]), torch.tensor([int(s[1]) for s in samples])


def ours(root: str, work, workers: int, window: int, batch: int):
    split = find_shards(root).splits["train"]
    data = ShardDataset(split, None, lambda f: work(f.getvalue()))
    sampler = ShardWindowSampler(data.table["shard"], data.table["id"], 1, 0, seed=0, window=window)
    return DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers, collate_fn=first,
                      persistent_workers=workers > 0), sampler


def webdataset(root: str, work, workers: int, window: int, batch: int):
    import webdataset as wds
    split = find_shards(root).splits["train"]
    tars = [split.path(i) for i in range(len(split.shards))]
    pipeline = (wds.WebDataset(tars, shardshuffle=len(tars), nodesplitter=wds.split_by_node, empty_check=False)
                .shuffle(window).to_tuple("jpg;jpeg;png", "cls").map_tuple(work, int).batched(batch, collation_fn=first))
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0), None


def timed_passes(loader, sampler, passes: int) -> list:
    rates = []
    for epoch in range(passes + 1):  # the first pass warms the page cache and the workers
        if sampler is not None:
            sampler.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for images, _ in loader:
            n += len(images)
        if epoch:
            rates.append(n / (time.perf_counter() - start))
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", help="a shard folder (scripts/make_shards.py)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--window", type=int, default=1000, help="samples shuffled together, both readers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--readers", default="ours,webdataset")
    args = p.parse_args(argv)
    if find_shards(args.shards) is None:
        print(f"error: {args.shards} is no shard folder (no index.json): run scripts/make_shards.py first")
        return 2
    makers = {"ours": ours, "webdataset": webdataset}
    print(f"| reader | work | img/s (median of {args.passes}) | spread |\n| --- | --- | ---: | --- |")
    for work_name, work in (("read", encoded_size), ("decode", decoded)):
        for name in args.readers.split(","):
            try:
                loader, sampler = makers[name](args.shards, work, args.workers, args.window, args.batch_size)
            except ImportError as e:
                print(f"| {name} | {work_name} | not installed ({e}) | |")
                continue
            rates = timed_passes(loader, sampler, args.passes)
            print(f"| {name} | {work_name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}..{max(rates):,.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
