"""Sizes and addresses as users write them."""

from __future__ import annotations

import re

from dashrun.errors import UsageError

__all__ = ["format_size", "parse_address", "parse_size"]

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(i?))?B?\s*", re.IGNORECASE)
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str | int) -> int:
    """``"48GiB"`` -> bytes, in the usual units: ``KiB``, ``MiB``, ``GiB``, ... are powers of 1024 (``Gi``
    too); ``kB``, ``MB``, ``GB``, ... are powers of 1000 (``G`` too); a bare number is bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    if not match:
        raise UsageError(f"not a size: {text!r}", hint="write it like 48GiB, 512MiB, 40GB or 1073741824")
    number, unit, binary = match.groups()
    if unit is None:
        return int(float(number))
    return int(float(number) * ((1024 if binary else 1000) ** _POWERS[unit.upper()]))


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
