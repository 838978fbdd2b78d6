"""When a run saves, and what a checkpoint holds: the one writer of ``checkpoint.pth.tar`` and
``model_best.pth.tar`` (the file I/O itself is :mod:`imagenet.base.checkpoint`'s).

A checkpoint is the training state's ``state_dict()``, the progress's, the RNG states of every
rank, the resolved config, and what decides the training data's order
(:func:`imagenet.data.dataorder.fingerprint`), which a mid-epoch resume checks, and the run's
clock (``run_seconds``). Saves happen after each epoch, validated or not (model_best too when
its validation is the best so far), every ``--save-every-steps`` optimizer steps, and when a stop
signal ends an epoch early. Every rank calls :meth:`CheckpointPolicy.save` (the RNG states are gathered
from all of them); rank 0 writes. A ``--prof`` run saves nothing: it trains and validates a few
batches, and a checkpoint of it would claim a finished epoch and a best Acc@1 that ``--resume
auto`` (or an elastic restart) in that folder would take for real.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from ..base import checkpoint as ckpt_io
from ..parallel import distributed
from ..parallel.preemption import Preempted, StopRequest
from .state import Progress, TrainState


class CheckpointPolicy:
    def __init__(self, cfg, ctx, classes: list, data_order: Optional[dict] = None,
                 clock: Optional[Callable[[], float]] = None):
        """``clock``: the run's clock in seconds (:class:`imagenet.training.cadence.RunClock`),
        whose reading each checkpoint carries so that a resumed run continues it."""
        self.cfg, self.ctx, self.classes, self.data_order, self.clock = cfg, ctx, list(classes), data_order, clock
        self.writes = cfg.prof < 0  # the same on every rank: none enters the gather below alone

    def save(self, state: TrainState, progress: Progress, is_best: bool = False) -> None:
        if not self.writes:
            return
        if self.clock is not None:
            progress = dataclasses.replace(progress, run_seconds=self.clock())
        if state.ema is not None:  # the ranks' mean, which every rank resuming here then holds
            state.ema.average_statistics(self.ctx)
        rng = distributed.gather_objects(ckpt_io.capture_rng(), self.ctx)
        if not self.ctx.is_main:
            return
        checkpoint = {
            "format_version": ckpt_io.FORMAT_VERSION,
            "arch": self.cfg.arch,
            "num_classes": len(self.classes),
            "classes": self.classes,
            **state.state_dict(),
            **progress.state_dict(),
            "rng": rng[0],
            "rng_per_rank": rng,
            "config": self.cfg.to_dict(),
            "data_order": self.data_order,
        }
        ckpt_io.save_checkpoint(checkpoint, self.cfg.output_dir, is_best)

    def step_hook(self, state: TrainState, progress: Progress, batches: int) -> Optional[Callable]:
        """The training loop's ``on_step(batches_done, so_far)`` for ``--save-every-steps``, or None
        (``so_far``: a function returning an :class:`imagenet.training.engine.SoFar`). ``batches``:
        the epoch's loader batches; a save after the last says the epoch is trained."""
        every, accum = self.cfg.save_every_steps, self.cfg.accum_steps
        if not every:
            return None

        def on_step(done: int, so_far: Callable) -> None:
            if (done // accum) % every == 0:
                part = so_far()
                self.save(state, progress.at_step(done, part.sums, part.skipped, trained=done >= batches))
        return on_step

    def is_best(self, acc1: Optional[float], progress: Progress) -> bool:
        """Whether an epoch validating at ``acc1`` is the best so far (also the first validated
        epoch that writes model_best, even at 0%, so the file exists after every validation).
        An epoch the cadence did not validate (``acc1`` None) is never the best."""
        if acc1 is None:
            return False
        missing = self.ctx.is_main and not os.path.exists(os.path.join(self.cfg.output_dir, ckpt_io.BEST))
        return acc1 > progress.best_acc1 or missing

    def stopped(self, state: TrainState, progress: Progress, stop: StopRequest) -> Preempted:
        """Save where a stop signal ended the epoch; the exception to end the run with."""
        self.save(state, progress)
        stopped = f"stopped by {stop.name} in epoch {progress.epoch} after step {progress.step}"
        if not self.writes:
            return Preempted(stop.signum, f"{stopped}; no checkpoint written (--prof)")
        where = os.path.join(self.cfg.output_dir, ckpt_io.CHECKPOINT)
        return Preempted(stop.signum, f"{stopped}; checkpoint written to {where}: run the same command with "
                                      "--resume auto to continue")
