"""Where and how a run executes: one decision, carried through the run as a :class:`DistContext`.

Launch modes, decided once in :func:`setup`:

* ``cpu``   -- no GPU is visible.
* ``gpu``   -- one visible GPU, or ``--gpu N``.
* ``dp``    -- several visible GPUs and no distributed environment: DataParallel, as the
  reference script does (``CUDA_VISIBLE_DEVICES=0,1 python main.py DIR``).
* ``ddp``   -- a distributed environment (torchrun / ``python -m multiproc`` variables, SLURM's,
  or ``--world-size/--rank/--dist-url``): DistributedDataParallel, one device per process.

Under ``srun`` (one task per GPU) nothing needs setting up: without MASTER_ADDR/MASTER_PORT the
rendezvous is the first host of the job's node list on a port derived from the job id, the same
for every task of the job and different between jobs. Those variables are read (and checked,
before torch starts) by :mod:`imagenet.base.launchenv`.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from ..base.errors import UserError
from ..base.launchenv import SLURM_SOURCE, distributed_env, restart_count, slurm_master
from .dataparallel import DataParallel

logger = logging.getLogger(__name__)


@dataclass
class DistContext:
    """Everything about devices and processes that the rest of the run needs to know."""

    mode: str  # cpu | gpu | dp | ddp
    device: torch.device
    reason: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    device_ids: list = field(default_factory=list)
    # Times an elastic launcher (multiproc --max-restarts, torchrun) restarted the process group
    # after a failure, so far in this launch (TORCHELASTIC_RESTART_COUNT); > 0: resume from the
    # newest checkpoint.
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mode == "ddp"

    @property
    def n_devices(self) -> int:
        """Devices that share one global batch in this process's view (DP) or across ranks (DDP)."""
        return len(self.device_ids) if self.mode == "dp" else self.world_size

    def describe(self) -> str:
        if self.mode == "ddp":
            alone = "; one process: nothing to all-reduce, the model runs unwrapped" if self.world_size == 1 else ""
            return (f"DistributedDataParallel, rank {self.rank} of {self.world_size} "
                    f"({self.backend}, {self.device}{alone}) -- {self.reason}")
        if self.mode == "dp":
            return f"DataParallel over cuda:{self.device_ids} -- {self.reason}"
        return f"single {self.device} -- {self.reason}"


