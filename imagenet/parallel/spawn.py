"""``--multiprocessing-distributed``: the classic reference script's own launcher, one process
per visible GPU started from the training command (``python -m multiproc`` and torchrun are
the other launchers; :mod:`imagenet.parallel.distributed` reads what they set)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from typing import Callable, Optional

import torch

from ..base.errors import EXIT_USER_ERROR, UserError
from . import distributed
from .preemption import Preempted


def spawn_per_gpu(cfg, run: Callable, nprocs: Optional[int] = None) -> int:
    """One process per visible GPU (or ``nprocs``), each calling ``run(cfg)`` with its rank
    in the environment, as torchrun would set it; returns the exit status, as every other launch mode does (2 for a user error,
    128 + the signal number after a preemption)."""
    n = nprocs
    if n is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise UserError("--multiprocessing-distributed starts one process per GPU and none is visible; "
                        "for CPU processes use python -m multiproc --nproc-per-node N main.py ... "
                        "--dist-backend gloo")
    nodes = max(cfg.world_size, 1)
    node = max(cfg.rank, 0)
    if node >= nodes:
        raise UserError(f"--rank {cfg.rank} (the node rank with --multiprocessing-distributed) must be "
                        f"below --world-size {cfg.world_size} (the number of nodes)")
    if cfg.dist_url.startswith("env://"):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if nodes > 1:
                raise UserError("several nodes need a shared rendezvous: set MASTER_ADDR/MASTER_PORT "
                                "or pass --dist-url tcp://HOST:PORT")
            os.environ["MASTER_PORT"] = str(distributed.free_port())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.multiprocessing as mp
    context = mp.start_processes(_spawned_worker, args=(run, cfg, n, node, nodes), nprocs=n, join=False,
                                 start_method="spawn")
    # The workers leave the terminal's process group (see _spawned_worker): a Ctrl-C reaches this
    # process alone and is passed on once, so it is not a second, immediate stop for them.
    forwarded = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: _signal_workers(context, signum))
                for sig in forwarded}
    try:
        while not context.join(timeout=1):
            pass
    except mp.ProcessExitedException as e:
        # A preempted or failed rank; torch has stopped the others (SIGTERM: they checkpoint).
        code = e.exit_code or 1
        return code if code > 0 else 128 - code  # a death by signal, as a shell reports it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _signal_workers(context, signum: int) -> None:
    for process in context.processes:
        if process.is_alive():
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass


def _spawned_worker(local_rank: int, run: Callable, cfg, n: int, node: int, nodes: int) -> None:
    os.setpgrp()  # out of the terminal's process group: the launching process forwards signals
    os.environ.update({"RANK": str(node * n + local_rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(nodes * n), "LOCAL_WORLD_SIZE": str(n)})
    child = dataclasses.replace(cfg, multiprocessing_distributed=False, world_size=-1, rank=-1, gpu=None)
    try:
        run(child)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except distributed.PeerFailure as e:  # another rank stalled or died: one line, as execute says it
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Preempted as e:  # every rank stops at the same step; one line says how to resume
        if node * n + local_rank == 0:
            print(f"=> {e}", flush=True)
        sys.exit(e.exit_code)
