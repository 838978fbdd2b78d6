"""``--tensorboard``: the per-epoch metrics (the numbers in metrics.jsonl) as TensorBoard scalars.

Optional: the ``tensorboard`` package is not a requirement of the trainer. Asking for it without
the package is a flag error at start-up, before any training time is spent. Events go to
``OUTPUT_DIR/tensorboard``; ``tensorboard --logdir OUTPUT_DIR`` shows them, one run per folder.
"""

from __future__ import annotations

import numbers
import os

from ..base.errors import UserError

# metrics.jsonl fields shown under a group of their own (the rest go under "run/")
_GROUPS = (("train_", "train/"), ("val_", "val/"), ("lr", "lr/"), ("loss_scale", "precision/"),
           ("skipped_", "precision/"), ("img_per_s", "speed/"), ("epoch_seconds", "speed/"),
           ("best_", "val/"))


def _tag(key: str) -> str:
    for prefix, group in _GROUPS:
        if key.startswith(prefix):
            return group + key
    return "run/" + key


def require_tensorboard() -> None:
    """Raise the flag error now if ``--tensorboard`` cannot work (package missing)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                        "(or drop --tensorboard; metrics.jsonl has the same numbers)") from None


class TensorBoardLog:
    """Writes one scalar per numeric metric per epoch (step = epoch)."""

    def __init__(self, output_dir: str):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter
        self.path = os.path.join(output_dir, "tensorboard")
        self._writer = SummaryWriter(log_dir=self.path)

    def write_epoch(self, record: dict) -> None:
        epoch = int(record["epoch"])
        for key, value in record.items():
            if key == "epoch" or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            if value != value:  # NaN (an epoch with no trainable batch): nothing to draw
                continue
            self._writer.add_scalar(_tag(key), float(value), epoch)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
