"""A committed checkpoint laid out in one buffer, as ranks (and exports) read it.

Layout: the replicated state first (``rep_total`` bytes, every rank's slice
in place), then each saved rank's tail — its private tensors and its layout
description — at a 64-byte aligned offset. The agent fetches into a memfd
that every local rank maps; ``dashrun export`` reads into memory (both
through :mod:`dashrun.wire.planner`).
"""

from __future__ import annotations

from typing import Any

from dashrun.util.boundedjson import loads_bounded
from dashrun.wire.messages import CheckpointInfo

__all__ = ["MAX_META_DEPTH", "layout", "meta"]

_ALIGN = 64
#: Deepest nesting accepted in a layout description. It mirrors the state dict's own nesting (up to three
#: levels per level of it, where types JSON lacks are tagged), and the rank that wrote it walked the state
#: recursively, so Python's recursion limit stopped it well short of this: any state that saved restores.
MAX_META_DEPTH = 2048


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(info: CheckpointInfo) -> tuple[list[int], int]:
    """(offset of each saved rank's tail, total size) of the image of ``info``."""
    tails, position = [], _align(info.rep_total)
    for shard in info.shards:
        tails.append(position)
        position = _align(position + shard.private_len + shard.meta_len)
    return tails, position


def meta(image, info: CheckpointInfo, tails: list[int], rank: int) -> dict[str, Any]:
    """The layout description saved rank ``rank`` wrote (rank 0's also describes the replicated state)."""
    shard = info.shards[rank]
    start = tails[rank] + shard.private_len
    return loads_bounded(image[start:start + shard.meta_len], MAX_META_DEPTH)
