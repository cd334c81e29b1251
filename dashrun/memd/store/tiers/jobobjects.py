"""A job's own objects in the bucket, beside its checkpoints: its launch spec and its membership record.

Keys (under the object tier's root, see :mod:`.object`)::

    jobs/<job>/SPEC.json          the job's launch spec (JobSpec body), for ``dashrun resume``
    jobs/<job>/MEMBERSHIP.json    its membership record (:mod:`dashrun.memd.fleet.membership`), signed

A record carries the job's world generation (the fence against cut-off nodes)
and the run history ``dashrun report`` reads, so it is signed like a manifest
(:mod:`.signing`), with the job's name inside: one planted, edited, or copied
from another job's key is refused when read back.

:class:`JobObjects` is a part of :class:`~.object.ObjectTier`: it uses the
tier's client, retries and key.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Sequence

from dashrun.errors import ChecksumError, NotFoundError, ProtocolError
from dashrun.memd.store.tiers import signing
from dashrun.memd.store.tiers.base import SPEC
from dashrun.util.boundedjson import loads_bounded
from dashrun.wire.messages import JobSpec
from dashrun.wire.protocol import valid_job_id

__all__ = ["RECORD", "RECORD_FORMAT", "JobObjects"]

log = logging.getLogger("dashrun.memd.store.tiers.object")

#: A job's membership record, beside its SPEC.
RECORD = "MEMBERSHIP.json"
RECORD_FORMAT = "dashrun-membership"


class JobObjects:
    """The launch specs and membership records of :class:`~.object.ObjectTier`."""

    def put_spec(self, spec: JobSpec, job: str) -> None:
        key = f"{self.job_key(job)}/{SPEC}"
        body = json.dumps(spec.to_body(), indent=1).encode()
        self._retry(f"upload {key}", functools.partial(self._upload, key, memoryview(body)))

    def delete_spec(self, job: str) -> None:
        key = f"{self.job_key(job)}/{SPEC}"
        self._retry(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    # --- membership records ----------------------------------------------------------------------

    def put_record(self, job: str, record: dict) -> None:
        """Replace ``job``'s membership record with ``record``, signed under the tier's key with the job's
        name: a record planted, edited, or copied from another job's key is refused when read back."""
        key = f"{self.job_key(job)}/{RECORD}"
        body = {"format": RECORD_FORMAT, "version": 1, "job": job, "record": record}
        data = json.dumps(signing.sign(body, [], self._key), separators=(",", ":"), sort_keys=True).encode()
        self._retry(f"upload {key}", functools.partial(self._upload, key, memoryview(data)))

    def get_record(self, job: str) -> dict | None:
        """``job``'s membership record (None if there is none). SignatureError for one without a valid MAC,
        ChecksumError for one that is not a record of ``job``."""
        key = f"{self.job_key(job)}/{RECORD}"
        where = f"s3://{self.bucket}/{key}"
        try:
            raw = loads_bounded(self._retry(f"download {key}", functools.partial(self._get_small, key)))
        except NotFoundError:
            return None
        except ValueError as e:
            raise ChecksumError(f"{where} is corrupt ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != RECORD_FORMAT or raw.get("version") != 1:
            raise ChecksumError(f"{where} is not a membership record")
        signing.verify(raw, self._key, where, 0)
        if raw.get("job") != job or not isinstance(raw.get("record"), dict):
            raise ChecksumError(f"{where} is signed but is the record of another job")
        return raw["record"]

    def delete_record(self, job: str) -> None:
        key = f"{self.job_key(job)}/{RECORD}"
        self._retry(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    # --- listing -------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        """The jobs with any object in the store."""
        return list(filter(valid_job_id, self._subdirs(f"{self.root}/jobs/")))

    def specs(self, jobs: Sequence[str] | None = None) -> dict[str, JobSpec]:
        """Every job's launch spec in the store (of ``jobs``, as :meth:`jobs` listed them); unreadable ones are
        skipped with a warning."""
        prefix = f"{self.root}/jobs/"
        found = {}
        for job in self.jobs() if jobs is None else jobs:
            key = f"{prefix}{job}/{SPEC}"
            try:
                raw = self._retry(f"download {key}", functools.partial(self._get_small, key))
                found[job] = JobSpec.from_body(loads_bounded(raw))
            except NotFoundError:
                continue
            except (ValueError, AttributeError, ProtocolError) as e:
                log.warning("object tier: ignored s3://%s/%s: %s", self.bucket, key, e)
        return found
