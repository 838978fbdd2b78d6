"""DataParallel whose replicas run in threads that live as long as the model.

torch's ``parallel_apply`` starts a new thread per replica for every forward. cuDNN's execution
plans, and with ``cudnn.benchmark`` the result of the algorithm search, are cached per thread in
PyTorch (pytorch/pytorch#103939), so every DataParallel forward began with a cold cache and ran
the search again: ResNet-50 fp16 trained at 150 img/s on two H200 against 6,000 on one
(docs/BENCHMARKS.md, run B). Here each GPU's replica always runs in the same worker thread, so
the search happens once per GPU, as on a single GPU. Everything else -- scatter, replicate,
gather, the backward pass in autograd's own device threads -- is torch's DataParallel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn


class ReplicaWorkers:
    """One long-lived worker thread per replica slot; ``run`` calls ``fns[i]`` on thread ``i``."""

    def __init__(self, n: int):
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dp-replica-{i}") for i in range(n)]

    def __len__(self) -> int:
        return len(self._pools)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list:
        """Results in order; if any raised, the first error is raised after all have finished."""
        futures = [pool.submit(fn) for pool, fn in zip(self._pools, fns)]
        errors = [f.exception() for f in futures]  # waits for every replica, even after a failure
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False)


def _autocast_dtype() -> torch.dtype:
    get = getattr(torch, "get_autocast_dtype", None)  # torch >= 2.4
    return get("cuda") if get is not None else torch.get_autocast_gpu_dtype()


class DataParallel(nn.DataParallel):
    """:class:`torch.nn.DataParallel` with persistent per-GPU worker threads (see the module doc)."""

    def parallel_apply(self, replicas, inputs, kwargs):
        n = len(replicas)
        if n == 1:
            return super().parallel_apply(replicas, inputs, kwargs)
        workers = self.__dict__.get("_replica_workers")
        if workers is None:
            workers = self.__dict__["_replica_workers"] = ReplicaWorkers(len(self.device_ids))
        kwargs = kwargs if kwargs is not None else ({},) * n
        devices = self.device_ids[:n]
        streams = [torch.cuda.current_stream(d) for d in devices]
        # Thread-local modes the replicas must inherit from the caller's thread.
        grad, amp, amp_dtype = torch.is_grad_enabled(), torch.is_autocast_enabled(), _autocast_dtype()

        def job(module, args, kw, device, stream):
            def call():
                with torch.set_grad_enabled(grad), torch.cuda.device(device), torch.cuda.stream(stream), \
                        torch.autocast("cuda", enabled=amp, dtype=amp_dtype):
                    return module(*(args if isinstance(args, (list, tuple)) else (args,)), **kw)
            return call

        return workers.run([job(*a) for a in zip(replicas, inputs, kwargs, devices, streams)])

    def __getstate__(self):
        # Threads cannot be copied or pickled; a copy starts its own on first use.
        state = self.__dict__.copy()
        state.pop("_replica_workers", None)
        return state
