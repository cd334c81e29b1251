"""The cluster's shared token: read from a file only its owner may open, or created as such a file."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dashrun.errors import UsageError

__all__ = ["MIN_TOKEN_LEN", "read_token", "write_token"]

MIN_TOKEN_LEN = 16


def read_token(path: str | os.PathLike) -> bytes:
    """The cluster's shared token from a file (surrounding whitespace ignored).

    Refused when group or others may read or write the file, as ssh refuses a
    private key they could read: anyone who can read the token can log in to
    dash-memd, and anyone who can write it can make a node trust another one.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot read token file {path}: {e.strerror}",
                         hint="create one with: dash-memd token --out FILE") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode  # of the file read, not of whatever the path names later
        # Only a file at rest: a pipe (--token-file <(vault read ...)) holds the token in transit only.
        if stat.S_ISREG(mode) and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"token file {path} is open to group or others (mode {stat.S_IMODE(mode):04o})",
                             hint=f"chmod 600 {path}")
        try:
            token = f.read().strip()
        except OSError as e:
            raise UsageError(f"cannot read token file {path}: {e.strerror}",
                             hint="create one with: dash-memd token --out FILE") from None
    if len(token) < MIN_TOKEN_LEN:
        raise UsageError(f"token in {path} is shorter than {MIN_TOKEN_LEN} characters",
                         hint="create a strong one with: dash-memd token --out FILE")
    return token


def write_token(path: str | os.PathLike) -> bytes:
    """Create a new random token file readable by its owner only; never overwrite one."""
    path = Path(path)
    token = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return token
