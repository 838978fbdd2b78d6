"""The command line's entry (``main.py``): flags, recipe and the launch environment's variables
(RANK, WORLD_SIZE, SLURM's) parsed and checked before torch is imported, so that ``--help``, a
mistyped flag or a bad value answers in a tenth of a second instead of the five that importing
torch and torchvision takes; then the process's environment (:mod:`imagenet.base.processenv`,
read when torch and CUDA start) and :func:`imagenet.training.runner.execute`.
"""

import os
from typing import Optional

from .base.config import parse_config
from .base.errors import UserError, user_error
from .base.launchenv import distributed_env
from .base.paths import default_cache_dir
from .base.processenv import ProcessEnv, set_process_env


def prepare_process(cfg) -> ProcessEnv:
    """The environment every training process needs before torch is imported."""
    return set_process_env(os.environ, cache_root=str(cfg.cache_dir or default_cache_dir()))


def main(argv: Optional[list] = None) -> int:
    """Parse, then run; user errors become one line and exit status 2."""
    try:
        cfg = parse_config(argv)
        distributed_env(cfg)  # read again, and acted on, once torch is up
    except UserError as e:
        return user_error(e)
    env = prepare_process(cfg)
    from .training.runner import execute  # imports torch
    return execute(cfg, env)
