"""Which epochs a run validates, its clock, and its stop at a target accuracy: ``--eval-every``,
``--eval-start``, ``--target-acc`` (MLPerf's time to train).

MLPerf's ResNet-50 validates every 4 epochs from its third (NVIDIA's ``EVAL_PERIOD=4
EVAL_OFFSET=2`` validate its 0-based epochs 2, 6, ..., 34) and stops the clock when a validation
reaches 75.90%: ``--eval-every 4 --eval-start 2 --target-acc 75.9``, with epochs 0-based as in
metrics.jsonl. The last epoch is always validated, so every run ends with an accuracy.

The clock starts when the run's first optimizer step has finished (start-up, the loaders' first
batches, cuDNN's search and torch.compile are behind it; MLPerf's clock also starts after its
initialisation) and runs through training, validation and checkpoints. Each checkpoint carries
its reading, so a resumed run continues it (the time between that checkpoint and the resume, and
the resumed run's own start-up, are not counted).
"""

from __future__ import annotations

import time
from typing import Optional

from .engine import ValResult


def validates(cfg, epoch: int) -> bool:
    """Whether the run validates after ``epoch`` (0-based): every ``--eval-every`` epochs from
    ``--eval-start``, the last epoch, and a ``--prof`` run's one epoch."""
    if cfg.prof > 0 or epoch == cfg.epochs - 1:
        return True
    return epoch >= cfg.eval_start and (epoch - cfg.eval_start) % cfg.eval_every == 0


def not_validated() -> ValResult:
    """What an epoch the cadence does not validate reports: no loss, accuracy or count (null in
    metrics.jsonl), no unreadable files."""
    return ValResult(loss=None, acc1=None, acc5=None, samples=None, skipped_paths=[])


def reached(cfg, acc1: Optional[float]) -> bool:
    """Whether a validation at ``acc1`` (None: none this epoch) reaches ``--target-acc``. Under DDP
    every rank holds the same ``acc1`` (the all-reduced sums), so every rank stops after the same epoch."""
    return cfg.target_acc is not None and acc1 is not None and acc1 >= cfg.target_acc


class RunClock:
    """Seconds of the run: ``carried`` (a checkpoint's reading) plus those since :meth:`start`."""

    def __init__(self, carried: float = 0.0):
        self.carried = carried
        self.started: Optional[float] = None

    def start(self) -> None:
        """The run's first optimizer step has finished (its work done on the device)."""
        if self.started is None:
            self.started = time.perf_counter()

    def seconds(self) -> float:
        return self.carried + (0.0 if self.started is None else time.perf_counter() - self.started)
