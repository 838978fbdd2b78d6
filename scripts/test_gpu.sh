#!/usr/bin/env bash
# The GPU tests, and only those, in one call on one GPU: `pytest -m gpu`, the tests a CPU run skips
# for want of a GPU (tests/gpumarks.py; the CPU suite is scripts/test.sh). Exits 2 at once, with
# one line, where no CUDA GPU is visible; else with pytest's status. Extra arguments go to pytest.
#
# Estimates for one H200 (16 cores) with empty compile caches, about 3-4 minutes in all (seconds;
# --durations prints the real ones). The main.py runs of tests/gpuruns.py start with the session and
# compile beside the tests before theirs, so tests/test_gpu_runs.py mostly reads their results:
#   tests/gpuruns.py runs       ~90  beside the rest: one process and two DDP processes sharing the
#                                    GPU in fp32 (they must agree), the two in fp16, --amp --compile default
#   tests/test_fusedbn.py       ~60  the BatchNorm kernels against torch, seven children at once
#   tests/test_gpu.py           ~40  fp16 masters, host-free steps, CUDA-graph training against eager
#   tests/test_maxpool.py       ~20  the stem max-pool kernels, eager and inside torch.compile
#   tests/test_masterstep.py    ~15  --fp16's optimizer step's kernels against torch's arithmetic
#   tests/test_processenv.py    ~10  CUDA_DEVICE_MAX_CONNECTIONS in the CUDA context
#   tests/test_convstats.py    ~120  cuDNN's convolution + statistics against torch, in a CUDA graph, in
#                                    the family's blocks eager (bottleneck, basic, grouped) and compiled
#                                    (skipped without nvidia-cudnn-frontend)
#   tests/test_cropbatch.py, test_gpudecode.py, test_gpugeometry.py, test_pipeline.py,
#   test_throughput.py, test_gpu_runs.py ~35  GPU resize and nvJPEG decode against PIL, loaders on
#                                    the device, the runs' results
# Tests that need two GPUs (DataParallel) skip on one. The performance lab (scripts/perf) measures
# speed and runs ResNet-50 under every --compile mode (gpu_verify.py suite).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# The interpreter: $PYTHON, else the checkout's .venv (scripts/setup_env.sh), else python3.
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3
fi
probe='import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'
if ! gpus=$("$PY" -c "$probe" 2>/dev/null); then
  echo "test_gpu.sh: $PY cannot import torch; set PYTHON to the interpreter that has the trainer's requirements" >&2
  exit 2
fi
if [ "${gpus:-0}" -lt 1 ]; then
  echo "test_gpu.sh: no CUDA GPU is visible to $PY (check CUDA_VISIBLE_DEVICES); the CPU tests are scripts/test.sh" >&2
  exit 2
fi
# Caches in a throwaway folder: the trainer's exports, Inductor's and Triton's compilations (shared
# by the tests' processes, so a kernel one of them compiled is not compiled again), removed at the end.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export IMAGENET_TRAINER_CACHE="$scratch/trainer" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" \
       TRITON_CACHE_DIR="$scratch/triton" NCCL_NVLS_ENABLE=0
per_test=()
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
  per_test=(--timeout 240)  # a hung test fails with its stack; the slowest, with its fixture, takes ~90 s
else
  echo "test_gpu.sh: pytest-timeout is not installed: a hung test holds the call until it ends" >&2
fi
"$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --durations=25 ${per_test[@]+"${per_test[@]}"} tests "$@"
