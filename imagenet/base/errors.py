"""The one exception type for problems a user can fix (flags, paths, data, checkpoints, backends).

Entry points catch :class:`UserError`, print its message on one line and exit with status 2,
so a user never sees a traceback for a mistake they can correct.
"""

import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user caused and can fix; the message names the problem and the fix."""

    def __str__(self) -> str:  # one line, always
        return " ".join(super().__str__().split())


def user_error(e: UserError) -> int:
    """A user's mistake: one line on stderr; returns the exit status, 2."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
