"""dashrun's wire format: one versioned binary frame, used on every hop.

A frame is a fixed 24-byte header, a JSON body, and optionally raw data
followed by a 4-byte CRC-32C trailer of that data::

    offset size field
    0      4    magic      b"DASH"
    4      1    version    VERSION
    5      1    kind       Kind
    6      2    flags      0 (reserved)
    8      4    body_len   bytes of UTF-8 JSON object that follow the header
    12     8    data_len   raw bytes that follow the body
    20     4    body_crc   CRC-32C of the body
    -- body (body_len) -- data (data_len) -- data CRC-32C (4, only if data_len > 0)

Integers are big-endian. The trailer lets a sender checksum data as it streams
it and a receiver verify it as it arrives, so a shard is checked end to end
without a second pass. Nothing is ever unpickled: bodies are JSON, data is
bytes. Every length is bounded before anything is allocated for it, a body's
JSON nesting before it is parsed (:mod:`dashrun.util.boundedjson`), and every
field a peer sends is checked by the ``field_*`` functions below before use.

This module is pure: it does no I/O (see :mod:`dashrun.wire.channel`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import math
import re
import struct
from typing import Any

import crc32c as _crc32c

from dashrun.errors import ProtocolError
from dashrun.util.boundedjson import MAX_DEPTH, check_depth

__all__ = ["crc32c", "decode_body", "decode_header", "encode_body", "encode_header", "field_b64", "field_bool",
           "field_digest", "field_float", "field_int", "field_job", "field_nonce", "field_run_id", "field_step",
           "field_str", "Header", "HEADER",
           "HEX_DIGEST", "Kind", "MAGIC", "MAX_BODY", "MAX_BODY_PREAUTH", "MAX_BYTES", "MAX_FDS", "MAX_STEP",
           "MAX_WORLD", "TRAILER", "valid_job_id", "VERSION"]

MAGIC = b"DASH"
#: 2: over TLS, the link goes on in sealed records after the login (:mod:`dashrun.wire.sealed`); a peer of
#: version 1 would not, so the two refuse each other at the first frame.
#: 3: with --no-tls too, the link goes on in signed records after the login; a peer of version 2 would not.
#: 4: the login names the job a credential is for and the daemon it is with; a peer of version 3 would not.
VERSION = 4
HEADER = struct.Struct("!4sBBHIQI")
TRAILER = struct.Struct("!I")

#: Largest body accepted before the peer has authenticated.
MAX_BODY_PREAUTH = 4 << 10
#: Largest body accepted at all (a snapshot's layout travels in data, not here).
MAX_BODY = 4 << 20
#: Largest length any peer may announce for a piece of a checkpoint (1 PiB).
MAX_BYTES = 1 << 50
MAX_STEP = (1 << 53) - 1
MAX_WORLD = 1 << 16
MAX_FDS = 4

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{64}")


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli), hardware accelerated; releases the GIL on large buffers."""
    return _crc32c.crc32c(data, value)


class Kind(enum.IntEnum):
    # handshake and generic replies
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    OK = 5
    # to dash-memd
    PUT_SHARD = 16      # announce a shard; dash-memd answers OK (send it) or ERROR
    SHARD_DATA = 17     # the shard's bytes, answered OK once verified and stored
    LATEST = 18         # newest committed checkpoint of a job (or a given step)
    GET_SHARD = 19      # one shard's bytes of a committed checkpoint
    WAIT = 20           # block until a step of a job is committed (or a timeout)
    LIST = 21           # jobs and their checkpoints, a page at a time (after: a job id; next: the following page's)
    PING = 22
    PUT_SPEC = 23       # store how a job was launched, for `dashrun resume`
    GET_SPEC = 24
    DELETE = 25         # forget checkpoints of a job (all, or all but the newest N)
    NOTICE = 26         # an interruption notice a node received (recorded on the job; sent to ranks too)
    RDZV_GET = 27       # a job's rendezvous state (opaque to dash-memd) and its fencing token
    RDZV_SET = 28       # compare-and-set of that state on its token
    GENERATION = 29     # raise (or read) the job's world generation: shards of older generations are refused
    MEMBER_EVENT = 30   # record a membership change (a node joined, left, died) on the job
    MEMBERSHIP = 31     # the job's membership history
    # rank <-> dash-agent, over the node's Unix socket
    SNAPSHOT = 32       # a shard in a shared-memory segment (fd attached), possibly still being staged
    RESTORE = 33        # fetch the newest committed checkpoint into shared memory
    PROGRESS = 34       # how much of a SNAPSHOT is staged now (one-way; "failed" aborts it)
    # to dash-memd: the job's key/value store (RAM only), backing the rendezvous's torch.distributed.Store
    STORE_SET = 48      # set one or more keys
    STORE_GET = 49      # values of one or more keys, waiting (bounded) until all exist
    STORE_ADD = 50      # add to a key's decimal value
    STORE_COMPARE_SET = 51
    STORE_CHECK = 52    # whether every key exists, at once
    STORE_WAIT = 53     # wait (bounded) until every key exists
    STORE_DELETE = 54
    STORE_NUM_KEYS = 55
    STORE_DELETE_PREFIX = 56
    RESHAPE = 35        # the world changes at a checkpoint (a node joins): launcher -> agent, pushed on to ranks
    # dash-agent <-> dash-agent (the peer link), and what each agent holds, told to dash-memd
    REPLICA_PUT = 64    # a copy of a shard of the sender's node (bytes as data), answered OK once its CRC-32C matches
    REPLICA_GET = 65    # a byte range of a shard the peer holds
    HOLDINGS = 66       # agent -> dash-memd: where this node's agent listens, its failure domain, what it holds
    # a data set's listing, kept by dash-memd for the whole cluster (dashrun.data)
    DATA_LISTING_GET = 80   # the stored listing of a source's URL, as the reply's data (found: false if none)
    DATA_LISTING_PUT = 81   # store one: answered OK, then the listing follows as DATA_LISTING_BYTES' data
    DATA_LISTING_BYTES = 82
    DATA_OBJECT_GET = 83    # an object from dash-memd's data cache: OK {found, sha256} with its bytes as data
    DATA_OBJECT_PUT = 84    # offer one to it: OK {accept}; then DATA_OBJECT_BYTES with the bytes, OK once checked
    DATA_OBJECT_BYTES = 85
    DATA_STATUS = 86        # peer link: what the node's data cache holds, per source (dashrun data status --job)


