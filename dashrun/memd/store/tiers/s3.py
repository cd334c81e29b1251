"""What the object tier needs of boto3 and S3: the client, error classification, part transfers.

Imported only by :mod:`dashrun.memd.store.tiers.object`, so boto3 is loaded only
when dash-memd has an object tier.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
from typing import Callable, TypeVar

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from dashrun.errors import ChecksumError
from dashrun.util.s3client import error_code, make_client  # one client set-up, shared with the data cache

__all__ = ["MAX_PARTS", "MIN_PART", "NOT_FOUND_CODES", "READ_CHUNK", "TRANSIENT_CODES", "StoredMismatch",
           "ViewReader", "b64", "error_code", "make_client", "run_all", "transient"]

T = TypeVar("T")

MIN_PART = 5 << 20  # S3's smallest part size (all parts but the last)
MAX_PARTS = 10_000
READ_CHUNK = 1 << 20  # urllib3 copies through a temporary of the size asked for
#: Error codes worth another try of the whole transfer.
TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                   "ServiceUnavailable", "NoSuchUpload", "BadDigest", "XAmzContentChecksumMismatch"}
NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


class StoredMismatch(ChecksumError):
    """The store holds other bytes than were sent: worth uploading again."""


def transient(e: BaseException) -> bool:
    """Whether another try of the whole transfer may succeed where this one failed."""
    if isinstance(e, (StoredMismatch, BotoConnectionError, HTTPClientError, IncompleteReadError)):
        return True
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or error_code(e) in TRANSIENT_CODES
    return False


def b64(crc: int) -> str:
    """A CRC-32C as S3 writes it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def run_all(workers: int, tasks: list[Callable[[], T]]) -> list[T]:
    """Run ``tasks`` on up to ``workers`` threads; their results in order.

    After the first failure no further task starts; the running ones finish
    (so nothing is still sending when the caller aborts), then it is raised.
    """
    with cf.ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks))), thread_name_prefix="dash-s3") as pool:
        futures = [pool.submit(task) for task in tasks]
        cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        for future in futures:
            future.cancel()
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()
    return [future.result() for future in futures]


class ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview: botocore takes files, not views, and a copy of each
    part would double the memory an upload needs. Seekable, so botocore can rewind it to retry."""

    def __init__(self, view: memoryview):
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos
