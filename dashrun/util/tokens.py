"""The cluster's shared token: read from a file only its owner may open, or created as such a file.

A token is what ``dash-memd token`` writes: 32 random bytes as 64 hex digits
(or a job's credential, :mod:`dashrun.wire.credentials`). Anything else is
refused unless ``--weak-token-ok`` (env ``DASH_WEAK_TOKEN_OK=1``) says the
operator means it; then one shorter than :data:`MIN_TOKEN_LEN` is still
refused, and one that is weak (:func:`token_weakness`: fewer than
:data:`STRONG_BITS` bits at best for its length and alphabet, or few distinct
characters, or a block repeated) is taken with a warning logged once per
process: every key of a link (:mod:`dashrun.wire.auth`,
:mod:`dashrun.wire.sealed`) is only as strong as it. The file must belong to
the user reading it (or to root), as ssh wants of a private key.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import stat
import string
import threading
from pathlib import Path

from dashrun import env
from dashrun.errors import UsageError

__all__ = ["MIN_TOKEN_LEN", "STRONG_BITS", "read_token", "token_weakness", "weak_token_ok", "write_token"]

log = logging.getLogger(__name__)

MIN_TOKEN_LEN = 16
#: Bits of entropy a token should have at least: what ``dash-memd token`` writes (64 hex digits).
STRONG_BITS = 256
#: Fewer distinct characters than this in a token is a pattern, not chance: 64 random hex digits show all 16
#: but for a few, and a random token of any usual alphabet shows more.
_FEW_DISTINCT = 8
#: Alphabets a token is made of, smallest first, each with the bits a random character of it carries.
_ALPHABETS = [(set(a), math.log2(len(set(a)))) for a in (
    string.digits, string.digits + "abcdef", string.hexdigits, string.ascii_lowercase,
    string.ascii_lowercase + string.digits, string.ascii_letters + string.digits,
    string.ascii_letters + string.digits + "+/=-_", string.printable.strip())]
_warned: set[bytes] = set()  # digests of the tokens warned about in this process
_warned_lock = threading.Lock()


def token_weakness(token: bytes) -> str | None:
    """Why ``token`` is weaker than :data:`STRONG_BITS` bits, at best, as far as it shows; None if it is not."""
    chars = set(token.decode("latin-1"))
    if len(chars) < _FEW_DISTINCT:
        return f"it uses only {len(chars)} distinct characters"
    for period in range(1, len(token) // 2 + 1):
        if len(token) % period == 0 and token == token[:period] * (len(token) // period):
            return f"it repeats a block of {period} characters"
    per_char = next((bits for alphabet, bits in _ALPHABETS if chars <= alphabet), 8.0)
    if len(token) * per_char < STRONG_BITS:
        return (f"{len(token)} characters of its alphabet hold {len(token) * per_char:.0f} bits at best, fewer than "
                f"{STRONG_BITS}")
    return None


def weak_token_ok() -> bool:
    """Whether the operator let tokens other than ``dash-memd token``'s through (``DASH_WEAK_TOKEN_OK=1``)."""
    return env.get(env.WEAK_TOKEN_OK, "0") == "1"


def _strong(token: bytes) -> bool:
    """64 hex digits showing no pattern, or a job's credential (whose key is derived, 32 bytes)."""
    if token.startswith(b"dashrun-job-v1 "):  # dashrun.wire.credentials.JOB_CREDENTIAL_TAG (util imports no wire)
        return True
    return (len(token) == 64 and all(c in b"0123456789abcdefABCDEF" for c in token)
            and token_weakness(token) is None)


def read_token(path: str | os.PathLike, *, warn: bool = True) -> bytes:
    """The cluster's shared token (or a job's credential) from a file (surrounding whitespace ignored).

    Refused when group or others may read or write the file, as ssh refuses a
    private key they could read: anyone who can read the token can log in to
    dash-memd, and anyone who can write it can make a node trust another one.
    A weak token (:func:`token_weakness`) is logged as a WARNING, once per process, unless ``warn`` is false
    (a rank: its launcher warned).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot read token file {path}: {e.strerror}",
                         hint="create one with: dash-memd token --out FILE") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode  # of the file read, not of whatever the path names later
        # Only a file at rest: a pipe (--token-file <(vault read ...)) holds the token in transit only.
        if stat.S_ISREG(mode) and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"token file {path} is open to group or others (mode {stat.S_IMODE(mode):04o})",
                             hint=f"chmod 600 {path}")
        owner = os.fstat(f.fileno()).st_uid
        if stat.S_ISREG(mode) and owner not in (os.geteuid(), 0):  # another user could change it under us
            raise UsageError(f"token file {path} belongs to uid {owner}, not to this user (uid {os.geteuid()})",
                             hint=f"chown {os.geteuid()} {path}")
        try:
            token = f.read().strip()
        except OSError as e:
            raise UsageError(f"cannot read token file {path}: {e.strerror}",
                             hint="create one with: dash-memd token --out FILE") from None
    if _strong(token):
        return token
    if not weak_token_ok():
        raise UsageError(f"token in {path} is not 32 random bytes as 64 hex digits",
                         hint=f"create one with: dash-memd token --out FILE (or accept it: --weak-token-ok, "
                              f"{env.WEAK_TOKEN_OK.name}=1, on every host)")
    if len(token) < MIN_TOKEN_LEN:
        raise UsageError(f"token in {path} is shorter than {MIN_TOKEN_LEN} characters",
                         hint="create a strong one with: dash-memd token --out FILE")
    if warn:
        _warn_if_weak(token, path)
    return token


def _warn_if_weak(token: bytes, path: Path) -> None:
    """Log a weak token once per process, however often it is read (each command and link reads it)."""
    weakness = token_weakness(token)
    if weakness is None:
        return
    digest = hashlib.sha256(token).digest()
    with _warned_lock:
        if digest in _warned:
            return
        _warned.add(digest)
    log.warning("the token in %s is weak: %s; anyone who guesses it can log in to dash-memd and forge what its "
                "links carry (create a strong one with: dash-memd token --out FILE)", path, weakness)


def write_token(path: str | os.PathLike) -> bytes:
    """Create a new random token file readable by its owner only; never overwrite one."""
    path = Path(path)
    token = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return token
