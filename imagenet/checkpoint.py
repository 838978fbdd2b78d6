"""Checkpoints: atomic writes, safe reads (``weights_only=True``), RNG state capture.

A checkpoint is a plain dict of tensors and Python primitives, so it loads without unpickling
arbitrary objects. Writes go to a temporary file in the same folder, are flushed to disk, and
then renamed over the old file: a crash at any moment leaves either the old or the new
checkpoint, never a torn one.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import tempfile
from typing import Optional

import numpy as np
import torch

from .errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
FORMAT_VERSION = 1


def atomic_save(obj: dict, path: str) -> None:
    """``torch.save`` to ``path`` atomically; on failure the previous file is untouched."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = ".tmp-" + os.path.basename(path) + "."
    for stale in os.listdir(folder):  # left by a writer that was killed mid-save
        if stale.startswith(prefix):
            try:
                os.unlink(os.path.join(folder, stale))
            except OSError:
                pass
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide checkpoints from the group
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save_checkpoint(state: dict, output_dir: str, is_best: bool) -> str:
    """Write ``checkpoint.pth.tar`` (and ``model_best.pth.tar`` when ``is_best``)."""
    path = os.path.join(output_dir, CHECKPOINT)
    try:
        atomic_save(state, path)
        if is_best:
            atomic_save(state, os.path.join(output_dir, BEST))
    except (OSError, RuntimeError) as e:
        # torch.save reports a full disk as a RuntimeError from its zip writer, the OSError inside.
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        reason = cause.strerror or str(cause)
        raise UserError(f"could not write a checkpoint in {output_dir} ({reason}); the previous "
                        "checkpoint is intact: free disk space or choose a writable --output-dir")
    return path


def read_checkpoint(path: str) -> dict:
    """Load a checkpoint or state dict safely; anything else is a UserError naming the file."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} does not exist")
    if os.path.isdir(path):
        raise UserError(f"checkpoint path {path} is a folder; give the .pth.tar file inside it")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"{path} was refused by the safe loader: it holds code or objects other than "
                        f"tensors and plain values ({_refusal_reason(e)}); nothing in it was run. Only "
                        "checkpoints written by this trainer or torch.save(state_dict) are loaded")
    except Exception as e:
        raise UserError(f"{path} is not a readable PyTorch checkpoint (truncated, corrupt or another "
                        f"format: {type(e).__name__})")
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a checkpoint or state dict")
    return obj


def _refusal_reason(e: Exception) -> str:
    """The line of torch's refusal that names the blocked global (not its generic preamble)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "blocked" in line:
            return line[:200]
    return (lines[-1] if lines else type(e).__name__)[:200]


def capture_rng() -> dict:
    """Python, NumPy, torch CPU and CUDA generator states, as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Optional[dict]) -> None:
    if not state:
        return
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def resolve_resume(resume: str, output_dir: str) -> Optional[str]:
    """The checkpoint to resume from: ``auto`` means the output dir's, when there is one."""
    if not resume:
        return None
    if resume == "auto":
        path = os.path.join(output_dir, CHECKPOINT)
        if os.path.isfile(path):
            return path
        logger.info("--resume auto: no %s in %s yet; starting fresh", CHECKPOINT, output_dir)
        return None
    if not os.path.exists(resume):
        raise UserError(f"--resume {resume}: no such file (use --resume auto to resume only if "
                        f"{os.path.join(output_dir, CHECKPOINT)} exists)")
    return resume


def require_keys(ckpt: dict, path: str, keys: tuple) -> None:
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise UserError(f"{path} is not a training checkpoint of this trainer (no {', '.join(missing)}); "
                        "to start from its weights use --weights instead of --resume")
