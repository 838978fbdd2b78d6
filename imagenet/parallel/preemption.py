"""Graceful stop on SIGTERM/SIGINT/SIGUSR1: finish the step, write a checkpoint, say how to resume.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM and wait a grace period before
SIGKILL. SLURM's ``#SBATCH --signal=USR1@120`` sends SIGUSR1 that long before the time limit:
it stops the same way, and the exit status 128 + 10 = 138 tells a requeue script that the run
stopped with a checkpoint and can be requeued (docs/DISTRIBUTED.md: the sbatch example). The handler only
records the request; the training loop asks :meth:`should_stop` between steps. Under DDP every
rank must stop after the same step (the checkpoint and the next collective need all of them), so
ranks agree by an all-reduce every few steps. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch

from .distributed import DistContext, all_reduce_max

AGREE_EVERY = 10  # steps between the ranks' agreement on a stop request (DDP only)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint of an interrupted run is written; carries the signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Installs the handlers for the duration of a ``with`` block."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.signum: Optional[int] = None
        self._calls = 0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: no more waiting
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): no handlers
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self) -> bool:
        """True once a stop was requested (on any rank); call between steps, on every rank."""
        if not self.ctx.distributed:
            return self.signum is not None
        self._calls += 1
        if self._calls % AGREE_EVERY:
            return False
        flag = torch.tensor([self.signum or 0], device=self.ctx.device)
        flag = int(all_reduce_max(flag, self.ctx).item())
        if flag and self.signum is None:
            self.signum = flag
        return bool(flag)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a stop request"
