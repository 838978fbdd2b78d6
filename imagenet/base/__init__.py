"""The base layer: what every other layer may use, and nothing that knows a training run.

* ``config`` -- the typed :class:`Config`, its flags and YAML keys, and their checks.
* ``errors`` -- :class:`UserError` (one line, exit status 2) and how an entry point reports it.
* ``metrics`` -- meters, accuracy, device-side sums, and one epoch's metrics.jsonl row.
* ``checkpoint`` -- checkpoint file I/O: atomic writes, ``weights_only`` reads, finding the newest.
* ``launchenv`` -- which process of which job this is, from torchrun's, multiproc's or SLURM's
  variables or the classic flags, read before torch is imported.
* ``paths`` -- where the trainer keeps files between runs (``~/.cache/imagenet-trainer``).
* ``processenv`` -- the environment a training process sets before torch starts (CUDA's hardware
  queues, Inductor's cache folder).
* ``wrappers`` -- seeing through DataParallel, DDP and torch.compile wrappers.
* ``torch_private`` -- every private torch API the trainer relies on, one function each.

May import: the standard library, torch, numpy, yaml. Nothing of ``imagenet``'s other packages.
"""
