"""What a logged-in connection may ask of dash-memd: all of it with the cluster's token, one job's with a job's.

A connection that logged in with a job's credential (:mod:`dashrun.wire.auth`)
is bound to that job. Every request names the job it is about in its ``job``
field (a shard's header too); one that names another is refused before its
handler runs, so no handler can forget the check. ``LIST`` with a job's
credential lists that job alone. What only the operator may do — store a launch
spec (``dashrun resume`` runs it as root), delete checkpoints (``rm``, ``gc``:
they purge the bucket's copies too) — needs the cluster's token: a rank that a
data loader's dependency took over can read and write its own job's
checkpoints, which it could anyway, and nothing else.
"""

from __future__ import annotations

from dashrun.errors import ForbiddenError
from dashrun.wire.channel import Frame
from dashrun.wire.protocol import Kind, field_job

__all__ = ["OPERATOR_ONLY", "authorize"]

#: Requests only the cluster's token may make.
OPERATOR_ONLY = frozenset({Kind.PUT_SPEC, Kind.DELETE})
#: Requests about no job: a data set's listing is the cluster's, shared by every job (dashrun.memd.datasets).
_UNSCOPED = frozenset({Kind.PING, Kind.DATA_LISTING_GET, Kind.DATA_LISTING_PUT, Kind.DATA_OBJECT_GET,
                       Kind.DATA_OBJECT_PUT})


def authorize(job: str | None, frame: Frame) -> None:
    """Refuse (ForbiddenError) a request the connection's credential does not cover; ``job`` is the job the
    connection is bound to (None: the cluster's token). A job-bound ``LIST`` is narrowed to the job."""
    if job is None or frame.kind in _UNSCOPED:
        return
    kind = frame.kind
    if kind == Kind.LIST:
        frame.body.pop("after", None)
        frame.body["job"] = job
        return
    asked = field_job(frame.body)
    if asked != job:
        raise ForbiddenError(f"this connection holds the credential of job {job}, not of {asked}",
                             hint="each job's nodes get that job's credential only")
    if kind in OPERATOR_ONLY:
        raise ForbiddenError(f"{kind.name} needs the cluster's token; this connection holds the credential of "
                             f"job {job} only", hint="run it (dashrun rm, gc, --fresh) where the operator's token is")
