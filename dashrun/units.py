"""Sizes, addresses and tokens as users write them."""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from dashrun.errors import UsageError

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str | int) -> int:
    """``"48GiB"`` -> bytes. Accepts K/M/G/T/P with or without ``i`` (both binary, as RAM is) and ``B``."""
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    if not match:
        raise UsageError(f"not a size: {text!r}", hint="write it like 48GiB, 512MiB or 1073741824")
    number, unit, _ = match.groups()
    return int(float(number) * (1024 ** _POWERS[unit.upper()]))


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_address(text: str, *, default_port: int | None = None, what: str = "address") -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``"host"`` (with a default port) -> (host, port)."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        host, port = text, ""
    host = host.strip("[]")
    if not port:
        if default_port is None:
            raise UsageError(f"{what} {text!r} has no port", hint="write it as HOST:PORT, e.g. 10.0.0.5:7070")
        return host or "127.0.0.1", default_port
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what} {text!r} has an invalid port", hint="write it as HOST:PORT, e.g. 10.0.0.5:7070")
    return host or "127.0.0.1", int(port)


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
