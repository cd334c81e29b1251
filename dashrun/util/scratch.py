"""Private folders in the temporary directory that a process killed outright does not leave behind for good.

The launcher keeps its job's credential and dash-agent's socket in folders of
its own under ``$TMPDIR``, removed as it exits. SIGKILL, the OOM killer or a
node's scheduler give it no chance to: each folder holds a lock file its maker
keeps locked for its life (``flock``; the kernel lets go of a dead process's
locks, whatever its pid namespace), and the next folder made with the same
prefix removes those whose lock nobody holds. A folder without the lock file,
or another user's, is never touched.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

__all__ = ["Scratch", "sweep"]

LOCK_NAME = ".held"
#: A folder younger than this may be one whose maker has not taken its lock yet: left alone.
GRACE_S = 5.0


class Scratch:
    """A new 0700 folder under ``$TMPDIR`` named ``prefix…``, held until :meth:`remove`; made after a
    :func:`sweep` of the folders of the same prefix that dead processes left."""

    def __init__(self, prefix: str):
        sweep(prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._lock: int | None = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # not inherited: a child that outlives this process holds nothing

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def sweep(prefix: str, grace_s: float = GRACE_S) -> list[Path]:
    """Remove this user's folders ``$TMPDIR/prefix…`` whose maker died (their lock is free); those removed."""
    removed = []
    now, uid = time.time(), os.getuid()
    for name in glob.glob(glob.escape(os.path.join(tempfile.gettempdir(), prefix)) + "*"):
        folder = Path(name)
        try:
            info = folder.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or now - info.st_mtime < grace_s:
                continue
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or no lock file: not one of these folders
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its maker is alive
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(folder)
    return removed
