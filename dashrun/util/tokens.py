"""The cluster's shared token: read from a file, or created as a new one readable by its owner only."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dashrun.errors import UsageError

__all__ = ["MIN_TOKEN_LEN", "read_token", "write_token"]

MIN_TOKEN_LEN = 16


def read_token(path: str | os.PathLike) -> bytes:
    """The cluster's shared token from a file (surrounding whitespace ignored)."""
    path = Path(path)
    try:
        token = path.read_bytes().strip()
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
