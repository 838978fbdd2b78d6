"""DataParallel with persistent per-GPU threads: the worker pool on the CPU (the GPU path is in
tests/test_gpu.py)."""

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

from imagenet.dataparallel import DataParallel, ReplicaWorkers


def test_each_slot_always_runs_on_its_own_thread():
    workers = ReplicaWorkers(3)
    seen = [workers.run([threading.get_ident] * 3) for _ in range(4)]
    assert all(s == seen[0] for s in seen)  # the same three threads every call
    assert len(set(seen[0])) == 3 and threading.get_ident() not in seen[0]
    workers.close()


def test_results_come_back_in_order():
    workers = ReplicaWorkers(3)
    assert workers.run([lambda i=i: i * 10 for i in range(3)]) == [0, 10, 20]
    workers.close()


def test_an_error_in_one_replica_is_raised_after_all_have_finished():
    workers = ReplicaWorkers(2)
    finished = threading.Event()

    def slow():
        finished.wait(0.2)
        finished.set()
        return 1

    def bad():
        raise ValueError("replica 0 failed")

    with pytest.raises(ValueError, match="replica 0 failed"):
        workers.run([bad, slow])
    assert finished.is_set()
    assert workers.run([lambda: 1, lambda: 2]) == [1, 2]  # the pool survives a failed step
    workers.close()


def test_the_wrapper_can_be_copied_and_pickled_without_its_threads():
    dp = DataParallel(nn.Linear(2, 2))  # without CUDA, torch's DataParallel just holds the module
    dp.__dict__["_replica_workers"] = ReplicaWorkers(2)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert "_replica_workers" not in clone.__dict__
        assert torch.equal(clone.module.weight, dp.module.weight)
    dp.__dict__["_replica_workers"].close()


def test_parallel_apply_passes_inputs_kwargs_and_the_callers_modes(monkeypatch):
    """DataParallel.parallel_apply without GPUs: the CUDA context managers become no-ops, the rest
    (threads, argument passing, grad mode and autocast carried into the worker) runs for real."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    seen = []

    class Probe(nn.Module):
        def forward(self, x, y=None, *, scale=1):
            seen.append((threading.get_ident(), torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"),
                         torch.get_autocast_dtype("cuda")))
            return (x + (0 if y is None else y)) * scale

    dp = DataParallel(nn.Identity())
    dp.device_ids = [0, 1]  # as if two GPUs were visible
    replicas = [Probe(), Probe()]
    with torch.no_grad():
        out = dp.parallel_apply(replicas, [(torch.ones(2), torch.ones(2)), torch.zeros(2)],
                                [{"scale": 3}, {}])
    assert torch.equal(out[0], torch.full((2,), 6.0)) and torch.equal(out[1], torch.zeros(2))
    assert [s[1] for s in seen] == [False, False]  # no_grad reached the workers
    out = dp.parallel_apply(replicas, [torch.ones(1), torch.ones(1)], None)
    assert [s[1] for s in seen[2:]] == [True, True]
    assert {s[0] for s in seen[:2]} == {s[0] for s in seen[2:]}  # the same two threads again
    with pytest.raises(NotImplementedError):  # a replica's error reaches the caller
        dp.parallel_apply([Probe(), nn.Module()], [torch.ones(1), torch.ones(1)], None)  # Module has no forward
