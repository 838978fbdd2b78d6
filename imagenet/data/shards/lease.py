"""Readers' leases on files a writer may delete, shared by the URL cache and the local shard folder.

A run holds a shared lock on one small file that stands for what it reads (a cached version of a
URL's data, one generation of a shard folder's index): :class:`Lease`. A writer deletes what such
a file stands for only while it holds the file exclusively (:func:`remove_unread`), so never what
a running job still reads. The system releases a lock when its process dies: a crashed run
holds nothing. On NFS, Linux takes these locks on the server, so they hold between machines too.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Callable, Optional

# what flock raises on a file system without locks (some NFS mounts, Lustre without -o flock)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class Lease:
    """A shared lock on ``path``, held until :meth:`close` or the process's end. ``create``: make
    the file if it is absent (a cache this process writes), else open it read-only (a data folder
    the run may not write to)."""

    def __init__(self, path: str, create: bool = True):
        self.lock_path = path
        self._fh: Optional[object] = open(path, "a" if create else "r")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_SH)  # waits only while a writer is deleting it
        except BaseException:
            self._fh.close()
            raise

    @property
    def removed(self) -> bool:
        """Whether a writer deleted the file (and what it stands for) before the lock was taken."""
        return self._fh is not None and os.fstat(self._fh.fileno()).st_nlink == 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()  # releases the lock
            self._fh = None


def remove_unread(path: str, remove: Callable[[], None]) -> Optional[bool]:
    """Call ``remove`` while holding ``path`` exclusively, if no :class:`Lease` holds it: True when
    it ran, False when a run holds the file, None when this file system cannot tell (no locks)."""
    try:
        with open(path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a run holds it
            remove()
            return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in NO_LOCKS:
            return None
        raise
