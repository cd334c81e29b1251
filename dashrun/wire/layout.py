"""The layout of a checkpoint's bytes, and its version: every writer and reader of a shard goes through here.

A shard (one saved rank's part of a step) is, in this order:

1. its slice ``[rep_start, rep_end)`` of the replicated state — the state every
   rank holds alike, laid out once for the whole world (``rep_total`` bytes,
   each leaf at an :data:`ALIGN`-byte offset) and cut into ``world`` slices at
   aligned points (:func:`split`);
2. its private part (``private_len`` bytes): its own leaves (per-rank objects,
   RNG states, module buffers), then its pieces of sharded state, the last
   ``pieces_len`` bytes, each leaf aligned;
3. its description (``meta_len`` bytes), compact JSON with its keys in this
   order (:func:`encode`)::

       {"format": FORMAT, "step": S, "rank": R, "world": W,
        "replicated": {"tree": ..., "tensors": [...], "total": rep_total, ["sharded": [...]]} (rank 0; else null),
        "private": {"tree": ..., "tensors": [...], ["pieces": [[leaf, offsets, sizes, at], ...]]},
        ["dcp": {...}]}  (written by dashrun.dcp.Writer, whose own "format" versions that part)

``tree`` is a state dict's skeleton and ``tensors`` where each leaf lies, as
:mod:`dashrun.rank.statetree` writes them (torch's dtypes, so that side stays
with the rank); the :class:`~dashrun.wire.messages.ShardHeader` announces the
lengths, and the replicated description's bytes (:func:`replicated_part`) are
what its layout digest is taken of.

A committed checkpoint laid out in one buffer — a node's restore image, an
export (:func:`image_tails`) — is the replicated state first, then each saved
rank's tail (its private part and description) at an aligned offset.

:data:`FORMAT` changes with any of this. Every reader decodes a description
through :func:`decode`, which refuses one of another format with one line.
"""

from __future__ import annotations

import json
from typing import Any

from dashrun.errors import ProtocolError, UsageError
from dashrun.util.boundedjson import loads_bounded
from dashrun.wire.messages import CheckpointInfo

__all__ = ["ALIGN", "FORMAT", "MAX_META_DEPTH", "align", "decode", "description_in", "encode", "image_tails",
           "private_part", "replicated_part", "split"]

#: Version of the layout (of every part above); a reader refuses any other.
FORMAT = 1
#: Every leaf starts at a multiple of this many bytes (a cache line), and so does each tail in an image.
ALIGN = 64
#: Deepest nesting accepted in a description. It mirrors the state dict's own nesting (up to three levels per
#: level of it, where types JSON lacks are tagged), and the rank that wrote it walked the state recursively, so
#: Python's recursion limit stopped it well short of this: any state that saved restores.
MAX_META_DEPTH = 2048


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def split(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's [start, end) of ``total`` replicated bytes; cut points aligned."""
    def cut(r: int) -> int:
        return min(total, align(total * r // world))
    return cut(rank), cut(rank + 1)


def _json(value: Any) -> bytes:
    # Keys in their order, never sorted: state dicts are ordered, and restore gives them back as they were.
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def replicated_part(tree: Any, tensors: list[Any], total: int, sharded: list[Any] | None = None) -> bytes:
    """The description of the replicated state (``sharded``: each sharded leaf's [dtype, shape], if any), as it
    appears in saved rank 0's description; every rank's layout digest is the SHA-256 of these bytes."""
    part: dict[str, Any] = {"tree": tree, "tensors": tensors, "total": total}
    if sharded:
        part["sharded"] = sharded
    return _json(part)


def private_part(tree: Any, tensors: list[Any], pieces: list[Any] | None = None) -> dict[str, Any]:
    """The description of a rank's private part (``pieces``: where its pieces of sharded state lie, if any)."""
    part: dict[str, Any] = {"tree": tree, "tensors": tensors}
    if pieces:
        part["pieces"] = pieces
    return part


def encode(*, step: int, rank: int, world: int, private: dict[str, Any], replicated: bytes | None = None,
           dcp: dict[str, Any] | None = None) -> bytes:
    """A shard's description: ``replicated`` is :func:`replicated_part`'s bytes (rank 0 carries them, every
    rank holding the same), put in as they are rather than encoded again."""
    head = _json({"format": FORMAT, "step": step, "rank": rank, "world": world})[:-1]  # the object goes on
    parts = [head, b',"replicated":', b"null" if replicated is None else replicated, b',"private":',
             _json(private)]
    if dcp is not None:
        parts += [b',"dcp":', _json(dcp)]
    return b"".join(parts) + b"}"


def decode(raw: bytes | bytearray | memoryview, what: str, max_depth: int = MAX_META_DEPTH) -> dict[str, Any]:
    """The description in ``raw`` (``what`` names its shard in errors), checked: of this :data:`FORMAT`, and its
    parts where readers look for them. UsageError for another format; ProtocolError for anything malformed."""
    try:
        description = loads_bounded(raw, max_depth)
    except ValueError as e:
        raise ProtocolError(f"{what}: unreadable description: {e}") from None
    version = description.get("format") if isinstance(description, dict) else None
    if type(version) is not int:
        raise ProtocolError(f"{what}: the description names no layout format")
    if version != FORMAT:
        newer = version > FORMAT
        raise UsageError(f"{what} is in layout format {version}; this dashrun reads format {FORMAT}",
                         hint="it was written by a newer dashrun: upgrade dashrun to read it" if newer else
                         "it was written by an older dashrun: read it with that version")
    replicated, private = description.get("replicated"), description.get("private")
    if not (replicated is None or _is_part(replicated)) or not _is_part(private):
        raise ProtocolError(f"{what}: malformed description")
    return description


def _is_part(part: Any) -> bool:
    return isinstance(part, dict) and "tree" in part and isinstance(part.get("tensors"), list)


def image_tails(info: CheckpointInfo) -> tuple[list[int], int]:
    """(offset of each saved rank's tail, total size) of the image of ``info``."""
    tails, position = [], align(info.rep_total)
    for shard in info.shards:
        tails.append(position)
        position = align(position + shard.private_len + shard.meta_len)
    return tails, position


def description_in(image, info: CheckpointInfo, tails: list[int], rank: int) -> dict[str, Any]:
    """The description saved rank ``rank`` wrote (rank 0's also describes the replicated state), from the image
    of ``info`` whose tails are at ``tails``; decoded and checked by :func:`decode`."""
    shard = info.shards[rank]
    start = tails[rank] + shard.private_len
    description = decode(image[start:start + shard.meta_len],
                         f"saved rank {rank}'s shard of {info.job} step {info.step}")
    if rank == 0 and description["replicated"] is None:
        raise ProtocolError(f"saved rank 0's shard of {info.job} step {info.step} does not describe the "
                            "replicated state")
    return description
