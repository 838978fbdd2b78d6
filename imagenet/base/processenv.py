"""Environment variables the trainer sets for its own process before torch is imported.

Two settings are read once, when a library starts, so they must be in the environment before
torch (and torchvision, which imports parts of torch's compiler) are imported:

* ``CUDA_DEVICE_MAX_CONNECTIONS``: CUDA spreads a process's streams over this many hardware
  work queues (8 unless set; at most 32), read when the CUDA context is created. With 8, the
  ``--decode gpu`` stream's work shared a queue with the step's CUDA-graph replay and waited
  behind it; with 32 it runs beside the step (docs/INPUT.md, "GPU decode").
* ``TORCHINDUCTOR_CACHE_DIR``: where Inductor keeps compiled kernels between runs. Importing
  torchvision fills it with torch's default (``/tmp``, often emptied at a reboot or private to
  one job), so a later default of ours would never apply.

A value the user set is kept. :func:`set_process_env` is called by the command line's entry
before it imports torch, so every launch mode (``main.py``, ``python -m multiproc``'s workers,
torchrun, SLURM tasks, ``--multiprocessing-distributed``'s children, which inherit it) gets it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import MutableMapping, Optional

MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
MAX_CONNECTIONS_VALUE = "32"  # CUDA's largest: every stream of the process gets a queue of its own
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class ProcessEnv:
    """What :func:`set_process_env` found and did: ``ours`` the variables it set, ``users`` the
    ones it left as the user had them."""

    ours: dict = field(default_factory=dict)
    users: dict = field(default_factory=dict)

    def connections(self) -> Optional[str]:
        """The hardware queue count the CUDA context is created with (None: CUDA's default, 8)."""
        return self.ours.get(MAX_CONNECTIONS) or self.users.get(MAX_CONNECTIONS)


def inductor_cache_dir(cache_root: str) -> str:
    """Inductor's cache folder under the trainer's cache root (``--cache-dir``)."""
    return os.path.join(cache_root, "inductor")


def set_process_env(environ: MutableMapping[str, str], *, cache_root: str) -> ProcessEnv:
    """Set the variables of the module's docstring in ``environ`` where the user did not; call
    before torch is imported (a second call in the same process changes nothing it set)."""
    wanted = {MAX_CONNECTIONS: MAX_CONNECTIONS_VALUE, INDUCTOR_CACHE: inductor_cache_dir(cache_root)}
    ours, users = {}, {}
    for name, value in wanted.items():
        if environ.get(name):
            users[name] = environ[name]
        else:
            environ[name] = ours[name] = value
    return ProcessEnv(ours, users)
