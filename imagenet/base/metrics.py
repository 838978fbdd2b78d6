"""Meters and accuracy. Sums live on the device and cross ranks as (sum, count) pairs.

Nothing here reads a GPU value per step: :class:`DeviceSums` accumulates on the device and is
read (and all-reduced) only when a line is printed or an epoch ends, so the hot loop never
waits for the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


def topk_correct(output: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> torch.Tensor:
    """Number of samples whose target is among the top-k logits, for each k (a device tensor)."""
    maxk = min(max(ks), output.shape[1])
    _, pred = output.topk(maxk, dim=1)
    hits = pred.eq(target.view(-1, 1))
    return torch.stack([hits[:, :min(k, maxk)].any(dim=1).sum() for k in ks]).to(torch.float64)


class DeviceSums:
    """Running float64 sums of (loss * n, correct@1, correct@5, n) kept on one device, and the
    count of unreadable images met: a mid-epoch checkpoint carries them all, so a resumed epoch
    reports, and judges ``--max-bad-fraction`` on, the whole epoch."""

    FIELDS = ("loss", "correct1", "correct5", "count", "unreadable")

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)
        self.last = torch.zeros_like(self.sums)

    def add(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        n = target.numel()
        correct = topk_correct(output.detach(), target)
        # new_full fills on the device: a host tensor copied in would stall the queue every step.
        batch = torch.cat([(loss.detach().to(torch.float64) * n).view(1), correct, correct.new_full((1,), n)])
        self.last = batch
        self.sums.narrow(0, 0, 4).add_(batch)

    def unreadable(self, n: int) -> None:
        """``n`` images of a batch could not be read."""
        self.sums.narrow(0, 4, 1).add_(n)

    def raw(self, ctx=None, reduce=None) -> list:
        """The sums themselves (over ranks when ``reduce`` is given); one host sync."""
        sums = self.sums.clone()
        if reduce is not None:
            reduce(sums, ctx)
        return sums.tolist()

    def totals(self, ctx=None, reduce=None) -> dict:
        """Sums (over ranks when ``reduce`` is given) turned into means; one host sync."""
        return means(self.raw(ctx, reduce))

    def seed(self, values: list) -> None:
        """Start from sums counted before (the first part of an epoch a resumed run continues;
        an older checkpoint's hold no unreadable count)."""
        values = list(values) + [0.0] * (len(self.FIELDS) - len(values))
        self.sums += torch.tensor(values, dtype=torch.float64, device=self.sums.device)

    def last_batch(self) -> dict:
        return means(self.last.tolist())


def means(values: list) -> dict:
    """:class:`DeviceSums`' sums as means, the counts as integers (``unreadable``: 0 in sums
    written before they had it)."""
    loss, c1, c5, n = values[:4]
    unreadable = int(values[4]) if len(values) > 4 else 0
    if n == 0:
        return {"loss": float("nan"), "acc1": 0.0, "acc5": 0.0, "count": 0, "unreadable": unreadable}
    return {"loss": loss / n, "acc1": 100.0 * c1 / n, "acc5": 100.0 * c5 / n, "count": int(n),
            "unreadable": unreadable}


class AverageMeter:
    """Current value and running average of a host-side quantity (times)."""

    def __init__(self):
        self.val = 0.0
        self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / self.count if self.count else 0.0


@dataclass
class EpochRecord:
    """One line of ``metrics.jsonl``: one epoch. docs/OPTIONS.md's metrics table lists every key.

    Rates are images per second, times seconds, accuracies percent; ``train_*`` cover the
    whole epoch, also one resumed in its middle; ``val_*`` are null for an epoch the validation
    cadence (``--eval-every``, ``--eval-start``) skips.
    """

    epoch: int
    lr: float  # at the epoch's first step
    lr_end: float  # after its last step
    train_loss: float
    train_acc1: float
    train_acc5: float
    train_samples: int
    steps: int  # optimizer steps run in this process's share of the epoch (after a resume: since it)
    skipped_steps: int  # of those, skipped for gradient overflow
    img_per_s: float  # steady training rate: after the epoch's first steps, training steps only
    data_wait_frac: float  # share of that time the loop waited for input (over 0.1: input-bound)
    train_seconds: float
    val_loss: Optional[float]
    val_acc1: Optional[float]
    val_acc5: Optional[float]
    val_samples: Optional[int]
    epoch_seconds: float  # training, validation and checkpoint
    skipped_images: int  # unreadable images skipped, train and val
    loss_scale: Optional[float]  # after the epoch; null without loss scaling
    skipped_steps_total: int  # overflow skips since the run began
    best_acc1: float
    precision: str  # fp32 | fp16 | amp-fp16 | amp-bf16
    mode: str  # cpu | gpu | dp | ddp
    image_size: int  # the epoch's training crop (--progressive-resize changes it)
    world_size: int
    # times the launcher restarted the processes after a failure, so far in this launch
    # (multiproc --max-restarts / torchrun: TORCHELASTIC_RESTART_COUNT)
    restarts: int = 0
    # the run's clock after this epoch's validation: seconds since its first optimizer step ended,
    # summed over resumes (imagenet.training.cadence.RunClock)
    run_seconds: float = 0.0
    # --target-acc: in the row of the epoch whose validation first reached it, run_seconds again
    # (MLPerf's time to train); absent from every other row
    seconds_to_target: Optional[float] = None
    val_seconds: float = 0.0  # the epoch's validation (and the weight average's), compiling included
    # --model-ema: the weight average, validated on the same images
    val_loss_ema: Optional[float] = None
    val_acc1_ema: Optional[float] = None
    val_acc5_ema: Optional[float] = None
    # --decode gpu: images decoded on the GPUs, and by CPUs instead (not plain JPEGs), train and val
    decoded_on_gpu: Optional[int] = None
    decode_fallbacks: Optional[int] = None
    # and the training JPEGs the workers decoded as their share (--decode-share)
    decoded_by_workers: Optional[int] = None
    # --decode gpu: milliseconds per training batch in each stage of the input path, this
    # process's (imagenet.data.gpu.account), and "batches", how many it covers
    input_stages: Optional[dict] = None
    # --compile: graphs torch.compile compiled in the epoch, training and validation (0 once every
    # shape of it was compiled in an earlier epoch)
    compiles: Optional[int] = None

    OPTIONAL = ("val_loss_ema", "val_acc1_ema", "val_acc5_ema", "decoded_on_gpu", "decode_fallbacks",
                "decoded_by_workers", "input_stages", "seconds_to_target", "compiles")

    def to_dict(self) -> dict:
        """The JSON row: every key, less the optional ones this run does not produce."""
        row = dataclasses.asdict(self)
        return {k: v for k, v in row.items() if v is not None or k not in self.OPTIONAL}


EPOCH_KEYS = tuple(f.name for f in dataclasses.fields(EpochRecord))
