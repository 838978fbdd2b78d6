"""Checkpoints: atomic writes, safe reads (``weights_only=True``), RNG state capture.

A checkpoint is a plain dict of tensors and Python primitives, so it loads without unpickling
arbitrary objects. Writes go to a temporary file in the same folder, are flushed to disk, and
then renamed over the old file: a crash at any moment leaves either the old or the new
checkpoint, never a torn one; ``model_best.pth.tar``, when the latest epoch is the best, is a
copy of that file's bytes, made and renamed into place the same way (a file of its own, so a
user who rewrites it in place, e.g. to strip the optimizer for release, leaves the resumable
checkpoint alone). The checkpoint it replaces stays on as ``checkpoint.prev.pth.tar``, so a
latest file damaged afterwards (a truncated copy, a disk or file system fault) still has one to
fall back to: :func:`resolve_resume` checks each candidate's zip CRCs (torch.load itself reads a
flipped byte without complaint) and takes the newest intact one.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import tempfile
import zipfile
from typing import Optional

import numpy as np
import torch

from .errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pth.tar"
PREVIOUS = "checkpoint.prev.pth.tar"  # the checkpoint before the latest: --resume auto's fallback
BEST = "model_best.pth.tar"
FORMAT_VERSION = 1


def _remove_stale(folder: str, prefix: str) -> None:
    """Delete temp files named ``prefix*`` that a writer killed mid-save left behind."""
    for stale in os.listdir(folder):
        if stale.startswith(prefix):
            try:
                os.unlink(os.path.join(folder, stale))
            except OSError:
                pass


def atomic_save(obj: dict, path: str, previous: Optional[str] = None) -> None:
    """``torch.save`` to ``path`` atomically; on failure the previous file is untouched.

    With ``previous``, the file ``path`` held until now becomes ``previous`` (a hard link, or a
    copy where the file system has none) just before the new one takes its place, so ``path``
    itself is never missing."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = ".tmp-" + os.path.basename(path) + "."
    _remove_stale(folder, prefix)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide checkpoints from the group
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if previous is not None and os.path.isfile(path):
            _keep_as(path, previous)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)  # make the renames themselves durable


def _keep_as(path: str, previous: str, link: bool = True) -> None:
    """Make ``previous`` a second name of ``path`` (a copy of its bytes where the file system has
    no hard links, or with ``link=False``), atomically; ``path`` stays."""
    folder = os.path.dirname(os.path.abspath(previous))
    prefix = ".tmp-" + os.path.basename(previous) + "."
    _remove_stale(folder, prefix)
    tmp = os.path.join(folder, f"{prefix}{os.getpid()}")
    try:
        if not (link and _hard_link(path, tmp)):
            shutil.copyfile(path, tmp)
            _fsync_file(tmp)  # the bytes on disk before the name: a crash leaves the old file or this one
        os.replace(tmp, previous)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _hard_link(path: str, name: str) -> bool:
    """Whether ``name`` could be made a second name of ``path`` (some network and FUSE mounts
    have no hard links)."""
    try:
        os.link(path, name)
        return True
    except OSError:
        return False


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save_checkpoint(state: dict, output_dir: str, is_best: bool) -> str:
    """Write ``checkpoint.pth.tar`` (and ``model_best.pth.tar`` when ``is_best``); the checkpoint
    it replaces becomes ``checkpoint.prev.pth.tar``.

    ``model_best.pth.tar`` is a copy of the checkpoint file just written, read back from it (one
    more write, only when the best improves), never a second name of it: people rewrite
    model_best in place (to strip the optimizer for a release), and a hard link would rewrite the
    checkpoint that ``--resume auto`` reads. A model_best that is still such a link (a folder
    written by an older version of the trainer) gets a file of its own before the next save."""
    path = os.path.join(output_dir, CHECKPOINT)
    best = os.path.join(output_dir, BEST)
    try:
        if not is_best and os.path.isfile(best) and os.path.isfile(path) and os.path.samefile(best, path):
            _keep_as(best, best, link=False)
        atomic_save(state, path, previous=os.path.join(output_dir, PREVIOUS))
        if is_best:
            _keep_as(path, best, link=False)
            _fsync_folder(output_dir)
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


