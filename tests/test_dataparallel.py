"""DataParallel with persistent per-GPU threads: the worker pool on the CPU (the GPU path is in
tests/test_gpu.py)."""

import copy
import pickle
import sys
import threading

import pytest
import torch
import torch.nn as nn

from imagenet.parallel.dataparallel import DataParallel, ReplicaWorkers


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
    (threads, argument passing, grad mode carried into the worker) runs for real; autocast's
    carrying over is checked on GPUs (tests/test_gpu.py)."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    seen = []

    class Probe(nn.Module):
        def forward(self, x, y=None, *, scale=1):
            seen.append((threading.get_ident(), torch.is_grad_enabled()))
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


# -- the replica cache: module copies made once, tensors refilled every forward ------------------
# Broadcasting needs GPUs; here a fake "broadcast" to two devices clones the tensors (through
# autograd unless detached), so the cache's bookkeeping can be checked against torch's replicate.

def _fake_broadcast(tensors, devices, detach):
    if detach:
        return [[t.detach().clone() for t in tensors] for _ in devices]
    return [[t * 1.0 for t in tensors] for _ in devices]  # differentiable copies


@pytest.fixture
def fake_gpus(monkeypatch):
    import imagenet.parallel.dataparallel as dp
    torch_replicate = sys.modules["torch.nn.parallel.replicate"]  # the module, not the function
    monkeypatch.setattr(torch_replicate, "_broadcast_coalesced_reshape", _fake_broadcast)
    monkeypatch.setattr(dp, "_broadcast_coalesced_reshape", _fake_broadcast)
    return dp.ReplicaCache


def _net():
    torch.manual_seed(0)
    shared = nn.ReLU()
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), shared,
                         nn.Sequential(nn.Conv2d(4, 4, 1), shared), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def test_cached_replicas_match_torchs_replicate(fake_gpus):
    from torch.nn.parallel.replicate import replicate
    net = _net()
    x = torch.randn(2, 3, 8, 8)
    ours, theirs = fake_gpus()(net, [0, 1], detach=False), replicate(net, [0, 1])
    for a, b in zip(ours, theirs):
        assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
        assert torch.equal(a(x), b(x))


def test_cache_reuses_modules_and_refills_weights_buffers_and_mode(fake_gpus):
    net, cache = _net(), fake_gpus()
    x = torch.randn(2, 3, 8, 8)
    first = cache(net, [0, 1], detach=False)
    modules_before = [list(r.modules()) for r in first]
    with torch.no_grad():
        net[0].weight.add_(1.0)
        net[1].running_mean.fill_(0.5)
    net.eval()
    second = cache(net, [0, 1], detach=True)
    assert [list(r.modules()) for r in second] == modules_before  # the same objects
    for r in second:
        assert not any(m.training for m in r.modules())
        assert torch.equal(r[0].weight, net[0].weight) and torch.equal(r[1].running_mean, net[1].running_mean)
        assert torch.equal(r(x), net(x))


def test_gradients_flow_back_to_the_network_through_cached_replicas(fake_gpus):
    net, cache = _net(), fake_gpus()
    x = torch.randn(2, 3, 8, 8)
    for _ in range(2):  # the second forward goes through the reused replicas
        net.zero_grad()
        sum(r(x).sum() for r in cache(net, [0, 1], detach=False)).backward()
    expected = copy.deepcopy(net)
    expected.zero_grad()
    (2 * expected(x).sum()).backward()
    for p, q in zip(net.parameters(), expected.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_a_changed_network_rebuilds_the_replicas(fake_gpus):
    net, cache = _net(), fake_gpus()
    first = cache(net, [0, 1], detach=True)
    net[3][0] = nn.Conv2d(4, 4, 1)  # a new module and new parameters
    second = cache(net, [0, 1], detach=True)
    assert second[0] is not first[0]
    assert torch.equal(second[0][3][0].weight, net[3][0].weight)
