"""The learning rate's shape over a run: a multiplier of ``--lr`` per optimizer step.

Every schedule starts with the same linear warm-up (``--warmup-epochs``, from lr/warmup to lr),
then decays:

* ``step`` -- x ``--lr-gamma`` every ``--lr-step`` epochs (the reference script's);
* ``cosine`` -- half a cosine from lr to ``--lr-end``;
* ``triangular`` -- a straight line from lr to ``--lr-end`` (FFCV's ResNet recipes: up over 2
  epochs, down to 0 at the last);
* ``poly`` -- ``(lr - lr_end) * (1 - p) ** --lr-poly-power + lr_end`` (MLPerf's ResNet-50 with
  LARS: power 2 to 1e-4).

The decays reach ``--lr-end`` at ``--lr-decay-epochs`` (default ``--epochs``; MLPerf decays over
37 epochs and stops once its target accuracy is reached, at about 35) and stay there after.
"""

from __future__ import annotations

import math
from typing import Callable


def schedule_of(cfg, iters_per_epoch: int) -> Callable[[int], float]:
    """The multiplier of ``cfg.lr`` at optimizer step ``it`` (0-based) of ``cfg``'s run, at
    ``iters_per_epoch`` steps an epoch: ``--lr-schedule`` and its settings (``--lr-end`` is
    absolute, in the units of ``--lr``)."""
    schedule, power, gamma, step_epochs = cfg.lr_schedule, cfg.lr_poly_power, cfg.lr_gamma, cfg.lr_step
    warmup = int(round(cfg.warmup_epochs * iters_per_epoch))
    decay_epochs = cfg.epochs if cfg.lr_decay_epochs is None else cfg.lr_decay_epochs
    end = max(int(round(decay_epochs * iters_per_epoch)), warmup + 1)
    floor = cfg.lr_end / cfg.lr

    def shape(progress: float) -> float:  # 1 at the decay's start, 0 at its end
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule == "poly":
            return (1.0 - progress) ** power
        return 1.0 - progress  # triangular

    def factor(it: int) -> float:
        if it < warmup:
            return (it + 1) / warmup
        if schedule == "step":
            return gamma ** ((it // iters_per_epoch) // step_epochs)
        progress = min((it - warmup) / (end - warmup), 1.0)
        return floor + (1.0 - floor) * shape(progress)
    return factor