def damage(path: str) -> Optional[str]:
    """Why the checkpoint file ``path`` cannot be read back whole, or None when it can.

    torch.save writes a zip archive: a truncated file has no central directory, and every
    stored record carries a CRC32 that a flipped byte breaks (torch.load does not check them:
    a corrupt tensor would load silently). Reading the CRCs costs one pass over the file and
    unpickles nothing. A file in torch's older, non-zip format gets a full safe load instead.
    """
    try:
        if not zipfile.is_zipfile(path):
            try:
                read_checkpoint(path)
            except UserError:
                return "truncated, or not a PyTorch checkpoint"
            return None
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return f"record {bad} fails its CRC check: the file is corrupt" if bad else None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as e:
        return f"truncated or corrupt ({type(e).__name__}: {e})"


def resolve_resume(resume: str, output_dir: str, restarted: bool = False) -> Optional[str]:
    """The checkpoint to resume from, or None to start fresh.

    ``auto`` means the newest intact checkpoint of the output dir, when there is one:
    ``checkpoint.pth.tar``, else (unreadable, with a warning naming both) the one before it,
    ``checkpoint.prev.pth.tar``. ``restarted`` says this process was restarted after a failure
    by an elastic launcher (``python -m multiproc --max-restarts N``, torchrun): it then resumes
    as ``auto`` does, with or without ``--resume``, so the group continues where it was; a
    ``--resume PATH`` it was started with counts only while the output dir has no checkpoint yet.
    """
    if restarted:
        found = _newest_intact(output_dir, "a restarted process (after a failure in the group)")
        if found:
            logger.warning("=> restarted after a failure in the process group: resuming from the newest "
                           "checkpoint, %s", found)
            return found
        if resume and resume != "auto":
            return resolve_resume(resume, output_dir)
        logger.warning("=> restarted after a failure in the process group, before any checkpoint was "
                       "written in %s: starting over", output_dir)
        return None
    if not resume:
        return None
    if resume == "auto":
        found = _newest_intact(output_dir, "--resume auto")
        if found is None:
            logger.info("--resume auto: no %s in %s yet; starting fresh", CHECKPOINT, output_dir)
        return found
    if not os.path.exists(resume):
        raise UserError(f"--resume {resume}: no such file (use --resume auto to resume only if "
                        f"{os.path.join(output_dir, CHECKPOINT)} exists)")
    return resume


def _newest_intact(output_dir: str, who: str) -> Optional[str]:
    """The newest checkpoint of ``output_dir`` that reads back whole; None when there is none.
    A damaged latest one is passed over for the one before it, with a warning; none intact is a
    UserError."""
    latest = os.path.join(output_dir, CHECKPOINT)
    if not os.path.isfile(latest):
        return None  # a removed latest means "start fresh", not "take the one before"
    candidates = [p for p in (latest, os.path.join(output_dir, PREVIOUS)) if os.path.isfile(p)]
    problems = []
    for path in candidates:
        why = damage(path)
        if why is None:
            if problems:
                logger.warning("=> warning: %s cannot be read (%s); %s falls back to the checkpoint before it, "
                               "%s", problems[0][0], problems[0][1], who, path)
            return path
        problems.append((path, why))
    if problems:
        listed = "; ".join(f"{p}: {why}" for p, why in problems)
        raise UserError(f"{who}: no readable checkpoint in {output_dir} ({listed}); move the damaged "
                        "file(s) away to start fresh, or give --resume PATH of an intact copy")
    return None


def require_keys(ckpt: dict, path: str, keys: tuple) -> None:
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise UserError(f"{path} is not a training checkpoint of this trainer (no {', '.join(missing)}); "
                        "to start from its weights use --weights instead of --resume")
