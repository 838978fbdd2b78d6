"""Every private torch API the trainer relies on, each behind one function.

torch offers no public way to do these things without a host synchronisation per step (or at
all, for the scheduler), so the trainer uses them; keeping each behind one helper here means a
torch release that renames or changes one breaks one function, and tests/test_torch_private.py
names the attribute that moved.

* :func:`grad_scaler_scale` -- ``torch.amp.GradScaler._scale``, the scale as a device tensor.
* :func:`amp_update_scale_` -- ``torch._amp_update_scale_``, a dynamic loss scale updated on the device.
* :func:`amp_unscale_and_check_` -- ``torch._amp_foreach_non_finite_check_and_unscale_``.
* :func:`foreach_copy_` -- ``torch._foreach_copy_``, one multi-tensor copy.
* :func:`foreach_zero_` -- ``torch._foreach_zero_``, one multi-tensor fill with zeros.
* :func:`takes_found_inf` / :func:`step_skipping_on_device` -- an optimizer's
  ``_step_supports_amp_scaling`` and the ``found_inf`` / ``grad_scale`` attributes its
  ``step()`` reads (the fused kernels skip an overflowing step on the device).
* :func:`optimizer_grad_scale` / :func:`set_optimizer_grad_scale` -- the ``grad_scale`` attribute
  ``torch.amp.GradScaler.step`` sets on a fused optimizer for its ``step()`` to divide by.
* :func:`set_last_lr` -- ``LRScheduler._last_lr``, what ``get_last_lr()`` answers.
* :func:`inductor_tune_kernels` -- ``torch._inductor.config.coordinate_descent_tuning``.
* :func:`shared_bytes` -- ``torch.UntypedStorage._new_shared``, a tensor made in shared memory.
* :func:`shutdown_workers` -- ``DataLoader._iterator`` (what keeps persistent workers) and its
  ``_shutdown_workers()``.
* :func:`raise_recompile_limit` -- ``torch._dynamo.config.recompile_limit`` (``cache_size_limit``
  before torch 2.7), the graphs Dynamo keeps per function before it stops compiling it.
* :func:`compiled_graphs` -- ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``, the
  graphs Dynamo has compiled in this process.
"""

from __future__ import annotations

from typing import Optional

import torch


def grad_scaler_scale(scaler: torch.amp.GradScaler) -> Optional[torch.Tensor]:
    """The scaler's current scale as its 0-dim float32 device tensor (None before the first
    ``scale()``); reading it does not wait for the device, unlike ``get_scale()``."""
    return getattr(scaler, "_scale", None)


def amp_update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                      growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """In place on the device: ``scale *= backoff_factor`` and ``growth_tracker = 0`` if
    ``found_inf`` (1.0), else ``growth_tracker += 1`` and, once it reaches ``growth_interval``,
    ``scale *= growth_factor`` and ``growth_tracker = 0``."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)


def amp_unscale_and_check_(tensors: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply every tensor of ``tensors`` by ``inv_scale`` (a 1-element tensor) in place and set
    ``found_inf`` (a 1-element float tensor) to 1.0 if any value is inf or NaN; it is never reset."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def foreach_copy_(dst: list, src: list) -> None:
    """``d.copy_(s)`` for every pair, as one multi-tensor kernel where the lists allow it."""
    torch._foreach_copy_(dst, src)


def foreach_zero_(tensors: list) -> None:
    """``t.zero_()`` for every tensor, as one multi-tensor kernel where the list allows it."""
    torch._foreach_zero_(tensors)


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` reads ``optimizer.found_inf`` / ``grad_scale`` itself (torch's
    fused optimizers), so that a step flagged as overflowing is skipped on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_skipping_on_device(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` over already unscaled gradients, leaving the weights and the optimizer
    state alone if ``found_inf`` (a 1-element float tensor) is 1.0; nothing waits for the host.
    Only for an optimizer that :func:`takes_found_inf`."""
    optimizer.found_inf, optimizer.grad_scale = found_inf, None
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = optimizer.grad_scale = None


def optimizer_grad_scale(optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """The loss scale ``torch.amp.GradScaler.step`` handed ``optimizer`` for this ``step()`` (a
    device tensor its fused kernel divides the gradients by), or None: the gradients are unscaled."""
    return getattr(optimizer, "grad_scale", None)


def set_optimizer_grad_scale(optimizer: torch.optim.Optimizer, scale: Optional[torch.Tensor]) -> None:
    """Set what :func:`optimizer_grad_scale` answers (None: the step divides by nothing)."""
    optimizer.grad_scale = scale


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list) -> None:
    """Make ``scheduler.get_last_lr()`` answer ``lrs`` (after the learning rates were set by hand)."""
    scheduler._last_lr = lrs


def inductor_tune_kernels() -> None:
    """Make Inductor tune each kernel it generates from now on (this process): block sizes and
    warps by coordinate descent around its heuristic's choice, timed on the first calls."""
    import torch._inductor.config as inductor
    inductor.coordinate_descent_tuning = True


def shutdown_workers(loader: torch.utils.data.DataLoader) -> None:
    """End the loader's persistent worker processes now (they live as long as its iterator, which
    the loader keeps across epochs); the next iteration starts new ones. A loader without
    persistent workers, or whose workers are not started, is left as it is."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
        loader._iterator = None


def shared_bytes(n: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``n`` bytes in shared memory, to be filled in place: a
    worker's batch crosses to the training process by file descriptor, not copied.
    ``tensor.share_memory_()`` would copy the (uninitialised) bytes in once more."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))


def raise_recompile_limit(graphs: int) -> int:
    """Let Dynamo keep at least ``graphs`` compiled graphs per function (this process) before it
    gives up on the function and runs it uncompiled (torch's default: 8); never lowers the
    limit. Returns the limit in effect."""
    import torch._dynamo.config as dynamo
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    if getattr(dynamo, name) < graphs:
        setattr(dynamo, name, graphs)
    return getattr(dynamo, name)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (each new shape's, each part of a
    graph broken in two); a difference of two readings is what was compiled between them."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