@dataclasses.dataclass(frozen=True)
class Header:
    kind: Kind
    body_len: int
    data_len: int
    body_crc: int


def encode_body(body: dict[str, Any] | None) -> bytes:
    return json.dumps(body or {}, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def encode_header(kind: Kind, body: bytes, data_len: int = 0) -> bytes:
    if len(body) > MAX_BODY:
        raise ProtocolError(f"body of {len(body)} bytes exceeds {MAX_BODY}")
    if not 0 <= data_len <= MAX_BYTES:
        raise ProtocolError(f"data length {data_len} out of range")
    return HEADER.pack(MAGIC, VERSION, int(kind), 0, len(body), data_len, crc32c(body))


def decode_header(raw: bytes, *, max_body: int, max_data: int) -> Header:
    """Parse and bound a header; raises ProtocolError before anything is allocated."""
    if len(raw) != HEADER.size:
        raise ProtocolError("truncated frame header")
    magic, version, kind, flags, body_len, data_len, body_crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("not a dashrun frame (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} not supported (this side speaks {VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if flags:
        raise ProtocolError("reserved flags set")
    if body_len > max_body:
        raise ProtocolError(f"body of {body_len} bytes exceeds the limit of {max_body}")
    if data_len > max_data:
        raise ProtocolError(f"{kind.name} announces {data_len} data bytes, more than the {max_data} allowed")
    return Header(kind, body_len, data_len, body_crc)


def _reject_constant(name: str):
    raise ProtocolError(f"non-finite number {name} in body")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError("non-finite number in body")
    return value


def decode_body(header: Header, raw: bytes) -> dict[str, Any]:
    if crc32c(raw) != header.body_crc:
        raise ProtocolError("body checksum mismatch")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("body is not UTF-8") from None
    try:
        check_depth(text)  # before the parser recurses into it, on this thread's stack
    except ValueError:
        raise ProtocolError(f"body nests JSON deeper than {MAX_DEPTH} levels") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"body is not valid JSON: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("body is not a JSON object")
    return body


# --- field validation -------------------------------------------------------
#
# Each helper takes the decoded body and a field name, and returns the value
# only if it has the right type and lies within bounds.


def field_int(body: dict, name: str, lo: int = 0, hi: int = MAX_BYTES, default: int | None = None) -> int:
    value = body.get(name, default)
    if type(value) is not int or not lo <= value <= hi:  # bool is an int: refused on purpose
        raise ProtocolError(f"field {name!r} must be an integer in [{lo}, {hi}]")
    return value


def field_float(body: dict, name: str, lo: float, hi: float, default: float | None = None) -> float:
    value = body.get(name, default)
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} must be a number in [{lo}, {hi}]")
    return float(value)


def field_str(body: dict, name: str, max_len: int = 1024, pattern: re.Pattern | None = None,
              default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or len(value) > max_len or (pattern and not pattern.fullmatch(value)):
        raise ProtocolError(f"field {name!r} is missing or malformed")
    return value


def field_bool(body: dict, name: str, default: bool | None = None) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name!r} must be true or false")
    return value


def valid_job_id(job: str) -> bool:
    return isinstance(job, str) and _JOB_ID.fullmatch(job) is not None


def field_job(body: dict, name: str = "job") -> str:
    value = body.get(name)
    if not valid_job_id(value):
        raise ProtocolError(
            f"field {name!r} is not a valid job id (1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit)")
    return value


def field_nonce(body: dict, name: str) -> str:
    return field_str(body, name, 64, _NONCE)


def field_digest(body: dict, name: str) -> str:
    """A SHA-256 digest or HMAC as 64 lowercase hex digits."""
    return field_str(body, name, 64, HEX_DIGEST)


def field_step(body: dict, name: str = "step") -> int:
    return field_int(body, name, 0, MAX_STEP)


def field_run_id(body: dict, name: str = "run_id") -> str:
    """A rendezvous's run id: spelled like a job id (it names a file in dash-memd's data dir)."""
    value = body.get(name)
    if not isinstance(value, str) or _JOB_ID.fullmatch(value) is None:
        raise ProtocolError(
            f"field {name!r} is not a valid run id (1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit)")
    return value


def field_b64(body: dict, name: str, max_len: int) -> bytes:
    """Bytes sent as standard base64 in a JSON string, at most ``max_len`` of them once decoded; the string's
    length is bounded before it is decoded."""
    value = body.get(name)
    if not isinstance(value, str) or len(value) > 4 * -(-max_len // 3):
        raise ProtocolError(f"field {name!r} must be base64 of at most {max_len} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"field {name!r} is not valid base64") from None
    if len(raw) > max_len:
        raise ProtocolError(f"field {name!r} must be base64 of at most {max_len} bytes")
    return raw
