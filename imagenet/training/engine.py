"""The training and validation loops: plain functions that take what they use by keyword and
return small results (:class:`TrainResult`, :class:`ValResult`).

The loops never branch on precision (the :mod:`precision` object hides it). On the launch mode
they branch only where DDP needs it: the reductions of :mod:`distributed`, ``no_sync`` for
accumulated micro-batches, a zero-weight stand-in batch where a rank's batch is empty, and the
rate summed over ranks. Device values are read only at print time, but for the count of
non-finite losses, which each step reads of the step before (:class:`NonfiniteWatch`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from ..base.errors import UserError
from ..base.metrics import AverageMeter, DeviceSums, means
from ..base.wrappers import ddp_of, unwrap
from ..parallel.distributed import DistContext, all_reduce_max, all_reduce_sum, average_buffers, gather_objects

logger = logging.getLogger(__name__)
_SCHEDULE_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


@dataclass
class LoopOptions:
    """How a loop runs and reports: print frequency and progress display (which change nothing
    computed), the --prof step limit, the non-finite-loss limit, the stand-in batch's shape, and
    the gradient-accumulation count."""

    print_freq: int = 10
    progress: str = "lines"  # bar | lines
    max_steps: Optional[int] = None  # --prof: stop early
    max_nonfinite_steps: int = 200
    input_shape: tuple = (3, 224, 224)  # of one image, for a stand-in batch (see train_one_epoch)
    accum_steps: int = 1  # loader batches (micro-batches) per optimizer step


def _progress(loader, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=len(loader), desc=desc, file=sys.stdout, dynamic_ncols=True, leave=False)


def _line(prefix: str, i: int, n: int, batch_time: AverageMeter, data_time: Optional[AverageMeter],
          cur: dict, avg: dict) -> str:
    width = len(str(n))
    parts = [f"{prefix}[{i:>{width}}/{n}]", f"Time {batch_time.val:6.3f} ({batch_time.avg:6.3f})"]
    if data_time is not None:
        parts.append(f"Data {data_time.val:6.3f} ({data_time.avg:6.3f})")
    parts += [f"Loss {cur['loss']:.4e} ({avg['loss']:.4e})",
              f"Acc@1 {cur['acc1']:6.2f} ({avg['acc1']:6.2f})",
              f"Acc@5 {cur['acc5']:6.2f} ({avg['acc5']:6.2f})"]
    return "\t".join(parts)


@dataclass
class TrainResult:
    """One training epoch (or the part of it this call ran), reduced over ranks where it says."""

    loss: float  # mean over the epoch's images, all ranks (a resumed epoch: the whole epoch)
    acc1: float
    acc5: float
    samples: int  # images trained on, all ranks
    steps: int  # optimizer steps this call ran
    skipped_steps: int  # of those, skipped for gradient overflow
    img_per_s: float  # steady rate, all ranks (Steady.img_per_s times the world size)
    data_wait_frac: float
    steady: "Steady"  # this process's steady-state totals, for the run's summary
    seconds: float
    skipped_paths: list  # unreadable files this rank met
    completed: bool  # False: a stop request ended the epoch early
    steps_done: int  # loader batches of the epoch consumed (the unreadable ones included)
    sums: list  # metric sums so far, all ranks (metrics.DeviceSums.raw), for a mid-epoch checkpoint


CARRIED_PATHS = 10_000  # unreadable images' paths a mid-epoch checkpoint keeps (about 1 MB); their count is whole


class SoFar(NamedTuple):
    """The part of an epoch done, over all ranks, for a mid-epoch checkpoint."""

    sums: list  # metric sums (metrics.DeviceSums.raw), the unreadable images' count among them
    skipped: list  # the unreadable images' paths, at most CARRIED_PATHS


def skipped_so_far(carried: Optional[list], mine: list, ctx: DistContext) -> list:
    """The paths of the unreadable images of the part of the epoch done (every rank calls this):
    those a checkpoint carried from before a resume, then each rank's, at most CARRIED_PATHS."""
    every = [path for paths in gather_objects(mine[:CARRIED_PATHS], ctx) for path in paths]
    return (list(carried or []) + every)[:CARRIED_PATHS]


@dataclass
class ValResult:
    loss: float
    acc1: float
    acc5: float
    samples: int
    skipped_paths: list

    def to_dict(self) -> dict:
        return {"val_loss": self.loss, "val_acc1": self.acc1, "val_acc5": self.acc5, "val_samples": self.samples}


