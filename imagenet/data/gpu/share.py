"""``--decode-share``: the share of the training JPEGs the workers decode on their CPUs, the rest
going to the GPU decoder.

One decode thread makes the GPU decoder's calls, and at small training sizes it sets the pace:
torchvision's nvJPEG op spends tens of microseconds of that thread's CPU on each image, one call
at a time in a process, while the workers, which only read the files and draw the crops, have
CPU to spare (the figures: docs/INPUT.md). ``auto`` (the default) lets the decode thread hand
work back: every :data:`WINDOW` batches it looks at its own time, and where it was busy nearly
all of it (the workers kept up and the step waited for it) the share rises by :data:`STEP`;
where it waited, for the workers or for room ahead of the step, the share falls. After a change
it first lets ``lag`` batches pass (those the workers had made or begun under the old share: two
a worker, the DataLoader's prefetch), so a look judges the share it set and the share does not
overshoot by the batches in flight, as it did with many workers. So the workers
take up what the decode thread cannot do, and where the step or the workers set the pace the
share goes back to 0. A number fixes the share; 0 keeps every JPEG on the GPU, and is what
``--deterministic`` takes (which images the workers decode follows the load, and their pixels
are libjpeg's, not nvJPEG's).

The share is one float in shared memory that the decode thread writes and every worker reads per
image (:class:`Credit`): a worker decodes its share of its images exactly as the CPU path does
(the same crop draws), the path the fallbacks (PNGs, progressive JPEGs) already take.
"""

from __future__ import annotations

from typing import Optional

import torch

WINDOW = 8  # batches in one look, counted once the batches made under the share before are through
STEP = 0.04  # a look's change of the share
MOST = 0.75  # the share never goes past this: the GPU keeps the larger part
BUSY = 0.95  # the decode thread busy this share of its time or more: it set the pace, the share rises
IDLE = 0.85  # busy less than this: something else set the pace, the share falls


class DecodeShare:
    """The share of the training JPEGs the workers decode: fixed (a number), or set by the decode
    thread's load (``None``: ``--decode-share auto``); ``lag``: the batches under way when the share
    changes, left out of the next look. Pickles to the workers as its shared float."""

    def __init__(self, fixed: Optional[float] = None, lag: int = 0):
        if fixed is not None and not 0.0 <= fixed <= 1.0:
            raise ValueError(f"a share is between 0 and 1, not {fixed}")
        self.auto = fixed is None
        self.lag = max(0, int(lag))
        self._value = torch.full((1,), 0.0 if fixed is None else float(fixed), dtype=torch.float64).share_memory_()
        self._busy = self._total = 0.0
        self._batches = self._hold = 0

    @property
    def value(self) -> float:
        return self._value.item()  # a fifth of float(self._value[0])'s cost: workers read it per image

    def observe(self, busy: float, waited: float) -> None:
        """One batch of the decode thread: ``busy`` seconds making it, ``waited`` seconds waiting
        (for the workers' batch and for room ahead); every :data:`WINDOW` batches the share moves."""
        if not self.auto:
            return
        if self._hold:  # made under the share before the last change: says nothing of this one
            self._hold -= 1
            return
        self._busy, self._total, self._batches = self._busy + busy, self._total + busy + waited, self._batches + 1
        if self._batches < WINDOW:
            return
        share, busy_frac = self.value, self._busy / self._total if self._total > 0 else 0.0
        if busy_frac >= BUSY:
            share = min(MOST, share + STEP)
        elif busy_frac < IDLE:
            share = max(0.0, share - STEP)
        if share != self.value:
            self._value[0] = share
            self._hold = self.lag
        self._busy = self._total = 0.0
        self._batches = 0

    def __getstate__(self) -> dict:
        return {"auto": self.auto, "_value": self._value}  # the workers read the share, they never steer it

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lag=0, _busy=0.0, _total=0.0, _batches=0, _hold=0)


class Credit:
    """A worker's side: :meth:`take` says whether this image is one of the share's. Each image
    adds the share to a credit and an image is taken per whole unit, so a worker decodes the
    share's fraction of its images, spread evenly, with no random draw (the crop draws' RNG is
    left as the CPU path uses it)."""

    def __init__(self, share: Optional[DecodeShare]):
        self.share = share
        self._credit = 0.0

    def take(self) -> bool:
        if self.share is None:
            return False
        self._credit += self.share.value
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False
