"""Restore images: a committed checkpoint fetched once per node into shared memory that every local rank maps.

A node downloads the state once however many ranks it runs: the first
RESTORE of a (job, step) fetches it from dash-memd into a new memfd segment
laid out as :mod:`dashrun.wire.image` says, and the node's other ranks are
handed descriptors of the same segment. The agent drops its own descriptor
once every local rank has one, or after ``restore_ttl`` seconds. A rank being
served holds a :class:`Lease`, a descriptor of its own, so the cache dropping
the image meanwhile never closes (or lets the system reuse) what is being sent.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
import time

from dashrun.agent.config import AgentConfig
from dashrun.errors import ChecksumError, NotFoundError
from dashrun.util.files import unmap
from dashrun.wire import image
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo

__all__ = ["CORRUPT_FALLBACKS", "Lease", "RestoreCache", "RestoreImage"]

log = logging.getLogger(__name__)

#: Corrupt newest checkpoints a restore skips before it gives up.
CORRUPT_FALLBACKS = 5


@dataclasses.dataclass
class RestoreImage:
    """A committed checkpoint laid out for ranks: the replicated state, then each shard's tail."""

    info: CheckpointInfo
    fd: int
    tails: list[int]  # offset of each old rank's private bytes + meta in the image
    created: float = dataclasses.field(default_factory=time.monotonic)
    handed_out: int = 0  # ranks that received a descriptor of it


@dataclasses.dataclass
class Lease:
    """One caller's own descriptor of a restore image, open until the caller closes it."""

    image: RestoreImage
    fd: int

    @property
    def info(self) -> CheckpointInfo:
        return self.image.info

    @property
    def tails(self) -> list[int]:
        return self.image.tails

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RestoreCache:
    """One fetch per (job, step) per node; kept briefly for the other local ranks."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._images: dict[tuple[str, int], RestoreImage] = {}

    def get(self, job: str, step: int | None) -> Lease | None:
        """The image of a committed checkpoint (the newest, or ``step``); None if the job has none.

        The caller closes the lease once it has sent the descriptor on.

        A newest checkpoint whose bytes fail their checksum (dash-memd drops
        one that fails in its object tier), or that is gone by the time it is
        read, gives way to the newest one then.
        """
        self.expire()
        with self.config.memd_client() as client:
            for attempt in range(1, CORRUPT_FALLBACKS + 1):
                info = client.latest(job, step)
                if info is None:
                    return None
                try:
                    return self._get(client, info)
                except (ChecksumError, NotFoundError) as e:  # corrupt, or dropped since LATEST answered
                    if step is not None or attempt == CORRUPT_FALLBACKS:
                        raise
                    log.error("%s step %d cannot be restored (%s); trying the newest checkpoint before it", job,
                              info.step, e)
        return None

    def _get(self, client: MemdClient, info: CheckpointInfo) -> Lease:
        job = info.job
        with self._lock:
            job_lock = self._fetching.setdefault(job, threading.Lock())
        with job_lock:
            with self._lock:  # expire() and handed_out() close the image's descriptor under this lock
                image = self._images.get((job, info.step))
                if image is not None and image.info.committed_at == info.committed_at:
                    return Lease(image, os.dup(image.fd))
            image = self._fetch(client, info)
            with self._lock:
                old = self._images.pop((job, info.step), None)
                self._images[(job, info.step)] = image
                lease = Lease(image, os.dup(image.fd))
            if old is not None:
                os.close(old.fd)
            return lease

    def _fetch(self, client: MemdClient, info: CheckpointInfo) -> RestoreImage:
        tails, size = image.layout(info)
        fd = os.memfd_create(f"dashrun-restore-{info.job}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            started = time.monotonic()
            mapped = mmap.mmap(fd, max(size, 1))
            try:
                with memoryview(mapped) as view:
                    image.fetch(client, info, view, tails)
            finally:
                unmap(mapped)
            log.info("fetched %s step %d (%d bytes) in %.2fs", info.job, info.step, info.nbytes,
                     time.monotonic() - started)
        except BaseException:
            os.close(fd)
            raise
        return RestoreImage(info, fd, tails)

    def handed_out(self, image: RestoreImage, local_ranks: int) -> None:
        """Count a rank served; once every local rank has its own descriptor, the agent's goes."""
        with self._lock:
            image.handed_out += 1
            key = (image.info.job, image.info.step)
            if image.handed_out >= local_ranks and self._images.get(key) is image:
                del self._images[key]
                os.close(image.fd)

    def expire(self, everything: bool = False) -> None:
        """Drop the images kept longer than ``restore_ttl`` (all of them if ``everything``)."""
        now = time.monotonic()
        with self._lock:
            for key, held in list(self._images.items()):
                if everything or now - held.created > self.config.restore_ttl:
                    del self._images[key]
                    os.close(held.fd)
