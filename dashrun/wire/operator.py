"""The operator's signing key: only the operator launches what ``dashrun resume`` runs as root on a new node.

``dash-memd keys --out FILE`` makes an Ed25519 key pair: FILE (the private key,
PEM, readable by its owner only) stays with the operator; ``FILE.pub`` (one
line, ``dashrun-operator-v1 BASE64``) goes on every node, in the image or the
user data. The launcher signs the job's launch spec with the private key
(``--operator-key``); ``resume`` runs a spec only if the public key
(``--operator-pubkey``) verifies it, and only if it is no older than the
newest spec this node has seen of the job (:class:`SeenSpecs`): a spec the
operator replaced cannot be replayed. A node, a rank or whoever can write to
dash-memd's disk or bucket holds neither the private key nor a way to forge
its signature.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

from dashrun.errors import AuthError, UsageError
from dashrun.util.files import write_atomic, write_new

__all__ = ["PUBLIC_TAG", "SeenSpecs", "load_private_key", "load_public_key", "write_key_pair"]

#: The first word of a public key file.
PUBLIC_TAG = "dashrun-operator-v1"


def write_key_pair(path: str | os.PathLike) -> Path:
    """Make a new key pair: ``path`` (private, 0600) and ``path.pub``; never overwrites either. Returns the
    public key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    public = path.with_name(path.name + ".pub")
    for existing in (path, public):
        if existing.exists():
            raise UsageError(f"{existing} exists already", hint="give another --out, or remove the old pair first")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_new(path, pem, 0o600)
    write_atomic(public, f"{PUBLIC_TAG} {base64.b64encode(raw).decode()}\n", 0o644)
    return public


def load_private_key(path: str | os.PathLike):
    """The operator's private key from ``path``; refused if group or others may open the file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        mode = path.stat().st_mode
        pem = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read --operator-key {path}: {e.strerror}",
                         hint="make a key pair with: dash-memd keys --out FILE") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"operator key {path} is open to group or others (mode {stat.S_IMODE(mode):04o})",
                         hint=f"chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{path} holds no Ed25519 private key", hint="make one with: dash-memd keys --out FILE")
    return key


def load_public_key(path: str | os.PathLike):
    """The operator's public key from a ``.pub`` file ``dash-memd keys`` wrote."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    path = Path(path)
    try:
        words = path.read_text(errors="replace").split()
    except OSError as e:
        raise UsageError(f"cannot read --operator-pubkey {path}: {e.strerror}",
                         hint="copy the .pub file dash-memd keys wrote to this node") from None
    try:
        raw = base64.b64decode(words[1], validate=True) if len(words) == 2 and words[0] == PUBLIC_TAG else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise UsageError(f"{path} is not an operator public key ({PUBLIC_TAG} BASE64)",
                         hint="give the .pub file dash-memd keys wrote")
    return Ed25519PublicKey.from_public_bytes(raw)


class SeenSpecs:
    """The newest launch spec of each job this node has run (its ``created`` time), kept in ``root``: a
    signed spec older than it is a replay."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, job: str) -> Path:
        return self.root / f"{job}.json"

    def newest(self, job: str) -> float | None:
        try:
            return float(json.loads(self._path(job).read_text())["created"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"cannot read {self._path(job)}, the newest launch spec seen of job {job}",
                             hint="remove the file only if you trust every spec dash-memd may hold") from None

    def check(self, job: str, created: float, *, remember: bool = True) -> None:
        """AuthError if a newer spec of ``job`` was run here; else remember this one (durably) as the newest,
        unless not ``remember`` (a dry run)."""
        newest = self.newest(job)
        if newest is not None and created < newest:
            raise AuthError(f"the launch spec of job {job!r} is older than one this node ran already (a replay)",
                            hint="launch the job again from the operator's machine to store a new spec")
        if remember and newest != created:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(self._path(job), json.dumps({"created": created}))
