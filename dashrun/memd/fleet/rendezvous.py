"""The rendezvous states dash-memd serves: opaque bytes per (job, run id), set by compare-and-set on a token.

torch's ``DynamicRendezvousHandler`` keeps its whole state in a backend that
offers two calls, ``get_state`` and a conditional ``set_state``; dashrun's
backend (:mod:`dashrun.launch.rendezvous`) makes them requests to dash-memd, which
does not parse the state to serve it: only a whole-job deletion reads its
heartbeats, and the job's heartbeat settings the nodes send with it, to refuse
to delete a job whose nodes are alive (:meth:`RendezvousStates.liveness`,
:mod:`dashrun.wire.heartbeats`). :meth:`RendezvousStates.set` has exactly the contract
of torch's ``RendezvousBackend.set_state``: it stores the state iff the
caller's token is the current one (None: iff there is no state yet), and
answers the state and token now held and whether this call set them.

Tokens come from one counter for the whole data dir (:class:`TokenSource`),
so a token is never handed out twice: not for another job, not after the
job was deleted (``dashrun rm``), not after a restart. The counter reserves
blocks of tokens in ``<data dir>/rendezvous/TOKENS``, fsynced before any
token of a block is used; the next block is reserved while half of the
current one is still left, so a disk that fails meanwhile (full, say) costs
no set until that half is used up too. Only then does a set fail: a token
that no reservation on disk covers could be handed out again after a
restart, and a node still holding it from before would win a compare it
should lose.

Each state is a file ``<data dir>/rendezvous/<job>/<run id>.json``, replaced
atomically (temporary file, rename) at every set, so a restarted dash-memd
serves the same state and token. Not fsynced: the agents' heartbeats set the
state about once a second per node, and a rename survives the dash-memd
process dying however it dies (the page cache is the kernel's); only a crash
of the whole machine can lose the last seconds of sets. The state read back
then is an older one whose token is still below every token handed out
since (the counter's block is durable), so the nodes' next sets fail their
compare, they read the state again and rewrite what was lost, as after any
lost race; torch's handler is built for exactly that.

For the same reason a state file that cannot be written (a full disk) does
not fail the set: the state changes in RAM and is answered, the failure is
logged once, and every later change (and :meth:`RendezvousStates.flush`, at
a stop) writes the newest state of each file still behind, so the heartbeats
of an elastic job go on while its checkpoints go to RAM. A dash-memd
restarted before the disk works again serves the older states the files
hold, which the nodes recover from as above. The same holds for the state
files ``dashrun rm`` removes: a removal that fails is retried, and until it
succeeds a restart may serve the removed job's states again, as if the
removal had not been asked.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import shutil
import threading
import time
from pathlib import Path

from dashrun.errors import NoSpaceError, ProtocolError, UsageError
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.files import discard_tree, write_atomic
from dashrun.util.problems import ProblemLog
from dashrun.wire.heartbeats import Liveness, liveness
from dashrun.wire.messages import MAX_RDZV_STATE
from dashrun.wire.protocol import MAX_STEP, field_b64, field_int, field_run_id, valid_job_id

__all__ = ["MAX_RDZV_BYTES", "MAX_RDZV_JOBS", "MAX_RUN_IDS", "RENDEZVOUS", "RendezvousStates", "TokenSource"]

log = logging.getLogger(__name__)

#: Directory in the data dir that holds the states and the token counter.
RENDEZVOUS = "rendezvous"
#: Run ids one job may have states of (each elastic launch of a job uses one).
MAX_RUN_IDS = 4
#: Jobs with rendezvous states at once.
MAX_RDZV_JOBS = 1024
#: Bytes of rendezvous states held at once, all jobs together.
MAX_RDZV_BYTES = 256 << 20
_TOKENS = "TOKENS"
#: ProblemLog keys of the token counter's file and of the state files.
_COUNTER, _STATES = "token counter", "state files"


class TokenSource:
    """Fencing tokens: strictly increasing, never handed out twice for the life of the data dir.

    The file holds the highest token that may have been handed out; tokens are
    reserved ``block`` at a time, each reservation written and fsynced before
    its first token is used, so a restart (even after a power loss) starts
    above every token used before. The next block is reserved once less than
    half a block is left; if that write fails, the tokens already reserved are
    still handed out (the write is tried again at each one), and only a token
    beyond every reservation on disk is refused (OSError), never handed out.
    """

    def __init__(self, path: Path, block: int = 1 << 16):
        self.path = path
        self.block = block
        self._lock = threading.Lock()
        self._next = 1
        self._reserved = 0
        self._problems = ProblemLog(log)

    def load(self) -> None:
        try:
            reserved = int(self.path.read_text().strip())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            # Without it, a token could be handed out twice: refusing to start is the only safe answer.
            raise UsageError(f"cannot read the rendezvous token counter {self.path} ({e})",
                             hint=f"restore it, or delete the whole {self.path.parent} to forget every job's "
                                  "rendezvous state") from None
        with self._lock:
            self._next = max(self._next, reserved + 1)

    def past(self, token: int) -> None:
        """Never hand out ``token`` or anything below it (a token read back from a state file)."""
        with self._lock:
            self._next = max(self._next, token + 1)

    def next(self) -> int:
        """The next token; OSError (and no token used up) if it is beyond every reservation and the counter's
        file cannot be written."""
        with self._lock:
            token = self._next
            if token > MAX_STEP:
                raise NoSpaceError("dash-memd has run out of rendezvous tokens", hint="delete its rendezvous/ dir")
            if token > self._reserved:
                self._reserve(min(token + self.block - 1, MAX_STEP))  # raises: nothing handed out
            elif self._reserved - token < self.block // 2 and self._reserved < MAX_STEP:
                try:  # ahead of need, so that a disk failing from now on costs no token for half a block
                    self._reserve(min(self._reserved + self.block, MAX_STEP))
                except OSError:
                    pass  # logged; this token is reserved already, the next one tries again
            self._next = token + 1
            return token

    def _reserve(self, reserved: int) -> None:
        """Record on disk (fsynced) that tokens up to ``reserved`` may be handed out; OSError if it fails."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, f"{reserved}\n")  # fsynced: no later start may hand these out again
        except OSError as e:
            self._problems.problem(_COUNTER, _kind(e), "rendezvous: cannot reserve tokens in %s (%s): tokens up to "
                                   "%d may be handed out, then every rendezvous set fails until it is written",
                                   self.path, e, self._reserved)
            raise
        self._reserved = reserved
        self._problems.ok(_COUNTER, "rendezvous: token counter %s written again", self.path)