def train_one_epoch(*, state, progress, loader, ctx: DistContext, opts: LoopOptions,
                    stop: Callable[[], bool] = lambda: False, on_step: Optional[Callable] = None) -> TrainResult:
    """One pass over the training loader (device-ready batches) with ``state`` (an
    :class:`imagenet.training.state.TrainState`), from where ``progress`` (an
    :class:`imagenet.training.state.Progress`) says; returns the reduced metrics.

    Every ``opts.accum_steps`` loader batches (micro-batches) make one optimizer step: their
    gradients add up and, under DDP, are all-reduced once, with the last one (see
    :func:`_group_passes`); a group whose batches are all unreadable takes no optimizer step,
    but the schedule steps still, so it stays a function of the step index, as a resumed run
    computes it. Reports, checkpoints and stops come between optimizer steps (a report after
    each group that holds a multiple of ``opts.print_freq``). ``progress.step`` batches of
    the epoch were done before (the loader already skips them) and ``progress.sums`` holds
    their metric sums (over all ranks), so a resumed epoch reports the whole epoch. After each
    optimizer step ``on_step(batches_done_in_epoch, so_far)`` runs (mid-epoch checkpoints;
    ``so_far`` is a function returning the epoch's :class:`SoFar`, every rank calling it, and
    ``progress.skipped`` the paths a resumed epoch met before) and ``stop()`` may end the epoch early
    (preemption; the result then says ``completed=False``). ``state.ema`` follows every
    optimizer step; ``state.mixer`` turns batches into mixup/cutmix ones with soft labels.
    """
    precision, epoch, start_step, accum = state.precision, progress.epoch, progress.step, opts.accum_steps
    state.model.train()
    sums = DeviceSums(ctx.device)
    if progress.sums and ctx.is_main:  # counted once, on one rank: the totals are summed over ranks
        sums.seed(progress.sums)
    watch = NonfiniteWatch(opts.max_nonfinite_steps, precision.name, ctx)
    batch_time, data_time = AverageMeter(), AverageMeter()
    skipped_paths: list = []
    total = (start_step + len(loader)) // accum * accum  # a last incomplete group is dropped, like drop_last
    n = total if opts.max_steps is None else min(total, opts.max_steps)
    bar = _progress(loader, opts.progress == "bar" and ctx.is_main, f"Epoch {epoch}")
    steps, skipped_before, last_good, group = 0, precision.skipped_steps, None, []
    completed, done = True, start_step
    rate = SteadyRate(ctx.device, warm_steps=min(WARM_STEPS, (n - start_step) // accum // 5))
    start = end = time.perf_counter()
    rate.asking()
    for i, (images, targets, bad) in enumerate(loader, start=start_step):
        if i >= n:
            break
        done = i + 1  # batches of this epoch consumed, the unreadable ones included
        last_micro = done % accum == 0
        skipped_paths += bad
        if bad:
            sums.unreadable(len(bad))
        waited = time.perf_counter() - end
        data_time.update(waited)
        rate.add(targets.numel(), waited)
        images, targets, weight, last_good = _trainable(images, targets, bad, last_good, ctx, opts)
        if images is not None:
            group.append(_Pass(i, images, targets, weight))
        if last_micro and group:
            nonfinite = _group_passes(state, group, sums, epoch)
            _optimizer_step(state, first=steps == 0)
            watch.step(nonfinite)  # stops the run where the steps before had NaN/inf losses too often in a row
            steps, group = steps + 1, []
            rate.stepped(steps)
        elif last_micro:  # nothing readable in the group (outside DDP): no optimizer step, but the schedule's
            _schedule(state.scheduler, first=steps == 0)
        if done == n:  # the epoch's last step: before its checkpoint (on_step) and the validation
            _average_statistics(state, ctx)
        batch_time.update(time.perf_counter() - end)
        end = time.perf_counter()
        rate.asking()
        if bar is not None:
            bar.update(1)
        if not last_micro:
            continue  # a group's batches are trained on together, after its last one
        if i // opts.print_freq != (i - accum) // opts.print_freq or i == n - 1:
            avg = sums.totals(ctx, all_reduce_sum)
            if bar is not None:
                bar.set_postfix(loss=f"{avg['loss']:.4f}", acc1=f"{avg['acc1']:.2f}")
            elif ctx.is_main:
                logger.info(_line(f"Epoch: [{epoch}]", i, n, batch_time, data_time, sums.last_batch(), avg))
        if on_step is not None:
            on_step(i + 1, lambda: SoFar(sums.raw(ctx, all_reduce_sum),
                                         skipped_so_far(progress.skipped, skipped_paths, ctx)))
        if i + 1 < n and stop():
            completed = False
            break
    if bar is not None:
        bar.close()
    steady = rate.finish()
    elapsed = time.perf_counter() - start
    watch.finish()
    partial = sums.raw(ctx, all_reduce_sum)
    totals = means(partial)
    return TrainResult(loss=totals["loss"], acc1=totals["acc1"], acc5=totals["acc5"], samples=totals["count"],
                       steps=steps, skipped_steps=precision.skipped_steps - skipped_before,
                       img_per_s=steady.img_per_s * (ctx.world_size if ctx.distributed else 1),
                       data_wait_frac=steady.data_wait_frac, steady=steady, seconds=elapsed,
                       skipped_paths=skipped_paths, completed=completed, steps_done=done, sums=partial)


def _average_statistics(state, ctx: DistContext) -> None:
    """Under DDP each rank's BatchNorm statistics (and the weight average's, which follow them)
    come from its own batches. After the epoch's last optimizer step every rank sets them to
    their mean over the ranks, once: the checkpoint of that step, the model every rank validates
    and the epoch's checkpoint hold the same statistics, so -e on a checkpoint reproduces the
    epoch's Acc@1 and a run resumed at that step (it trains no more of the epoch) ends as an
    uninterrupted one. Mid-epoch nothing needs it: DDP hands rank 0's statistics to every rank
    at each forward pass, and those are what a checkpoint holds."""
    average_buffers(unwrap(state.model), ctx)
    if state.ema is not None:
        state.ema.average_statistics(ctx)


def _trainable(images, targets, bad: list, last_good: Optional[tuple], ctx: DistContext, opts: LoopOptions) -> tuple:
    """(images or None, targets, loss weight, the last good batch) for a loader batch.
    Unreadable files can empty a batch, or leave one image, which BatchNorm cannot train on
    when the last feature map is 1x1: such a batch is left out; under DDP, where the other ranks
    wait for this rank's gradients, it takes part as a zero-weight stand-in."""
    if targets.numel() == 0 or (targets.numel() == 1 and bad):
        if not ctx.distributed:
            return None, targets, 1.0, last_good
        images, targets = last_good or _stand_in_batch(opts.input_shape, ctx.device)
        return images, targets, 0.0, last_good
    return images, targets, 1.0, (images, targets)


class _Pass(NamedTuple):
    """One loader batch of an optimizer step's group, ready to train on."""

    index: int  # of the batch in the epoch
    images: torch.Tensor
    targets: torch.Tensor
    weight: float  # 1.0; 0.0 for a stand-in (DDP: the batch was unreadable)


def _group_passes(state, group: list, sums: DeviceSums, epoch: int) -> torch.Tensor:
    """The forward and backward passes of one optimizer step's batches (``_Pass``); under DDP
    the gradients are all-reduced with the last. Each loss is weighted by its batch's share of
    the images the group has, so the step follows their mean loss, as one batch of them would:
    unreadable files may shorten a batch or leave none. That share is known once the group's
    last batch is in, which is why the loop holds the group's batches until then (input
    batches, small beside the activations). Returns a device flag: a loss was NaN/inf."""
    present = sum(p.targets.numel() for p in group if p.weight)
    nonfinite = torch.zeros((), dtype=torch.bool, device=group[0].targets.device)
    for k, p in enumerate(group):
        share = p.weight * p.targets.numel() / present if present else 0.0
        loss, output = _forward_backward(state, p, share, sync=k == len(group) - 1, epoch=epoch)
        if p.weight:
            sums.add(loss, output, p.targets)
            nonfinite |= ~torch.isfinite(loss.detach())
    return nonfinite


def _forward_backward(state, p: _Pass, share: float, sync: bool, epoch: int) -> tuple:
    """One batch's forward and backward pass (mixed first, with ``state.mixer``, whose draws
    the epoch and the batch's index choose), its loss weighted by ``share``; under DDP the
    gradients are all-reduced only with ``sync``. Returns (the batch's mean loss, logits)."""
    images, labels, stand_in = p.images, p.targets, not p.weight
    if state.mixer is not None and not stand_in:
        images, labels = state.mixer(images, p.targets, epoch=epoch, batch=p.index)
    with _grad_sync(state.model, sync), _buffers_kept(state.model, keep=stand_in):
        output = state.precision.forward(state.model, images)
        loss = state.train_criterion(output, labels)
        state.precision.backward(loss * share)
    return loss, output


def _optimizer_step(state, first: bool) -> None:
    stepped = state.precision.step(state.optimizer)  # a device flag: False when the step was skipped
    if state.ema is not None:
        state.ema.update(stepped)
    _schedule(state.scheduler, first=first)


WARM_STEPS = 10  # optimizer steps of each epoch left out of its rate: compilation, cuDNN's search, workers' start


@dataclass
class Steady:
    """The steady part of an epoch, in this process: images, seconds and seconds spent waiting for input."""

    images: int = 0
    seconds: float = 0.0
    waited: float = 0.0

    def __add__(self, other: "Steady") -> "Steady":
        """These totals and another epoch's."""
        return Steady(self.images + other.images, self.seconds + other.seconds, self.waited + other.waited)

    @property
    def img_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_wait_frac(self) -> float:
        return min(self.waited / self.seconds, 1.0) if self.seconds > 0 else 0.0


class SteadyRate:
    """Times the training loop after its first ``warm_steps`` optimizer steps.

    The clock starts and stops after waiting for the device (twice an epoch, never per step), so
    the span holds exactly the steps' device work. The input wait is the time the device sat idle
    for want of the next batch: on a GPU, between an event recorded when the loop asks the loader
    for a batch (it completes when the previous step's work is done) and one recorded once the
    batch is there (after the waits for its copy or decode on the input streams). The host's own
    wait would overstate it wherever the device is still busy with queued work (CUDA graphs
    leave the host idle most of each step). The events are read once done, never waited for.
    On a CPU the device is the host: its wait for the loader.
    """

    def __init__(self, device: torch.device, warm_steps: int):
        self.device, self.warm = device, warm_steps
        self.totals = Steady()
        self.cuda = device.type == "cuda"
        self.asked: Optional[torch.cuda.Event] = None  # recorded when the loop asked for the batch
        self.gaps: collections.deque = collections.deque()  # (asked, arrived) events not yet read
        self.started: Optional[float] = self._sync() if warm_steps == 0 else None

    def _sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _event(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def asking(self) -> None:
        """The loop is about to ask the loader for its next batch."""
        if self.cuda and self.started is not None:
            self.asked = self._event()

    def add(self, images: int, waited: float) -> None:
        """A batch of ``images`` arrived after ``waited`` seconds (host time)."""
        if self.started is None:
            return
        self.totals.images += images
        if not self.cuda:
            self.totals.waited += waited
        elif self.asked is not None:
            self.gaps.append((self.asked, self._event()))
            self.asked = None
            while self.gaps and self.gaps[0][1].query():  # read the ones already done; never wait
                self._read(*self.gaps.popleft())

    def _read(self, asked, arrived) -> None:
        self.totals.waited += asked.elapsed_time(arrived) / 1000.0

    def stepped(self, steps: int) -> None:
        if steps == self.warm and self.started is None:
            self.started = self._sync()

    def finish(self) -> Steady:
        if self.started is None:  # an epoch (or a resumed remainder) shorter than the warm-up
            return self.totals
        self.totals.seconds = self._sync() - self.started
        while self.gaps:
            self._read(*self.gaps.popleft())
        return self.totals


def _grad_sync(model: nn.Module, sync: bool):
    """DDP's ``no_sync()`` for micro-batches whose gradients are still being accumulated."""
    ddp = ddp_of(model)
    return ddp.no_sync() if ddp is not None and not sync else contextlib.nullcontext()


def _schedule(scheduler, first: bool) -> None:
    if not first:
        scheduler.step()
        return
    with warnings.catch_warnings():
        # A skipped (overflowing) first step makes torch warn that the schedule runs ahead of
        # the optimizer; stepping it every iteration regardless is the intent.
        warnings.filterwarnings("ignore", message=_SCHEDULE_WARNING)
        scheduler.step()


@contextlib.contextmanager
def _buffers_kept(model: nn.Module, keep: bool):
    """With ``keep``, the model's buffers as they were before: a stand-in batch's forward pass
    (zero weight, there only for DDP's all-reduce) would otherwise update BatchNorm's running
    statistics and batch count with images that are not training data, or count a batch twice."""
    if not keep:
        yield
        return
    saved = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _stand_in_batch(shape: tuple, device: torch.device) -> tuple:
    # Two images, so BatchNorm in training mode has more than one value per channel.
    return torch.zeros((2, *shape), device=device), torch.zeros(2, dtype=torch.long, device=device)


class NonfiniteWatch:
    """``--max-nonfinite-steps``: counts the optimizer steps in a row with a NaN/inf loss (in any
    of their passes, on any rank) and stops the run once the count reaches the limit, a step late
    at most, without a host sync per step.

    The count stays on the device. Under DDP each step takes its maximum over the ranks (an
    all-reduce of one number, which NCCL queues without the host waiting), so that every rank
    stops at the same step instead of one waiting for the others. On a GPU each step's count is
    copied to pinned host memory behind an event; the next step reads it once the event is done:
    the host then waits at most for the previous step to finish while this one is queued, so the
    device never idles for it. On a CPU the count is read at once."""

    def __init__(self, limit: int, precision_name: str, ctx: DistContext):
        self.limit, self.precision_name, self.ctx = limit, precision_name, ctx
        self.run = torch.zeros((), dtype=torch.long, device=ctx.device)
        self.cuda = ctx.device.type == "cuda"
        self.pending: Optional[tuple] = None  # the last step's count on its way: (pinned tensor, event)
        if self.cuda and limit:
            # two of each, used in turn: one is being written while the other is read
            self.slots = [(torch.zeros((), dtype=torch.long, pin_memory=True), torch.cuda.Event()) for _ in range(2)]

    def step(self, nonfinite: torch.Tensor) -> None:
        """After an optimizer step; ``nonfinite``: its device flag, a pass's loss was NaN/inf."""
        self.run = (self.run + 1) * nonfinite
        if not self.limit:
            return
        worst = all_reduce_max(self.run.clone(), self.ctx)
        if not self.cuda:
            self._check(int(worst))
            return
        previous, (host, event) = self.pending, self.slots[0]
        host.copy_(worst, non_blocking=True)
        event.record()
        self.pending, self.slots = (host, event), self.slots[::-1]
        if previous is not None:
            self._read(previous)

    def finish(self) -> None:
        """The loop ended: read the last step's count."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._read(pending)

    def _read(self, pending: tuple) -> None:
        host, event = pending
        event.synchronize()
        self._check(int(host))

    def _check(self, run: int) -> None:
        if run >= self.limit:
            raise UserError(f"the loss was NaN/inf for {run} steps in a row ({self.precision_name}); "
                            "training is producing garbage: lower --lr, add --warmup-epochs, check the data, "
                            "or raise --max-nonfinite-steps (0 disables this check)")


@torch.no_grad()
def validate(*, model: nn.Module, loader, criterion: nn.Module, precision, ctx: DistContext,
             opts: LoopOptions, name: str = "", forward: Optional[Callable] = None) -> ValResult:
    """Evaluate every validation image once (each rank its shard); sums are reduced exactly.
    ``forward``: what makes a batch's logits from ``model`` in evaluation mode (the training
    state's ``evaluator``: flip averaging, compiled); default ``model`` itself."""
    # DDP's forward may talk to other ranks; shards differ in length, so evaluate the inner model
    # (the eager one when the DDP wrapper was compiled).
    ddp = ddp_of(model)
    net = ddp.module if ddp is not None else model
    net.eval()
    logits = forward if forward is not None else net
    sums = DeviceSums(ctx.device)
    batch_time = AverageMeter()
    skipped_paths: list = []
    n = len(loader) if opts.max_steps is None else min(len(loader), opts.max_steps)
    bar = _progress(loader, opts.progress == "bar" and ctx.is_main, "Test")
    end = time.perf_counter()
    for i, (images, targets, bad) in enumerate(loader):
        if i >= n:
            break
        skipped_paths += bad
        if targets.numel() == 0:
            continue
        output = precision.forward(logits, images)
        loss = criterion(output, targets)
        sums.add(loss, output, targets)
        batch_time.update(time.perf_counter() - end)
        end = time.perf_counter()
        if bar is not None:
            bar.update(1)
        elif ctx.is_main and (i % opts.print_freq == 0 or i == n - 1):
            # Per-rank numbers here: reducing would need every rank at the same step.
            logger.info(_line("Test: ", i, n, batch_time, None, sums.last_batch(), sums.totals()))
    if bar is not None:
        bar.close()
    totals = sums.totals(ctx, all_reduce_sum)
    if ctx.is_main:
        logger.info(f" * Acc@1 {totals['acc1']:.3f} Acc@5 {totals['acc5']:.3f}" + (f" ({name})" if name else ""))
    return ValResult(loss=totals["loss"], acc1=totals["acc1"], acc5=totals["acc5"], samples=totals["count"],
                     skipped_paths=skipped_paths)

