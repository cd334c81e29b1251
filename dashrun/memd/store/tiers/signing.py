"""Signed manifests: what the bucket says about a checkpoint is taken only under a key the bucket does not hold.

Whoever can write into the bucket (a leaked bucket credential, a shared
bucket, a compromised backup job) does not hold the cluster's token. dash-memd
derives from the token a key that does one thing, :func:`manifest_key`, and
with it signs every manifest it uploads: HMAC-SHA256 over the manifest's
whole content (job, step, commit time, every shard's header with its size
and CRC-32C) and over each shard's SHA-256. CRC-32C finds rot but not an
adversary (four chosen bytes give any CRC-32C); the SHA-256 digests under the
MAC do, so a shard edited in the bucket is refused when it is read, as an
edited, planted or unsigned manifest is refused when it is listed.

The signed manifest is the tier's common manifest with two more fields::

    {"format": "dashrun-checkpoint", "version": 1, "checkpoint": {...},
     "sha256": ["<64 hex digits>", ...one per rank],
     "mac": "<64 hex digits>"}

A reader that knows no MAC (a dashrun before signed manifests) reads it as
before. The MAC is over the canonical JSON of everything but ``"mac"``, so any
field changed, added or removed breaks it. A manifest with no ``"mac"``
(uploaded before manifests were signed) is refused like a forged one: it
cannot be told from one planted by someone without the token.

What it does not stop: someone with write access to the bucket can still
delete checkpoints, or put back an older signed manifest of the same job and
step with its own shards (bytes dash-memd once uploaded itself).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Sequence

from dashrun.errors import SignatureError

__all__ = ["MAC_FIELD", "PURPOSE", "SHA256_FIELD", "manifest_key", "sign", "verify"]

#: What the key is for, so that it can never pass for any other key derived from the token.
PURPOSE = b"dashrun manifest key v1"
MAC_FIELD = "mac"
SHA256_FIELD = "sha256"


def manifest_key(token: bytes) -> bytes:
    """The key manifests are signed with, derived from the cluster's ``token`` (HMAC-SHA256 as a KDF): the
    object tier holds this, not the token, so it can sign manifests and nothing else."""
    return hmac.new(token, PURPOSE, hashlib.sha256).digest()


def _mac(key: bytes, body: dict[str, Any]) -> str:
    # sort_keys and fixed separators: the same bytes after any round trip through JSON (a float's repr is exact).
    message = json.dumps({k: v for k, v in body.items() if k != MAC_FIELD}, sort_keys=True, ensure_ascii=True,
                         separators=(",", ":"), allow_nan=False)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def sign(body: dict[str, Any], digests: Sequence[bytes], key: bytes) -> dict[str, Any]:
    """``body`` (a manifest) with each shard's SHA-256 ``digests`` and the MAC over both under ``key``."""
    signed = {**body, SHA256_FIELD: [d.hex() for d in digests]}
    signed[MAC_FIELD] = _mac(key, signed)
    return signed


def verify(raw: Any, key: bytes, where: str, world: int) -> list[bytes]:
    """Each shard's SHA-256 from manifest ``raw`` (parsed JSON) of ``world`` shards, once its MAC under ``key``
    checks out; raises SignatureError, naming ``where``, otherwise."""
    mac = raw.get(MAC_FIELD) if isinstance(raw, dict) else None
    if mac is None:
        raise SignatureError(f"{where} is not signed: uploaded by a dashrun older than signed manifests, or "
                             "planted by someone without the cluster's token; not taken",
                             hint="dash-memd uploads again, signed, the newest checkpoint of a job its disk "
                                  "still holds; see docs/security.md")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, raw)):
        raise SignatureError(f"{where} does not carry a valid MAC under this cluster's token: edited in the "
                             "bucket, or written by someone without the token; not taken",
                             hint="check --token-file (a new token refuses what the old one signed); "
                                  "see docs/security.md")
    digests = raw.get(SHA256_FIELD)
    try:
        if not isinstance(digests, list) or len(digests) != world:
            raise ValueError
        found = [bytes.fromhex(d) for d in digests]
        if any(len(d) != hashlib.sha256().digest_size for d in found):
            raise ValueError
    except (ValueError, TypeError):  # signed by us, so written by a dashrun that got it wrong
        raise SignatureError(f"{where} is signed but its {SHA256_FIELD!r} does not list one digest per shard") from None
    return found
