"""Who a login speaks for: the cluster's token (dash-memd and the operator), or one job's credential.

The cluster's token is all the authority there is; a job's credential is the
part of it one job needs::

    K_job = HKDF-SHA256(key=token, salt="", info="dashrun job credential v1" | job)

dash-memd holds the token and derives ``K_job`` for any job; whoever holds
``K_job`` can log in for that job and no other (:mod:`dashrun.wire.auth`), and
cannot work back to the token or to another job's key. A job's credential file
names its job, so a launcher knows which job it may run::

    dashrun-job-v1 JOB 64-HEX-DIGITS

``dash-memd token --job JOB`` writes one from the token; a launcher that holds
the token writes its job's into a private file for its dash-agent and ranks
(:func:`write_job_credential`), which then never see the token at all.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dashrun.errors import UsageError
from dashrun.util.files import write_new
from dashrun.wire.protocol import valid_job_id

__all__ = ["JOB_CREDENTIAL_TAG", "Credential", "job_key", "write_job_credential"]

#: The first word of a job credential file (a cluster token is hex digits alone, so never starts so).
JOB_CREDENTIAL_TAG = b"dashrun-job-v1"
_INFO = b"dashrun job credential v1\x00"


def job_key(token: bytes, job: str) -> bytes:
    """The 32-byte key of ``job`` under the cluster's ``token``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + job.encode()).derive(token)


@dataclasses.dataclass(frozen=True)
class Credential:
    """What a token file holds: the cluster's token (``job`` None) or the key of one job."""

    key: bytes = dataclasses.field(repr=False)
    job: str | None = None

    @classmethod
    def parse(cls, raw: bytes) -> Credential:
        """The credential a token file's stripped contents are; UsageError for a malformed job credential."""
        if not raw.startswith(JOB_CREDENTIAL_TAG + b" "):
            return cls(raw)
        parts = raw.split()
        try:
            job = parts[1].decode("ascii") if len(parts) == 3 else ""
            key = bytes.fromhex(parts[2].decode("ascii")) if len(parts) == 3 else b""
        except (UnicodeDecodeError, ValueError):
            job, key = "", b""
        if not valid_job_id(job) or len(key) != 32:
            raise UsageError("malformed job credential (expected: dashrun-job-v1 JOB 64-hex-digits)",
                             hint="write one with: dash-memd token --job JOB --token-file TOKEN --out FILE")
        return cls(key, job)

    @property
    def operator(self) -> bool:
        """Whether this is the cluster's token, which may do what no job's credential may (launch specs,
        whole-job deletes)."""
        return self.job is None

    def for_job(self, job: str) -> Credential:
        """The credential of ``job`` this one grants: derived from the token, or this very one."""
        if self.job is None:
            return Credential(job_key(self.key, job), job)
        if self.job != job:
            raise UsageError(f"the token file holds the credential of job {self.job!r}, not of {job!r}",
                             hint=f"give --job-id {self.job}, or a credential of {job} (dash-memd token --job {job})")
        return self

    def file_bytes(self) -> bytes:
        """This job credential as its file holds it."""
        if self.job is None:
            raise ValueError("the cluster's token is not written by this function")
        return b"%s %s %s\n" % (JOB_CREDENTIAL_TAG, self.job.encode(), self.key.hex().encode())


def write_job_credential(credential: Credential, path: str | os.PathLike) -> Path:
    """Write a job's credential to ``path``, readable by its owner only, complete or not at all; never over a
    file there (FileExistsError)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_new(tmp, credential.file_bytes(), 0o600)
        os.link(tmp, path)  # whole at once, and never over a file there: EEXIST
    finally:
        tmp.unlink(missing_ok=True)
    return path
