"""Where a data set's objects come from: an S3 prefix, a local (or NFS) directory, an HTTP(S) manifest.

A :class:`Source` lists its objects once, each as an :class:`ObjectInfo`
whose :meth:`~ObjectInfo.identity` names one version of one object (S3: key,
size, ETag, version; a directory: path, size, mtime; a manifest: key, size,
SHA-256), and streams one object's bytes with what the source says they must
hash to (:class:`Expected`), so the cache can check them while writing.

- ``s3://bucket/prefix/``: boto3 with the standard AWS chain and
  ``AWS_ENDPOINT_URL``, the client of dash-memd's object tier
  (:func:`dashrun.util.s3client.make_client`). A GET names the listed
  ETag (``IfMatch``), so a changed object is never cached under the old
  identity; S3's own checksum (``ChecksumMode``) or a single-part ETag (an MD5)
  is what the bytes are checked against.
- a directory: every regular file below it; keys are ``/``-separated paths
  relative to it. Not hashed at list time; the bytes are checked against the
  size and mtime the listing gave (a file changed while being copied is refused).
- ``https://host/path/manifest.json`` (or ``http://``): a JSON manifest
  ``{"objects": [{"key": K, "size": N, "sha256": HEX}, ...]}``; each object is
  fetched from the manifest's URL joined with its key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dashrun.errors import (ChecksumError, NotFoundError, ProtocolError, SourceChangedError, UnavailableError,
                            UsageError)
from dashrun.util.boundedjson import loads_bounded
from dashrun.wire.protocol import crc32c

__all__ = ["CHUNK", "MAX_KEY", "MAX_MANIFEST", "MAX_SHARED_OBJECT", "Expected", "Hasher", "ObjectInfo", "Source",
           "expected_of", "normal_url", "open_source", "valid_key"]

#: Bytes read from a source at a time.
CHUNK = 4 << 20
#: The longest key accepted, in bytes (S3's own limit).
MAX_KEY = 1024
#: The largest HTTP(S) manifest read.
MAX_MANIFEST = 64 << 20
#: The largest object that crosses the link to dash-memd's data cache (it travels as one frame held in memory).
MAX_SHARED_OBJECT = 1 << 30


def valid_key(key: object) -> bool:
    """A key that is safe as a relative path: no empty, ``.`` or ``..`` parts, no NUL, not absolute, bounded."""
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY or "\0" in key or key.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in key.split("/"))


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a source, as listed. ``etag``/``version`` for S3, ``mtime_ns`` for a directory, ``sha256``
    for a manifest; unknown fields are empty."""

    key: str
    size: int
    etag: str = ""
    version: str = ""
    mtime_ns: int = 0
    sha256: str = ""

    def __post_init__(self):
        if not valid_key(self.key):
            raise ProtocolError(f"object key {self.key!r} is not a valid relative name")
        if not isinstance(self.size, int) or self.size < 0:
            raise ProtocolError(f"object {self.key!r} has an invalid size {self.size!r}")
        for name in ("etag", "version", "sha256"):
            if not isinstance(getattr(self, name), str) or len(getattr(self, name)) > 256:
                raise ProtocolError(f"object {self.key!r} has an invalid {name}")
        if not isinstance(self.mtime_ns, int):
            raise ProtocolError(f"object {self.key!r} has an invalid mtime")

    def identity(self, source_url: str) -> str:
        """The cache entry's name: a digest of the source and every field that changes when the object does."""
        fields = [source_url, self.key, str(self.size), self.etag, self.version, str(self.mtime_ns), self.sha256]
        return hashlib.sha256("\0".join(fields).encode()).hexdigest()

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", 0) or k in ("key", "size")}

    @classmethod
    def from_json(cls, body: object) -> ObjectInfo:
        if not isinstance(body, dict) or set(body) - {"key", "size", "etag", "version", "mtime_ns", "sha256"}:
            raise ProtocolError("an object of a listing is not a mapping of the known fields")
        try:
            return cls(**body)
        except TypeError as e:
            raise ProtocolError(f"an object of a listing is incomplete: {e}") from None


class Hasher:
    """The digests of bytes as they are written, checked against what the source says (:class:`Expected`)."""

    def __init__(self, expected: Expected):
        self.expected = expected
        self.sha256 = hashlib.sha256()
        self._md5 = hashlib.md5(usedforsecurity=False) if expected.md5 else None
        self._crc32c = 0 if expected.crc32c is not None else None
        self._crc32 = 0 if expected.crc32 is not None else None
        self.size = 0

    def update(self, piece) -> None:
        self.size += len(piece)
        self.sha256.update(piece)
        if self._md5 is not None:
            self._md5.update(piece)
        if self._crc32c is not None:
            self._crc32c = crc32c(piece, self._crc32c)
        if self._crc32 is not None:
            self._crc32 = zlib.crc32(piece, self._crc32)

    def mismatch(self) -> str | None:
        """What does not match (a sentence), or None when every check the source gives holds."""
        e = self.expected
        if self.size != e.size:
            return f"{self.size} bytes where {e.size} were listed"
        if e.sha256 and self.sha256.hexdigest() != e.sha256:
            return "SHA-256 differs"
        if self._md5 is not None and self._md5.hexdigest() != e.md5:
            return "MD5 (the ETag) differs"
        if self._crc32c is not None and self._crc32c != e.crc32c:
            return "CRC-32C differs"
        if self._crc32 is not None and self._crc32 != e.crc32:
            return "CRC-32 differs"
        return None


