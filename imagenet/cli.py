"""The command line's entry (``main.py``): flags and recipe parsed and checked before torch is
imported, so that ``--help``, a mistyped flag or a bad value answers in a tenth of a second
instead of the five that importing torch and torchvision takes; then :func:`imagenet.training.runner.execute`.
"""

from typing import Optional

from .base.config import parse_config
from .base.errors import UserError, user_error


def main(argv: Optional[list] = None) -> int:
    """Parse, then run; user errors become one line and exit status 2."""
    try:
        cfg = parse_config(argv)
    except UserError as e:
        return user_error(e)
    from .training.runner import execute  # imports torch
    return execute(cfg)
