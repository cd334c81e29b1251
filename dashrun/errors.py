"""Every error dashrun raises, and the exit codes they become at the edge.

A leaf module: it imports nothing of dashrun, so any process (rank, agent,
dash-memd, CLI) can raise and catch these without pulling in the rest.
Errors a user can fix carry a one-line ``hint``; the CLI renders
``message`` and ``hint`` once, never a traceback.
"""

from __future__ import annotations

import enum

__all__ = ["AuthError", "BusyError", "ChecksumError", "ConflictError", "DashError", "ErrorCode", "ExitCode",
           "ForbiddenError", "from_code", "NoSpaceError", "NotFoundError", "ProtocolError", "RecordTagError",
           "RemoteError", "RestoreMismatchError", "SignatureError", "SourceChangedError", "UnavailableError",
           "UsageError"]


class ExitCode(enum.IntEnum):
    """Exit codes of the ``dashrun``, ``dash-agent`` and ``dash-memd`` commands."""

    OK = 0
    #: Training failed (a rank exited non-zero and restarts were exhausted), or
    #: a daemon stopped on an error it could not recover from.
    FAILED = 1
    #: Bad command line or configuration: nothing was started, or nothing was trained (the job's checkpoint does
    #: not fit the script: :class:`RestoreMismatchError`).
    USAGE = 2
    #: Preempted with the state safe in dash-memd: relaunch to resume.
    #: 75 is sysexits' EX_TEMPFAIL, which schedulers treat as "requeue".
    PREEMPTED = 75
    #: A rank's exit, between the rank and its launcher only: its checkpoint is committed and the job's world
    #: changes (a node leaves or joins); the launcher starts it again at the new world size.
    WORLD_CHANGE = 76


class ErrorCode(str, enum.Enum):
    """Machine-readable reason carried by an ERROR frame across processes."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    NO_SPACE = "no_space"
    CONFLICT = "conflict"
    BUSY = "busy"
    CHECKSUM = "checksum"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class DashError(Exception):
    """Base of every error dashrun raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL
    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class UsageError(DashError):
    """The user asked for something that cannot work; nothing was started."""

    code = ErrorCode.BAD_REQUEST
    exit_code = ExitCode.USAGE


class RestoreMismatchError(UsageError):
    """The job's checkpoint does not fit the state the script built: other shapes, keys or keyword objects.

    The job id names an earlier run of another model or script (a derived id
    is the script's path and arguments, not its contents). Raised by
    ``Checkpointer.restore()`` on every rank; a rank that does not catch it
    prints it as one line, and the launcher, which finds its class name in
    torch's error file (``"RestoreMismatchError: ..."``), ends with one line
    and exit code 2.
    """


class ProtocolError(DashError):
    """A peer sent bytes that are not a valid frame or message."""

    code = ErrorCode.BAD_REQUEST


class AuthError(DashError):
    """The peer does not hold the cluster's token (or we do not hold the peer's)."""

    code = ErrorCode.UNAUTHORIZED


class UnavailableError(DashError):
    """A peer (dash-agent, dash-memd) cannot be reached or went away mid-request."""

    code = ErrorCode.UNAVAILABLE


class RecordTagError(UnavailableError):
    """A record of a logged-in link failed its tag (:mod:`dashrun.wire.sealed`): altered, replayed, reordered or
    injected on the way, or sent under other keys. The connection is over, as for any UnavailableError; this
    one is told apart, since it means something on the path (or a bug), not a network that failed."""


class ChecksumError(DashError):
    """Bytes arrived or were read back with a checksum that does not match."""

    code = ErrorCode.CHECKSUM


class SignatureError(ChecksumError):
    """A manifest from the bucket carries no valid MAC under the cluster's key (planted, edited, unsigned), or
    a shard does not match the digest its signed manifest gives. A ChecksumError: a copy that is not to be
    trusted, whose readers take the checkpoint before it."""


class NotFoundError(DashError):
    code = ErrorCode.NOT_FOUND


class NoSpaceError(DashError):
    """dash-memd cannot hold more without dropping state that is not yet safe."""

    code = ErrorCode.NO_SPACE


class ConflictError(DashError):
    code = ErrorCode.CONFLICT


class SourceChangedError(ConflictError):
    """A data set's object is no longer the version its stored listing names: the listing wants a refresh."""


class ForbiddenError(DashError):
    """Logged in, but with a credential that does not cover the request (another job's, or the operator's
    to do)."""

    code = ErrorCode.FORBIDDEN
    exit_code = ExitCode.USAGE


class BusyError(DashError):
    code = ErrorCode.BUSY


class RemoteError(DashError):
    """An error a peer reported in an ERROR frame that has no closer class here."""


_BY_CODE: dict[ErrorCode, type[DashError]] = {
    ErrorCode.BAD_REQUEST: ProtocolError,
    ErrorCode.UNAUTHORIZED: AuthError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.NO_SPACE: NoSpaceError,
    ErrorCode.CONFLICT: ConflictError,
    ErrorCode.FORBIDDEN: ForbiddenError,
    ErrorCode.BUSY: BusyError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.UNAVAILABLE: UnavailableError,
}


def from_code(code: str, message: str) -> DashError:
    """Rebuild the exception a peer reported, by its wire code."""
    try:
        cls = _BY_CODE.get(ErrorCode(code), RemoteError)
    except ValueError:
        cls = RemoteError
    err = cls(message)
    if cls is RemoteError:
        err.code = ErrorCode.INTERNAL
    return err
