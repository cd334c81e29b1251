"""Crash points for fault-injection tests: a process kills itself at a named place.

``DASH_CRASH_AT`` holds ``name[@key=value,...]`` specs separated by ``;``.
When code reaches ``crash_point(name, **context)`` and a spec names it, with
every ``key=value`` matching the context, the process SIGKILLs itself there
— exactly what a crash at that point does. ``nth=N`` fires only the N-th
time the spec matches in this process; ``once=PATH`` fires only if PATH does
not exist yet (and creates it), so a restarted process passes on.
Unset, a crash point costs one dictionary lookup.

Points: ``rank.staging`` (half the background copy done), ``rank.handoff``
(snapshot handed to the agent, reply not yet read), ``channel.mid_data``
(first chunk of a data frame sent), ``disk.mid_write`` (first shard file
written, manifest not), ``disk.before_rename`` (all written, not yet renamed
into place), ``disk.mid_replace`` (a new attempt at a step on disk swapped in,
the old one not yet removed; without RENAME_EXCHANGE: the old one moved aside,
the new one not yet in place).
"""

from __future__ import annotations

import os
import signal

from dashrun import env

__all__ = ["crash_point"]

_SPECS: dict[str, list[dict[str, str]]] = {}
for _spec in filter(None, (env.get(env.CRASH_AT) or "").split(";")):
    _name, _, _conditions = _spec.strip().partition("@")
    _SPECS.setdefault(_name, []).append(dict(c.split("=", 1) for c in _conditions.split(",") if "=" in c))


_MATCHES: dict[int, int] = {}


def crash_point(name: str, **context) -> None:
    for conditions in _SPECS.get(name, ()):
        marker = conditions.get("once")
        if any(str(context.get(k)) != v for k, v in conditions.items() if k not in ("once", "nth")):
            continue
        _MATCHES[id(conditions)] = seen = _MATCHES.get(id(conditions), 0) + 1
        if "nth" in conditions and str(seen) != conditions["nth"]:
            continue
        if marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        os.kill(os.getpid(), signal.SIGKILL)
