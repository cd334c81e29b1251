"""The tier interface and the manifest format every tier shares.

A tier stores whole committed checkpoints (all shards of one step of one job),
hands out one shard's bytes for reading, deletes, and lists what it holds.
``MANIFEST.json`` is the commit of a checkpoint in the disk and object tiers:
``{"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": <CheckpointInfo body>}``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from typing import Sequence

from dashrun.errors import ChecksumError
from dashrun.wire.messages import CheckpointInfo

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "MANIFEST_VERSION", "SPEC", "SourceChanged", "Tier"]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SPEC = "SPEC.json"
MANIFEST_FORMAT = "dashrun-checkpoint"
MANIFEST_VERSION = 1


class SourceChanged(ChecksumError):
    """The bytes handed to :meth:`Tier.put` no longer match the checksums they were committed with: the copy
    they were read from (a RAM buffer, a disk file) has changed since, and is bad."""


class Tier(abc.ABC):
    """A place that holds committed checkpoints."""

    name: str

    @abc.abstractmethod
    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        """Store a committed checkpoint; ``shards[r]`` is rank r's bytes, whose CRC is in ``info``. Raises
        SourceChanged, storing nothing, if they do not match it."""

    @abc.abstractmethod
    def open(self, job: str, step: int, rank: int) -> contextlib.AbstractContextManager[memoryview]:
        """One shard's bytes, readable while the context lasts. Raises NotFoundError."""

    @abc.abstractmethod
    def delete(self, job: str, step: int) -> None:
        """Forget a checkpoint; a no-op if the tier does not hold it."""

    @abc.abstractmethod
    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(every complete checkpoint the tier holds; what was skipped, and why). Complete: its manifest and
        every shard's size check out; the shards' bytes are checked against their CRC-32C when read."""

    def scan(self) -> list[CheckpointInfo]:
        """Every complete checkpoint the tier holds; what was skipped is logged."""
        found, problems = self.scan_report()
        for problem in problems:
            log.warning("%s tier: %s", self.name, problem)
        return found
