"""Whether our Triton kernels can run here (:func:`available`), asked by every kernel module that
compiles for the training GPU."""

import os

import torch

try:  # Triton ships with CUDA builds of torch
    import triton
except ImportError:  # pragma: no cover - a torch without Triton
    triton = None


def available() -> bool:
    """Whether the kernels can run: Triton and a CUDA GPU it compiles for (compute capability 7.0
    or later, as Inductor requires), or Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 7