@dataclass(frozen=True)
class Expected:
    """What an object's bytes must be: its size always, and any digest the source gives."""

    size: int
    sha256: str = ""
    md5: str = ""
    crc32c: int | None = None
    crc32: int | None = None

    @property
    def checked_by(self) -> str:
        for name in ("sha256", "crc32c", "crc32", "md5"):
            if getattr(self, name) not in ("", None):
                return name
        return "size"


def expected_of(info: ObjectInfo, sha256: str) -> Expected:
    """What a copy of ``info`` from another cache (a peer's, dash-memd's) must be: the SHA-256 that cache gives,
    and whatever the listing itself fixes (the manifest's SHA-256, a single-part ETag's MD5), which no other
    cache can forge."""
    if info.sha256 and sha256 != info.sha256:
        raise ChecksumError(f"{info.key}: the copy offered is not the listed object")
    return Expected(info.size, sha256=sha256, md5=info.etag if _plain_md5(info.etag) else "")


class Source:
    """A listed set of objects and a way to read each."""

    url: str

    def list(self) -> list[ObjectInfo]:
        raise NotImplementedError

    def read(self, info: ObjectInfo) -> tuple[Expected, Iterator[bytes]]:
        """The checks the bytes must pass, and the bytes in pieces. UnavailableError when the source cannot be
        reached; SourceChangedError when the object is no longer the listed one."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def open_source(url: str) -> Source:
    """The source ``url`` names: ``s3://``, ``https://``/``http://`` (a manifest), or a directory path."""
    if url.startswith("s3://"):
        return S3Source(url)
    if url.startswith(("https://", "http://")):
        return ManifestSource(url)
    if "://" in url:
        raise UsageError(f"data source {url!r} is of no known kind",
                         hint="use s3://bucket/prefix/, https://host/manifest.json or a directory")
    return DirSource(url)


def normal_url(url: str) -> str:
    """The one spelling of a source's URL that its listing and entries are keyed by."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[5:].partition("/")
        prefix = prefix.strip("/")
        return f"s3://{bucket}/{prefix}/" if prefix else f"s3://{bucket}/"
    if "://" in url:
        return url
    return str(Path(url).expanduser().resolve())


class S3Source(Source):
    def __init__(self, url: str):
        bucket, _, prefix = url[5:].partition("/")
        if not bucket:
            raise UsageError(f"data source {url!r} names no bucket", hint="write it as s3://bucket/prefix/")
        from dashrun.util import s3client

        self._s3 = s3client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = normal_url(url)
        self.client = s3client.make_client(connect_timeout=5.0, read_timeout=60.0, request_attempts=3, connections=16)

    def _unavailable(self, e: Exception, what: str) -> UnavailableError:
        return UnavailableError(f"{self.url} cannot be {what}: {e}",
                                hint="check AWS_ENDPOINT_URL, the credentials and the network")

    def list(self) -> list[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        found = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for o in page.get("Contents", []):
                    key = o["Key"][len(self.prefix):]
                    if key and not key.endswith("/"):  # "folder" markers are not objects
                        found.append(ObjectInfo(key, int(o["Size"]), etag=o.get("ETag", "").strip('"')))
        except ClientError as e:
            if self._s3.error_code(e) in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId"):
                raise UsageError(f"{self.url} cannot be listed: {self._s3.error_code(e)}",
                                 hint="check the bucket's name and the credentials") from None
            raise self._unavailable(e, "listed") from None
        except BotoCoreError as e:
            raise self._unavailable(e, "listed") from None
        return sorted(found, key=lambda info: info.key)

    def read(self, info: ObjectInfo) -> tuple[Expected, Iterator[bytes]]:
        from botocore.exceptions import BotoCoreError, ClientError

        args = {"Bucket": self.bucket, "Key": self.prefix + info.key, "ChecksumMode": "ENABLED"}
        if info.etag:
            args["IfMatch"] = f'"{info.etag}"'
        if info.version:
            args["VersionId"] = info.version
        try:
            reply = self.client.get_object(**args)
        except ClientError as e:
            code = self._s3.error_code(e)
            if code in ("PreconditionFailed", "412"):
                raise SourceChangedError(f"{info.key} changed in {self.url} since it was listed",
                                         hint="refresh the listing: CachedFiles(url, refresh=True) or "
                                              "dashrun data stage --refresh") from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFoundError(f"{info.key} is no longer in {self.url}",
                                    hint="refresh the listing: dashrun data stage --refresh") from None
            raise self._unavailable(e, "read") from None
        except BotoCoreError as e:
            raise self._unavailable(e, "read") from None
        expected = Expected(info.size, md5=info.etag if _plain_md5(info.etag) else "",
                            sha256=_b64_hex(reply.get("ChecksumSHA256")),
                            crc32c=_b64_int(reply.get("ChecksumCRC32C")),
                            crc32=_b64_int(reply.get("ChecksumCRC32")))
        return expected, self._pieces(reply["Body"])

    def _pieces(self, body) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError

        try:
            while piece := body.read(CHUNK):
                yield piece
        except BotoCoreError as e:
            raise self._unavailable(e, "read") from None
        finally:
            body.close()

    def close(self) -> None:
        self.client.close()


def _plain_md5(etag: str) -> bool:
    """A single-part upload's ETag is the MD5 of the bytes; a multipart one (``...-N``) is not."""
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())


