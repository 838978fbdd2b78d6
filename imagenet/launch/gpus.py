"""What the launcher finds out about this node without importing torch (which is slow to
import): the GPUs a child would see, and the variables it adds to every child's environment."""

import os
import shutil
import subprocess


def visible_gpu_count():
    """Number of GPUs CUDA would show a child, found without importing torch when possible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return count_cuda_visible_devices(visible)
    count = _nvidia_smi_gpu_count()
    if count is not None:
        return count
    try:  # last resort: torch is slow to import
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def count_cuda_visible_devices(value):
    """Count the devices in CUDA_VISIBLE_DEVICES as CUDA does: up to the first invalid entry."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # "" hides all GPUs; "-1" ends the list
            break
        count += 1
    return count


def _nvidia_smi_gpu_count():
    """GPUs listed by ``nvidia-smi -L``, or None when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def launcher_env(environ, nproc_per_node):
    """Variables the launcher adds to its own environment, which every child inherits."""
    extra = {}
    # NVLink multicast (NVLS) stays off unless the user sets NCCL_NVLS_ENABLE: on shared hosts a program
    # using it can take the GPUs out of service for others; the all-reduces here do not need it.
    if "NCCL_NVLS_ENABLE" not in environ:
        extra["NCCL_NVLS_ENABLE"] = "0"
    if "OMP_NUM_THREADS" not in environ and nproc_per_node > 1:
        extra["OMP_NUM_THREADS"] = "1"  # torchrun's default: N processes would oversubscribe the cores
    return extra
