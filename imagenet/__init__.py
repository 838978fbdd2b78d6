"""ImageNet reference trainer: ResNets on ImageFolder data in fp32, fp16 or autocast, on CPU, GPU,
DataParallel or DDP.

The packages are layers; a module imports only from its own layer's package and the layers
below it (``tests/test_layering.py`` checks it with import-linter's contract in ``.importlinter``):

=========  ====================================================================================
cli        the command line's entry: flags checked before torch is imported, then training.runner
launch     ``python -m multiproc``: one process per GPU on torch's elastic agent (imports no training code)
training   a run: wiring (runner), the loops (engine), the state and its checkpoints, the run log
data       datasets (folders, tar shards, synthetic), decoding on CPU and GPU, samplers, loaders, prefetch
parallel   launch modes (DistContext), DDP/DataParallel, reductions, spawn, stop signals
models     the architecture registry, starting weights, torch.compile
precision  fp32 / fp16 with master weights / autocast behind one interface; the optimizer
kernels    Triton kernels as torch.library ops, each with a torch fallback
base       config, errors, metrics, checkpoint file I/O, wrappers, private torch APIs
=========  ====================================================================================

data, parallel, models and precision are one layer: none of them imports another.
"""

__version__ = "0.1.0"