def _b64_hex(value: str | None) -> str:
    # A composite checksum of a multipart upload ("...-N") is not the whole object's digest.
    if not value or "-" in value:
        return ""
    return base64.b64decode(value).hex()


def _b64_int(value: str | None) -> int | None:
    if not value or "-" in value:
        return None
    return int.from_bytes(base64.b64decode(value), "big")


class DirSource(Source):
    def __init__(self, path: str):
        self.url = normal_url(path)
        self.root = Path(self.url)

    def list(self) -> list[ObjectInfo]:
        if not self.root.is_dir():
            raise UnavailableError(f"data directory {self.root} is not there",
                                   hint="check the path, and that its file system is mounted")
        found = []
        for top, dirs, files in os.walk(self.root):
            dirs.sort()
            for name in files:
                path = Path(top) / name
                st = path.lstat()
                if path.is_symlink() or not os.path.isfile(path):
                    continue
                found.append(ObjectInfo(path.relative_to(self.root).as_posix(), st.st_size, mtime_ns=st.st_mtime_ns))
        return sorted(found, key=lambda info: info.key)

    def read(self, info: ObjectInfo) -> tuple[Expected, Iterator[bytes]]:
        path = self.root / info.key
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise NotFoundError(f"{info.key} is no longer in {self.url}",
                                hint="refresh the listing: dashrun data stage --refresh") from None
        except OSError as e:
            raise UnavailableError(f"{path} cannot be read: {e}") from None
        st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != (info.size, info.mtime_ns):
            f.close()
            raise SourceChangedError(f"{info.key} changed in {self.url} since it was listed",
                                     hint="refresh the listing: dashrun data stage --refresh")
        return Expected(info.size), self._pieces(f, info)

    def _pieces(self, f, info: ObjectInfo) -> Iterator[bytes]:
        with f:
            while piece := f.read(CHUNK):
                yield piece
            if os.fstat(f.fileno()).st_mtime_ns != info.mtime_ns:
                raise SourceChangedError(f"{info.key} changed in {self.url} while it was read")


class ManifestSource(Source):
    def __init__(self, url: str):
        self.url = url

    def _open(self, url: str, what: str):
        try:
            return urllib.request.urlopen(url, timeout=30)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise NotFoundError(f"{what} is not at {url} (HTTP 404)") from None
            raise UnavailableError(f"{what} cannot be read from {url}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UnavailableError(f"{what} cannot be read from {url}: {e}",
                                   hint="check the address and the network") from None

    def list(self) -> list[ObjectInfo]:
        with self._open(self.url, "the manifest") as reply:
            text = reply.read(MAX_MANIFEST + 1)
        if len(text) > MAX_MANIFEST:
            raise ProtocolError(f"the manifest at {self.url} is larger than {MAX_MANIFEST} bytes")
        try:
            body = loads_bounded(text)
        except ValueError as e:
            raise ProtocolError(f"the manifest at {self.url} is not JSON: {e}") from None
        if not isinstance(body, dict) or not isinstance(body.get("objects"), list):
            raise ProtocolError(f"the manifest at {self.url} is not {{\"objects\": [...]}}")
        found = []
        for o in body["objects"]:
            if not isinstance(o, dict) or not isinstance(o.get("sha256"), str) or len(o["sha256"]) != 64:
                raise ProtocolError(f"an object of the manifest at {self.url} has no key, size and sha256")
            found.append(ObjectInfo(o.get("key"), o.get("size"), sha256=o["sha256"].lower()))
        if len({info.key for info in found}) != len(found):
            raise ProtocolError(f"the manifest at {self.url} names a key twice")
        return sorted(found, key=lambda info: info.key)

    def read(self, info: ObjectInfo) -> tuple[Expected, Iterator[bytes]]:
        url = urllib.parse.urljoin(self.url, urllib.parse.quote(info.key))
        reply = self._open(url, info.key)
        return Expected(info.size, sha256=info.sha256), self._pieces(reply)

    def _pieces(self, reply) -> Iterator[bytes]:
        with reply:
            while piece := reply.read(CHUNK):
                yield piece


def listing_json(url: str, infos: list[ObjectInfo]) -> str:
    return json.dumps({"url": url, "objects": [info.to_json() for info in infos]}, separators=(",", ":"))
