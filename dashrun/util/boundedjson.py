"""JSON from anyone but ourselves, parsed only once its nesting depth is known to be small.

``json.loads`` recurses once per level of nesting, in C, on the calling
thread's stack. Python 3.13 lets C code recurse as deep as the main
thread's stack allows, not 1000 levels as before, so 4 KiB of ``[`` parsed on
a thread with a smaller stack kill the process with SIGSEGV instead of
raising ``RecursionError``. So everything a peer, a file on disk or a bucket
hands us goes through :func:`loads_bounded`, which measures the depth with a
flat scan first (strings, escapes included, are skipped so that brackets
inside them do not count) and refuses anything deeper than ``max_depth``
before the parser sees it. The frames, manifests and specs dashrun writes are a
handful of levels deep, so 64 is plenty; a state's layout description mirrors
the state's own nesting and gets a bound of its own
(:data:`dashrun.wire.layout.MAX_META_DEPTH`).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_DEPTH", "check_depth", "loads_bounded"]

#: Deepest nesting of arrays and objects accepted in any JSON dashrun reads.
MAX_DEPTH = 64

# A JSON string as the parser lexes it: a quote, then anything but a quote or a backslash,
# or a backslash and the character it escapes, up to the closing quote. Written as an
# unrolled loop, so the regex engine runs in linear time on strings of any length.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise ValueError if ``text`` nests arrays and objects deeper than ``max_depth`` (without parsing it).

    Never under-counts what the parser would reach: a string that does not
    close (invalid JSON anyway) leaves its brackets counted.
    """
    if text.count("[") + text.count("{") <= max_depth:
        return  # the common case, at the speed of str.count
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
        else:
            depth -= 1


def loads_bounded(text: str | bytes | bytearray | memoryview, max_depth: int = MAX_DEPTH, **kwargs) -> Any:
    """``json.loads`` of UTF-8 ``text`` after :func:`check_depth`; ValueError for anything malformed."""
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8")  # UnicodeDecodeError is a ValueError
    check_depth(text, max_depth)
    return json.loads(text, **kwargs)
