"""Every Triton kernel of imagenet/kernels, compiled for an H100/H200 (sm_90) and an A100 (sm_80)
down to its machine code on this machine, GPU or not, through the trainer's own launch code.

On a CPU the other tests run the kernels' Python under Triton's interpreter, which accepts code
the compiler refuses; the GPU tests, which compile them, run only where a GPU is lent. Triton
compiles for another machine's target here (ptxas ships with it), so this test launches each
kernel as the trainer does, on CPU tensors, with every launch compiling for the target instead of
running: the kernels' generated code is checked in CI. The outputs are not computed, so nothing
here checks values (the interpreter and GPU tests do)."""

import concurrent.futures
import contextlib
import importlib
import inspect
import os
import pkgutil
import re

import pytest
import torch
import torch.nn as nn

import imagenet.kernels as kernels

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - an older Triton
    pytest.skip("this Triton cannot compile for another machine's target", allow_module_level=True)

POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
           torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


@contextlib.contextmanager
def recording_launches():
    """Every ``kernel[grid](...)`` in the block launches nothing; yields the list its launches are
    recorded in, each as (kernel, signature, constexprs, options): its arguments' types as the
    signature, its constexprs as given."""
    launches = []
    real = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip([p.name for p in self.params], args), **kwargs)
        signature, constexprs = {}, {}
        for p in self.params:
            value = bound.get(p.name)
            if p.is_constexpr or value is None:
                signature[p.name], constexprs[p.name] = "constexpr", value
            else:
                signature[p.name] = _type(value)
        launches.append((self, signature, constexprs, options))

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = real


def compile_all(launches: list, capabilities) -> dict:
    """Each distinct launch compiled for each CUDA compute capability (90: sm_90), its cubin
    checked: capability -> {kernel name: None, or the error it compiled with}. Compiled in threads:
    ptxas and Triton's passes let go of the GIL, so two threads take half the time of one."""
    distinct = {(fn.__name__, repr(sig), repr(const), repr(opts)): (fn, sig, const, opts)
                for fn, sig, const, opts in launches}

    def build(job) -> tuple:
        capability, (fn, sig, const, opts) = job
        try:
            out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                 target=GPUTarget("cuda", capability, 32), options=opts)
            return capability, fn.__name__, None if out.asm.get("cubin") else "no cubin"
        except Exception as e:  # reported by the capability's test, with the kernel's name
            return capability, fn.__name__, f"{type(e).__name__}: {e}"

    results = {c: {} for c in capabilities}
    jobs = [(c, launch) for c in capabilities for launch in distinct.values()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        for capability, name, error in pool.map(build, jobs):
            if results[capability].get(name) is None:  # a kernel's first error stands; a success adds it
                results[capability][name] = error
    return results


def _launched_kernels() -> set:
    """The kernels imagenet/kernels launches (``NAME[grid](...)``), not the jit helpers they call."""
    modules = [importlib.import_module(f"imagenet.kernels.{info.name}")
               for info in pkgutil.iter_modules(kernels.__path__)]
    source = "".join(inspect.getsource(m) for m in modules)
    jitted = {n for m in modules for n, v in vars(m).items() if isinstance(v, JITFunction)}
    return {n for n in jitted if re.search(rf"\b{n}\[", source)}


def _batchnorm(dtypes) -> None:
    from imagenet.kernels import fusedbn
    cl = dict(memory_format=torch.channels_last)
    for dtype in dtypes:
        def t():
            return torch.randn(2, 8, 3, 3).to(dtype).contiguous(**cl).requires_grad_(True)
        sums = (torch.ones(8), torch.ones(8))
        for residual, relu, shortcut, fork, with_sums in ((False, False, False, False, False),
                                                          (True, True, False, False, False),
                                                          (True, True, True, False, False),
                                                          (True, True, True, True, False),
                                                          (True, True, True, False, True),
                                                          (False, True, False, False, True)):
            x, r = t(), t()
            bn, rbn = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
            y = fusedbn.bn_act(x, bn, r if residual else None, relu, fork=fork,
                               residual_bn=(rbn, sums if with_sums else None) if shortcut else None,
                               **({"sums": sums} if with_sums else {}))
            outputs = list(y) if fork else [y]
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        fusedbn._statistics(t(), nn.BatchNorm2d(8), sums)


def _maxpool(dtypes) -> None:
    from imagenet.kernels import maxpool
    for dtype in dtypes:
        x = torch.randn(2, 8, 9, 9).to(dtype).contiguous(memory_format=torch.channels_last)
        y, idx = maxpool.stem_maxpool(x)
        maxpool.stem_maxpool_backward(torch.ones_like(y), idx, 9, 9)


def _master_step() -> None:
    from imagenet.kernels import masterstep
    for dtype, lars in ((torch.float16, False), (torch.bfloat16, False), (torch.float16, True)):
        masters = [torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last), torch.randn(5)]
        weights = [nn.Parameter(m.to(dtype)) for m in masters]
        for w in weights:
            w.grad = torch.ones_like(w)
        opt = torch.optim.SGD([{"params": masters, **({"lars": True, "eta": 0.001, "eps": 0.0} if lars else {})}], lr=0.1,
                              momentum=0.9, weight_decay=1e-4)
        for m in masters:
            opt.state[m]["momentum_buffer"] = torch.zeros_like(m)
        step = masterstep.MasterStep(opt, weights, masters)
        assert step(torch.zeros(1), torch.ones(1)) is None, step(torch.zeros(1), torch.ones(1))


def _geometry() -> None:
    from imagenet.kernels import gpugeometry as G
    images = [torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8)]
    out = torch.zeros(1, 16, 16, 3, dtype=torch.uint8)
    G.crop_resize_flip(images, [G.Sampling.train((0, 0, 20, 30), 16)], [True], [0], out)


CAPABILITIES = {90: "sm90-H100-H200", 80: "sm80-A100"}


@pytest.fixture(scope="module")
def compiled() -> dict:
    """The kernels launched as the trainer launches them, compiled for every capability at once."""
    from imagenet.kernels import fusedbn, maxpool
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fusedbn, "_INTERPRETED", True)  # take the kernels on CPU tensors: here they only compile
        mp.setattr(maxpool, "_INTERPRETED", True)
        with recording_launches() as launches:
            _batchnorm((torch.float16, torch.bfloat16, torch.float32))
            _maxpool((torch.float16, torch.bfloat16, torch.float32))
            _master_step()
            _geometry()
    return compile_all(launches, CAPABILITIES)


@pytest.mark.parametrize("capability", list(CAPABILITIES), ids=list(CAPABILITIES.values()))
def test_every_kernel_compiles_for_the_gpu_through_its_launch_code(compiled, capability):
    errors = {name: error for name, error in compiled[capability].items() if error}
    assert not errors, errors
    assert set(compiled[capability]) == _launched_kernels(), (sorted(compiled[capability]),
                                                              sorted(_launched_kernels()))
