"""The command line's entry (``main.py``): flags and recipe parsed and checked before torch is
imported, so that ``--help``, a mistyped flag or a bad value answers in a tenth of a second
instead of the five that importing torch and torchvision takes; then :func:`imagenet.runner.execute`.
"""

import sys
from typing import Optional

from .config import parse_config
from .errors import EXIT_USER_ERROR, UserError


def user_error(e: UserError) -> int:
    """A user's mistake: one line on stderr, exit status 2."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def main(argv: Optional[list] = None) -> int:
    """Parse, then run; user errors become one line and exit status 2."""
    try:
        cfg = parse_config(argv)
    except UserError as e:
        return user_error(e)
    from .runner import execute  # imports torch
    return execute(cfg)