class RendezvousStates:
    """Every job's rendezvous states; every method is safe to call from any thread.

    ``root`` is ``<data dir>/rendezvous``. :meth:`load` reads what an earlier
    dash-memd left there; until then the states are empty.
    """

    def __init__(self, root: Path):
        self.root = root
        self.tokens = TokenSource(root / _TOKENS)
        self._lock = threading.Lock()  # guards everything below; held while a state file is replaced
        self._changed = threading.Condition(self._lock)  # notified at every set and deletion
        self._states: dict[str, dict[str, tuple[bytes, int]]] = {}  # job -> run id -> (state, token)
        self._bytes = 0
        # What RAM holds and the files do not yet (a write or removal failed): retried at every change.
        self._unwritten: dict[tuple[str, str], None] = {}  # (job, run id), as an ordered set
        self._undeleted: dict[str, None] = {}  # jobs whose directory is still to be removed
        self._problems = ProblemLog(log)

    def load(self) -> None:
        """Read the token counter and every state file; a state file that cannot be read is skipped (its
        rendezvous starts over: the nodes' next sets fail and they rendezvous again)."""
        self.tokens.load()
        if not self.root.is_dir():  # made at the first set
            return
        found = 0
        with self._lock:
            for job_dir in sorted(self.root.iterdir()):
                if job_dir.name.startswith(".trash-"):  # a deletion a stop interrupted
                    shutil.rmtree(job_dir, ignore_errors=True)
                if not job_dir.is_dir() or not valid_job_id(job_dir.name):
                    continue
                for leftover in job_dir.glob(".*.tmp"):  # a replacement a stop interrupted
                    leftover.unlink(missing_ok=True)
                for path in sorted(job_dir.glob("*.json")):
                    try:
                        state, token, run_id = _read_state(path)
                    except (OSError, ValueError, ProtocolError) as e:
                        log.warning("rendezvous: ignored %s: %s", path, e)
                        continue
                    runs = self._states.setdefault(job_dir.name, {})
                    if len(runs) >= MAX_RUN_IDS or path.stem != run_id:
                        log.warning("rendezvous: ignored %s: %s", path,
                                    "too many run ids" if path.stem == run_id else "its name is not its run id")
                        continue
                    runs[run_id] = (state, token)
                    self._bytes += len(state)
                    self.tokens.past(token)
                    found += 1
        if found:
            log.info("rendezvous: %d states of %d jobs", found, len(self._states))

    def get(self, job: str, run_id: str, unlike: int | None = None, wait: float = 0.0) -> tuple[bytes, int] | None:
        """The state and token held, or None. With ``wait``, once the token is not ``unlike`` (a node that
        polls for a change of the rendezvous: held here until another node sets the state, up to ``wait``
        seconds, rather than asking again every second)."""
        held = lambda: self._states.get(job, {}).get(run_id)  # noqa: E731
        with self._changed:
            if wait > 0:
                self._changed.wait_for(lambda: (held() or (None, None))[1] != unlike, timeout=wait)
            return held()

    def liveness(self, job: str) -> list[Liveness]:
        """What each of ``job``'s rendezvous states says of its members now, by the heartbeat settings its nodes
        sent with it; a state that is not dashrun's is left out (nobody can rendezvous on it)."""
        with self._lock:
            states = [state for state, _ in self._states.get(job, {}).values()]
        now = time.time()  # the nodes stamp their heartbeats with their clocks, as torch compares them: see there
        found = []
        for state in states:
            try:
                found.append(liveness(state, now))
            except ValueError as e:
                log.debug("rendezvous: a state of %s is not dashrun's: %s", job, e)
        return found

    def set(self, job: str, run_id: str, state: bytes, token: int | None) -> tuple[bytes, int, bool] | None:
        """Store ``state`` iff ``token`` is the current token (None: iff there is none yet); returns the state
        and token now held and whether this call set them, or None if there is no state and ``token`` is not
        None (torch's ``set_state`` answers None then too). Raises NoSpaceError past the bounds, and OSError if
        no token can be reserved on disk (:class:`TokenSource`); a state file that cannot be written fails
        nothing (it is written at a later change, see the module's docstring)."""
        if len(state) > MAX_RDZV_STATE:
            raise NoSpaceError(f"a rendezvous state of {len(state)} bytes exceeds the {MAX_RDZV_STATE} allowed")
        with self._lock:
            runs = self._states.get(job, {})
            current = runs.get(run_id)
            if current is None and token is not None:
                return None
            if current is not None and current[1] != token:
                return current[0], current[1], False
            if current is None:
                if job not in self._states and len(self._states) >= MAX_RDZV_JOBS:
                    raise NoSpaceError(f"dash-memd holds rendezvous states of {MAX_RDZV_JOBS} jobs already",
                                       hint="remove finished jobs with: dashrun rm JOB")
                if len(runs) >= MAX_RUN_IDS:
                    raise NoSpaceError(f"job {job} has rendezvous states of {MAX_RUN_IDS} run ids already",
                                       hint=f"remove the job's records with: dashrun rm {job}")
            grown = len(state) - (len(current[0]) if current else 0)
            if self._bytes + grown > MAX_RDZV_BYTES:
                raise NoSpaceError(f"dash-memd holds {MAX_RDZV_BYTES} bytes of rendezvous states already",
                                   hint="remove finished jobs with: dashrun rm JOB")
            new = (bytes(state), self.tokens.next())  # raises before anything changed
            self._states.setdefault(job, {})[run_id] = new
            self._bytes += grown
            self._unwritten[(job, run_id)] = None
            self._flush(first=(job, run_id))  # before the answer where the disk allows: a restart serves it
            self._changed.notify_all()
            return new[0], new[1], True

    def delete_job(self, job: str) -> None:
        """Forget every rendezvous state of ``job`` (``dashrun rm``); its tokens are never handed out again."""
        with self._lock:
            runs = self._states.pop(job, {})
            self._bytes -= sum(len(state) for state, _ in runs.values())
            for run_id in runs:
                self._unwritten.pop((job, run_id), None)
            if runs or job in self._undeleted or (self.root / job).exists():
                self._undeleted[job] = None  # a job's few state files: gone before a new state can be written
                self._flush()
            self._changed.notify_all()

    def flush(self) -> bool:
        """Write every state file that is behind RAM (dash-memd stops); False if some still cannot be."""
        with self._lock:
            return self._flush()

    def _flush(self, first: tuple[str, str] | None = None) -> bool:
        """Bring the files up to RAM: removals first (a state set after its job's removal must not go into the
        directory still to be removed), then each state file behind, ``first`` first. Stops at the first
        failure, which is logged: the disk still fails, and the rest waits for the next change rather than fail
        once per file."""
        if not self._unwritten and not self._undeleted:
            return True
        try:
            while self._undeleted:
                job = next(iter(self._undeleted))
                discard_tree(self.root / job)
                del self._undeleted[job]
                for run_id in self._states.get(job, {}):
                    self._unwritten[(job, run_id)] = None
            order = ([first] if first in self._unwritten else []) + [key for key in self._unwritten if key != first]
            for job, run_id in order:
                held = self._states.get(job, {}).get(run_id)
                if held is not None:
                    self._write(job, run_id, *held)
                del self._unwritten[(job, run_id)]
        except OSError as e:
            self._problems.problem(_STATES, _kind(e), "rendezvous: cannot write the state files in %s (%s): the "
                                   "states are kept in RAM and written at a later change; a dash-memd restarted "
                                   "before then serves older states, and the nodes rendezvous again",
                                   self.root, e)
            return False
        self._problems.ok(_STATES, "rendezvous: the state files in %s are written again", self.root)
        return True

    def _write(self, job: str, run_id: str, state: bytes, token: int) -> None:
        job_dir = self.root / job
        job_dir.mkdir(parents=True, exist_ok=True)
        body = {"run_id": run_id, "token": token, "state": base64.b64encode(state).decode()}
        write_atomic(job_dir / f"{run_id}.json", json.dumps(body), durable=False)  # why not durable: see above


def _kind(error: OSError) -> str:
    """The kind of a failure, for the log-once: one per errno (a full disk, then an I/O error, are two)."""
    return errno.errorcode.get(error.errno, str(error.errno)) if error.errno else type(error).__name__


def _read_state(path: Path) -> tuple[bytes, int, str]:
    with open(path, "rb") as f:
        raw = f.read(4 * MAX_RDZV_STATE // 3 + 4096 + 1)  # bounded before it is parsed
    if len(raw) > 4 * MAX_RDZV_STATE // 3 + 4096:
        raise ValueError("too large")
    body = loads_bounded(raw)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    return field_b64(body, "state", MAX_RDZV_STATE), field_int(body, "token", 1, MAX_STEP), field_run_id(body)
