"""The phases of scripts/perf/gpu_verify.py, one module per subject.

common    running commands side by side, collecting their metrics, the shared tables
data      the data sets the phases train on, made once and reused (JPEG folder, Fashion-MNIST, shards)
checks    the test suites on the GPU machine and every mode for a few steps (smoke, suite)
accuracy  Acc@1 parity: precisions, multi-GPU modes, recipe variants, shrunk images (precision,
          multigpu, recipe, shrink)
speed     the training step's throughput: precision and layout, DP/DDP, scaling, the plain
          commands against an older tree (bench, scaling, defaults)
pipeline  the input pipelines from JPEGs, alone and end to end (jpeg, e2e)
decode    CPU against GPU decode per worker count and decoder, with the per-stage account (decode)
shards    tar shards against the folder they came from: speed and accuracy (shards)

A phase is a function ``phase(args)`` of the parsed options; gpu_verify.py's PHASES table names it.
"""
