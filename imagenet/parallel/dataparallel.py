"""DataParallel whose replicas run in threads that live as long as the model.

torch's ``parallel_apply`` starts a new thread per replica for every forward. cuDNN's execution
plans, and with ``cudnn.benchmark`` the result of the algorithm search, are cached per thread in
PyTorch (pytorch/pytorch#103939), so every DataParallel forward began with a cold cache and ran
the search again: ResNet-50 fp16 trained at 150 img/s on two H200 against 6,000 on one
(``scripts/perf/bench.py train``; docs/BENCHMARKS.md, DataParallel). Here each GPU's replica always
runs in the same worker thread, so the search happens once per GPU, as on a single GPU.

The replicas' module objects are also kept (:class:`ReplicaCache`): torch's ``replicate`` makes a
shallow copy of every module for every GPU on every forward (~320 for ResNet-50 on two GPUs),
Python work on the one thread that drives all GPUs. Here the copies are made once; each forward
only broadcasts the weights and buffers and puts the new tensors into the same replicas.
Everything else -- scatter, the broadcast, gather, the backward pass in autograd's own device
threads -- is torch's DataParallel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel.replicate import _broadcast_coalesced_reshape, replicate


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


class ReplicaCache:
    """The replica modules of one network on a list of devices, made once and refilled per call.

    ``__call__`` returns what ``torch.nn.parallel.replicate`` returns -- one replica per device
    whose parameters are the (differentiable, unless ``detach``) broadcast copies of the
    network's -- but reuses the module objects while the network's modules, parameters and
    buffers are the same objects as at the last build.
    """

    def __init__(self):
        self._key = None
        self._roots: list = []
        self._modules: list = []  # (network module, [its replica on each device])
        self._params: list = []  # (replica index j, replica module, attribute name, param index)
        self._buffers: list = []  # (replica index j, replica module, buffer name, buffer index)

    def __call__(self, network: nn.Module, devices: Sequence[int], detach: bool) -> list:
        modules = list(network.modules())
        params = list(network.parameters())
        buffers = list(network.buffers())
        key = (tuple(devices), tuple(map(id, modules)), tuple(map(id, params)), tuple(map(id, buffers)))
        if key != self._key:
            self._build(network, devices, modules, params, buffers)
            self._key = key
        param_copies = _broadcast_coalesced_reshape(params, devices, detach)
        # As torch's replicate: buffers that require grad stay differentiable unless detached.
        rg = [b.requires_grad and not detach for b in buffers]
        rg_copies = _broadcast_coalesced_reshape([b for b, r in zip(buffers, rg) if r], devices, detach)
        plain_copies = _broadcast_coalesced_reshape([b for b, r in zip(buffers, rg) if not r], devices, True)
        rg_index, plain_index, k_rg, k_plain = [], [], 0, 0
        for r in rg:  # each buffer's position in its own group
            rg_index.append(k_rg if r else -1)
            plain_index.append(-1 if r else k_plain)
            k_rg, k_plain = k_rg + r, k_plain + (not r)
        for j, replica, name, idx in self._params:
            replica.__dict__[name] = param_copies[j][idx]
            replica._former_parameters[name] = param_copies[j][idx]
        for j, replica, name, idx in self._buffers:
            replica._buffers[name] = rg_copies[j][rg_index[idx]] if rg[idx] else plain_copies[j][plain_index[idx]]
        for module, copies in self._modules:  # train()/eval() since the build
            for replica in copies:
                replica.training = module.training
        return list(self._roots)

    def _build(self, network, devices, modules, params, buffers) -> None:
        # torch's own replicate makes the module tree; record where each tensor goes.
        replicas = replicate(network, devices, detach=True)
        copies_of = {id(network): replicas}
        trees = [list(r.modules()) for r in replicas]
        for i, module in enumerate(modules):
            copies_of[id(module)] = [tree[i] for tree in trees]
        p_index = {id(p): k for k, p in enumerate(params)}
        b_index = {id(b): k for k, b in enumerate(buffers)}
        self._modules, self._params, self._buffers = [], [], []
        for module in modules:
            copies = copies_of[id(module)]
            self._modules.append((module, copies))
            for j, replica in enumerate(copies):
                for name, p in module._parameters.items():
                    if p is not None:
                        self._params.append((j, replica, name, p_index[id(p)]))
                for name, b in module._buffers.items():
                    if b is not None:
                        self._buffers.append((j, replica, name, b_index[id(b)]))
        self._roots = replicas


class DataParallel(nn.DataParallel):
    """:class:`torch.nn.DataParallel` with persistent per-GPU worker threads (see the module doc)."""

    def replicate(self, module, device_ids):
        cache = self.__dict__.get("_replica_cache")
        if cache is None:
            cache = self.__dict__["_replica_cache"] = ReplicaCache()
        return cache(module, [torch.device(d).index if not isinstance(d, int) else d for d in device_ids],
                     detach=not torch.is_grad_enabled())

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
        state.pop("_replica_cache", None)
        return state