def setup(cfg) -> DistContext:
    """Choose the launch mode, pick the device and (for DDP) join the process group."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    denv = distributed_env(cfg)
    if denv is not None:
        ctx = _setup_ddp(cfg, denv, n_gpus)
        ctx.restart_count = restart_count()
        return ctx
    if cfg.dist_backend == "nccl" and n_gpus == 0:
        raise UserError("--dist-backend nccl needs CUDA GPUs and none is visible; "
                        "use --dist-backend gloo for CPU processes")
    if cfg.gpu is not None:
        if cfg.gpu >= n_gpus:
            raise UserError(f"--gpu {cfg.gpu} asked for, but {n_gpus} GPU(s) are visible"
                            + (" (check CUDA_VISIBLE_DEVICES)" if n_gpus else "; drop --gpu to train on the CPU"))
        torch.cuda.set_device(cfg.gpu)
        return DistContext("gpu", torch.device("cuda", cfg.gpu), f"--gpu {cfg.gpu}")
    if n_gpus == 0:
        return DistContext("cpu", torch.device("cpu"), "no CUDA GPU is visible")
    if n_gpus == 1:
        torch.cuda.set_device(0)
        return DistContext("gpu", torch.device("cuda", 0), "one GPU is visible")
    torch.cuda.set_device(0)
    return DistContext("dp", torch.device("cuda", 0),
                       f"{n_gpus} GPUs are visible and no distributed environment is set",
                       device_ids=list(range(n_gpus)))


def _setup_ddp(cfg, denv: dict, n_gpus: int) -> DistContext:
    backend = cfg.dist_backend or ("nccl" if n_gpus > 0 else "gloo")
    if backend == "nccl":
        if n_gpus == 0:
            raise UserError("--dist-backend nccl needs CUDA GPUs and none is visible; "
                            "use --dist-backend gloo for CPU processes")
        if not dist.is_nccl_available():
            raise UserError("this PyTorch build has no NCCL; install a CUDA build of PyTorch "
                            "or use --dist-backend gloo")
    elif backend == "gloo" and not dist.is_gloo_available():
        raise UserError("this PyTorch build has no gloo backend; use --dist-backend nccl on GPUs")
    elif backend in ("mpi", "ucc") and not getattr(dist, f"is_{backend}_available")():
        raise UserError(f"--dist-backend {backend} is not available in this PyTorch build; "
                        "use nccl (GPUs) or gloo (CPUs)")
    local = denv["local_rank"]
    gpu = local
    if denv["source"] == SLURM_SOURCE and n_gpus == 1:
        gpu = 0  # srun --gpus-per-task=1 (or --gpu-bind): each task sees its own GPU only, as device 0
    if n_gpus > 0:
        if gpu >= n_gpus:
            how = (f"srun --ntasks-per-node={n_gpus}" if denv["source"] == SLURM_SOURCE
                   else f"--nproc-per-node {n_gpus}")
            raise UserError(f"local rank {local} has no GPU: {n_gpus} visible on this node; start "
                            f"at most {n_gpus} processes per node ({how})")
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)  # before any CUDA work, so each rank owns its own GPU
    else:
        device = torch.device("cpu")
    if denv["source"] == SLURM_SOURCE and cfg.dist_url.startswith("env://"):
        # srun without MASTER_*: every task derives the same address and port
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = slurm_master(os.environ)
    _check_rendezvous(cfg, denv)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    init_method = cfg.dist_url
    try:
        kwargs = {}
        if device.type == "cuda" and backend == "nccl":
            kwargs["device_id"] = device  # binds the communicator eagerly; fails fast on bad setups
        dist.init_process_group(backend=backend, init_method=init_method, rank=denv["rank"],
                                world_size=denv["world_size"], timeout=timeout, **kwargs)
    except (RuntimeError, ValueError, OSError) as e:
        where = _rendezvous_address(cfg)
        raise UserError(f"could not join the process group at {where} within {cfg.dist_timeout}s "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check that "
                        "every rank uses the same master address/port and world size and that rank 0 "
                        "is running")
    return DistContext("ddp", device, denv["source"], rank=denv["rank"], world_size=denv["world_size"],
                       local_rank=local, backend=backend)


def _rendezvous_address(cfg) -> str:
    if cfg.dist_url.startswith("env://"):
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return cfg.dist_url


def _check_rendezvous(cfg, denv: dict) -> None:
    """Fail fast, with the address, when the rendezvous point cannot work."""
    url = cfg.dist_url
    if url.startswith("env://"):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise UserError(f"{' and '.join(missing)} not set: launch with python -m multiproc or "
                            "torchrun, or pass --dist-url tcp://HOST:PORT")
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    elif url.startswith("tcp://"):
        parsed = urlparse(url)
        host, port = parsed.hostname, parsed.port
        if not host or not port:
            raise UserError(f"--dist-url {url} needs a host and a port, e.g. tcp://10.0.0.1:23456")
    elif url.startswith("file://"):
        path = url[len("file://"):]
        # A file left by a crashed run makes the new ranks read old keys and hang or fail.
        if denv["rank"] == 0 and os.path.exists(path):
            age = time.time() - os.path.getmtime(path)
            if age > 60:
                raise UserError(f"rendezvous file {path} is left over from an earlier run "
                                f"({age:.0f}s old); delete it or use a new --dist-url file:// path")
        return
    else:
        raise UserError(f"--dist-url {url} is not understood; use env://, tcp://HOST:PORT or file:///PATH")
    if denv["rank"] == 0:
        return  # rank 0 hosts the store
    try:
        port = int(port)
    except ValueError:
        raise UserError(f"master port {port!r} is not a number")
    deadline = time.monotonic() + cfg.dist_timeout
    last: Optional[Exception] = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError as e:
            last = e
            time.sleep(1.0)
    raise UserError(f"master {host}:{port} was not reachable within {cfg.dist_timeout}s ({last}); "
                    "start rank 0 first, and check the address, the port and the firewall")


def wrap(model: nn.Module, ctx: DistContext, **ddp_options) -> nn.Module:
    """Put the (already precision-converted) model on its device and in its parallel wrapper.

    ``ddp_options`` go to DistributedDataParallel (scripts/perf/bench.py tries bucket settings)."""
    model = model.to(ctx.device)
    if ctx.mode == "dp":
        return DataParallel(model, device_ids=ctx.device_ids)  # torch's, with per-GPU threads that persist
    if ctx.mode == "ddp" and ctx.world_size > 1:
        # One process has no gradients to all-reduce: DDP would only split the compiled graph at
        # its buckets (python -m multiproc on one GPU: 7,546 img/s wrapped, 7,898 plain, H200).
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, **ddp_options)
    return model


# How a collective that waited --dist-timeout for a peer fails: gloo raises "Timed out waiting
# 30000ms for send operation to complete" (or recv), or, where the timeout had closed the
# connection first, "Application timeout caused pair closure"; NCCL's watchdog reports
# "Watchdog caught collective operation timeout".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (send|recv) operation|Application timeout caused pair "
                                 r"closure|collective operation timeout")


def collective_timeout(error: BaseException, timeout_s: int) -> Optional[str]:
    """One line saying what ``error`` means if it is a collective that timed out waiting for a
    peer (the backend's traceback says no more than that, and nothing about the peer), else None."""
    if not isinstance(error, RuntimeError) or not _COLLECTIVE_TIMEOUT.search(str(error)):
        return None
    return (f"a collective operation timed out after {timeout_s} s waiting for a peer (--dist-timeout {timeout_s}); "
            "another rank has stalled or died (python -m multiproc names it)")


# How a collective fails when a peer's process is gone: gloo finds the connection to it closed
# ("Connection closed by peer [127.0.0.1]:23442", "Read error [127.0.0.1]:21133: Connection reset
# by peer", or a write's "Broken pipe"); NCCL, where it notices, reports a remote error.
_PEER_LOST = re.compile(r"gloo/transport/tcp/.*(Connection closed by peer|Connection reset by peer|Broken pipe)"
                        r"|ncclRemoteError")
_PEER_ADDRESS = re.compile(r"\[([^\]]+)\]:(\d+)")


def peer_lost(error: BaseException, ctx: DistContext) -> Optional[str]:
    """One line saying what ``error`` means if it is a collective that failed because a peer's
    connection closed under it (its process died: killed, out of memory, a crash), else None. In a
    group of two the peer is the other rank; in a larger one the backend names an address, not a
    rank, and the launcher says which rank it was."""
    if not isinstance(error, RuntimeError) or not _PEER_LOST.search(str(error)):
        return None
    if ctx.world_size == 2:
        peer = 1 - ctx.rank
        where = f"GPU_{peer}.log" if peer else "the terminal"
        return (f"rank {peer} died during a collective operation (its connection closed); its output ({where} "
                "under python -m multiproc) and the launcher say why")
    address = _PEER_ADDRESS.search(str(error))
    seen = f" (the connection to {address.group(1)}:{address.group(2)} closed)" if address else ""
    return f"another rank died during a collective operation{seen}; python -m multiproc names it and says how"


class PeerFailure(Exception):
    """A collective operation failed for want of another rank, which stalled or died: not a bug
    of this process. The message is one line; the exit status 1 (a launcher may restart the group)."""


def peer_failure(error: BaseException, ctx: DistContext, timeout_s: int) -> Optional[PeerFailure]:
    """``error`` as a :class:`PeerFailure` if a peer caused it (a timeout, a lost connection), else None."""
    line = collective_timeout(error, timeout_s) or peer_lost(error, ctx)
    return PeerFailure(line) if line else None


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over ranks (in place); no-op outside DDP."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@torch.no_grad()
def average_buffers(module: nn.Module, ctx: DistContext) -> None:
    """Set every floating-point buffer of ``module`` (BatchNorm's running statistics) to its mean
    over the ranks, in place, the same on every rank; no-op outside DDP.

    DDP keeps buffers per rank: each rank's statistics follow its own batches. Every rank runs
    the same number of batches of the same size, so each rank's statistics weigh the same and
    their plain mean is the estimate from all of them (timm's ``--dist-bn reduce``). One
    all-reduce per dtype, of the buffers laid end to end."""
    if not ctx.distributed:
        return
    groups: dict = {}
    for buf in module.buffers():
        if buf.is_floating_point():
            groups.setdefault(buf.dtype, []).append(buf)
    for bufs in groups.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= ctx.world_size
        for buf, mean in zip(bufs, flat.split([b.numel() for b in bufs])):
            buf.copy_(mean.view_as(buf))


def agree_started(failure: Optional[BaseException], ctx: DistContext) -> None:
    """Every rank says whether its start-up failed; if any did, every rank stops with a message.

    Call it on every rank before the first collective of the run: a rank that stops alone
    would leave the others waiting in a collective until ``--dist-timeout``, or failing with
    a backend traceback when the launcher ends the run.
    """
    if ctx.distributed:
        flag = torch.tensor([ctx.rank + 1 if failure is not None else 0], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = int(flag.item()) - 1
        if failed >= 0 and failure is None:
            where = f"GPU_{failed}.log" if failed else "the terminal"
            raise UserError(f"rank {failed} could not start (its message, in {where} under python -m multiproc, "
                            f"says why); this rank stops too")
    if failure is not None:
        raise failure


def all_reduce_max(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Maximum over ranks (in place); no-op outside DDP."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def cleanup(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port that was free a moment ago (for single-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
