"""What ``dashrun status`` and ``dashrun ls`` are shown of dash-memd's jobs: bounded summaries, a page at a time.

A LIST request gets one page of job summaries (:meth:`dashrun.memd.server.MemdServer._list`), in job-id
order after the request's ``after`` (or one job alone), so that paging is stable while jobs commit: a job
is listed once, never skipped, whatever changes meanwhile. A page holds at most ``limit`` summaries and
what fits the server's byte budget; the reader sorts them as it likes (``dashrun status``: newest first).

A summary is bounded whatever the job's history, so that a page stays well inside MAX_BODY however many
jobs, nodes or checkpoints there are: it names the :data:`LIST_NODES` nodes that sent a shard most
recently, lists the newest :data:`LIST_CHECKPOINTS` checkpoints and :data:`LIST_RECEIVING` steps being
received, and leaves out a launch spec longer than :data:`LIST_SPEC_BYTES`; what it leaves out it counts
(``nodes_more``, ``checkpoints_more``, ``receiving_more``, ``spec_bytes``). Per job, dash-memd remembers
the :data:`KEEP_NODES` nodes that sent it a shard most recently, and only nodes whose shard it took.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Sequence

from dashrun.wire.protocol import encode_body

__all__ = ["KEEP_NODES", "LIST_CHECKPOINTS", "LIST_NODES", "LIST_RECEIVING", "LIST_SPEC_BYTES", "node_seen",
           "page", "summary"]

#: Nodes remembered per job: those that sent a shard most recently (the least recent beyond are forgotten).
KEEP_NODES = 1024
#: Nodes a summary names, the most recent; ``nodes_more`` counts the others remembered.
LIST_NODES = 64
#: Checkpoints a summary lists, the newest; ``checkpoints_more`` counts the older ones.
LIST_CHECKPOINTS = 256
#: Steps being received a summary lists, the newest; ``receiving_more`` counts the others.
LIST_RECEIVING = 64
#: A launch spec longer than this as JSON is left out of a summary (``spec_bytes`` says its length): GET_SPEC
#: (``dashrun resume --dry-run``) reads it whole.
LIST_SPEC_BYTES = 64 << 10


def node_seen(nodes: dict[str, float], node: str, when: float) -> None:
    """Note in a job's ``nodes`` (node -> when it last sent a shard, the least recent first) that ``node`` sent
    one at ``when``; beyond KEEP_NODES the least recent is forgotten."""
    nodes.pop(node, None)
    nodes[node] = when
    if len(nodes) > KEEP_NODES:
        del nodes[next(iter(nodes))]


def page(names: Sequence[str], after: str | None, limit: int) -> tuple[Sequence[str], bool]:
    """The at most ``limit`` job ids of sorted ``names`` that follow ``after`` (from the first if None), and
    whether more follow them."""
    start = bisect.bisect_right(names, after) if after is not None else 0
    chosen = names[start:start + limit]
    return chosen, start + len(chosen) < len(names)


def summary(job: str, *, checkpoints: list[dict[str, Any]], receiving: list[int], nodes: dict[str, float],
            spec: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """A job's summary, bounded (see the module's text): its ``checkpoints`` (oldest first) and ``receiving``
    steps (sorted), its ``nodes`` (as :func:`node_seen` keeps them), its launch ``spec`` (as a body) and the
    other ``fields`` as they are (each of a bounded size)."""
    listed = checkpoints[-LIST_CHECKPOINTS:]
    recent = dict(reversed(list(itertools.islice(reversed(nodes.items()), LIST_NODES))))
    spec_bytes = len(encode_body(spec)) if spec else 0
    out = {"job": job, "newest": listed[-1] if listed else None, "checkpoints": listed,
           "receiving": receiving[-LIST_RECEIVING:], "nodes": recent,
           "spec": spec if spec_bytes <= LIST_SPEC_BYTES else None, **fields}
    # What was left out, counted where something was: an ordinary job's summary is as it always was.
    for name, more in (("checkpoints_more", len(checkpoints) - len(listed)),
                       ("receiving_more", len(receiving) - LIST_RECEIVING),
                       ("nodes_more", len(nodes) - len(recent))):
        if more > 0:
            out[name] = more
    if spec_bytes > LIST_SPEC_BYTES:
        out["spec_bytes"] = spec_bytes
    return out
