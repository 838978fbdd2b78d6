"""Meters and accuracy. Sums live on the device and cross ranks as (sum, count) pairs.

Nothing here reads a GPU value per step: :class:`DeviceSums` accumulates on the device and is
read (and all-reduced) only when a line is printed or an epoch ends, so the hot loop never
waits for the host.
"""

from __future__ import annotations

import torch


def topk_correct(output: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> torch.Tensor:
    """Number of samples whose target is among the top-k logits, for each k (a device tensor)."""
    maxk = min(max(ks), output.shape[1])
    _, pred = output.topk(maxk, dim=1)
    hits = pred.eq(target.view(-1, 1))
    return torch.stack([hits[:, :min(k, maxk)].any(dim=1).sum() for k in ks]).to(torch.float64)


class DeviceSums:
    """Running float64 sums of (loss * n, correct@1, correct@5, n) kept on one device."""

    FIELDS = ("loss", "correct1", "correct5", "count")

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)
        self.last = torch.zeros_like(self.sums)

    def add(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        n = target.numel()
        correct = topk_correct(output.detach(), target)
        # new_full fills on the device: a host tensor copied in would stall the queue every step.
        batch = torch.cat([(loss.detach().to(torch.float64) * n).view(1), correct, correct.new_full((1,), n)])
        self.last = batch
        self.sums += batch

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
        """Start from sums counted before (the first part of an epoch a resumed run continues)."""
        self.sums += torch.tensor(values, dtype=torch.float64, device=self.sums.device)

    def last_batch(self) -> dict:
        return means(self.last.tolist())


def means(values: list) -> dict:
    loss, c1, c5, n = values
    if n == 0:
        return {"loss": float("nan"), "acc1": 0.0, "acc5": 0.0, "count": 0}
    return {"loss": loss / n, "acc1": 100.0 * c1 / n, "acc5": 100.0 * c5 / n, "count": int(n)}


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
