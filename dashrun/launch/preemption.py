"""A node told to stop: a cloud's notice (dash-agent's preemption record) or a scheduler's SIGTERM; exit 75.

dash-agent writes a :class:`dashrun.env.PreemptionRecord` beside its socket
when this node must stop (an interruption notice of its cloud, or the job's
emergency checkpoint taken on another node). The launcher watches for it
while the ranks run, stops ranks that run past the notice's deadline, and
ends with exit code 75 and one line saying where the job stands.

SIGTERM to the launcher (or SIGINT, Ctrl-C) is the same kind of news: the
way Kubernetes, Slurm and SkyPilot say that the job's time is up, SIGKILL
following after a grace period. :class:`StopSignals` records it; the
watcher's thread passes it on to the ranks, whose Checkpointer takes it as a
notice (:mod:`dashrun.rank.notices`), and kills ranks still running when the
grace is over. The run then ends as after a cloud's notice: exit 75.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from dashrun.env import PreemptionRecord
from dashrun.errors import DashError, ExitCode
from dashrun.launch.options import LaunchOptions
from dashrun.util.tokens import read_token
from dashrun.wire.memd_client import MemdClient

__all__ = ["PreemptionWatcher", "StopSignals", "report_preempted", "torch_signals"]

log = logging.getLogger(__name__)

#: Seconds between looks at the record (and at the ranks, after a stop signal).
POLL = 0.2
#: Ranks still running this long before a notice's deadline are stopped.
STOP_MARGIN = 5.0
#: The signals the launcher takes itself; torch's elastic agent handles the others it is told to.
TAKEN = (signal.SIGTERM, signal.SIGINT)
#: Seconds past the grace that torch's shutdown may take before the launcher exits without it: its rendezvous
#: teardown can block in C++ (a TCPStore whose host is gone), where no signal handler runs, for minutes.
OVERRUN = 30.0


def torch_signals(signals_to_handle: str) -> str:
    """torchrun's ``--signals-to-handle`` without the signals dashrun takes itself (torch's agent would install its
    own handler for them at every start of the ranks). torch reads an empty list as one bad name: what is left
    when nothing is, is SIGHUP, which torch stops the ranks on as a terminal's hang-up ends them."""
    taken = {sig.name for sig in TAKEN}
    kept = [name.strip() for name in signals_to_handle.split(",") if name.strip() and name.strip() not in taken]
    return ",".join(kept) or "SIGHUP"


class StopSignals:
    """SIGTERM and SIGINT to the launcher, taken as a preemption notice (torchrun would stop the ranks at once).

    The handler only records the first signal; :meth:`tick`, called by the
    :class:`PreemptionWatcher`'s thread, acts on it:

    1. each rank of this node gets SIGTERM — torch starts each in a session
       of its own, so a signal to the launcher's process group reaches none of
       them — which its Checkpointer takes as a notice: the next ``save()``
       takes the emergency checkpoint on every rank of the job, waits until it
       is committed, and the rank ends by itself, as after a cloud's notice;
    2. a rank started after that (torch restarting a failed one) gets it too;
    3. ranks still running ``grace`` seconds after the signal (torchrun's
       ``--shutdown-timeout``) are killed, and so they are at once on a
       second SIGINT (Ctrl-C twice): through torch's own shutdown, which its
       agent (running in the main thread, where the handler runs) starts on
       the one exception it takes for that, ``SignalException``;
    4. a launcher still running ``overrun`` seconds after that (torch's
       shutdown hung) kills what is left of its ranks and exits 75 at once:
       dash-agent and the private dash-memd see their parent gone, deliver
       what they hold and exit (``--parent-pid``).
    """

    def __init__(self, grace: float, ranks: Callable[[], Iterable[int]], overrun: float = OVERRUN):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.grace, self.overrun = grace, overrun
        self.ranks = ranks  # the pids of this node's ranks now
        self.signal: signal.Signals | None = None  # the first stop signal
        self.killed: str | None = None  # why the ranks were (to be) killed before they stopped by themselves
        #: torch's agent runs the ranks in the main thread now: a SignalException there stops them
        self.launching = False
        self._received_at = 0.0
        self._exception = SignalException  # imported here, never by the handler
        self._raised = False
        self._announced = False
        self._told: set[int] = set()
        self._before: dict[int, object] = {}

    def install(self) -> StopSignals:
        """Take SIGTERM and SIGINT (from the main thread); :meth:`restore` gives them back."""
        for sig in TAKEN:
            self._before[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, before in self._before.items():
            signal.signal(sig, before if before is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame) -> None:
        if self.killed is None:
            if self.signal is None:
                self.signal, self._received_at = signal.Signals(signum), time.monotonic()
                return
            if signum != signal.SIGINT:
                return  # SIGTERM again: the grace runs already
            self.killed = "a second SIGINT"
            if not self.launching:
                raise KeyboardInterrupt  # no rank runs: Ctrl-C twice ends the set-up (or the end) as Python does
        if self.launching and not self._raised:
            self._raised = True
            # SIGKILL, not torch's SIGTERM and its wait: the ranks had their SIGTERM, and their grace.
            raise self._exception(f"dashrun: the ranks are killed ({self.killed})", sigval=signal.SIGKILL)

    def kill_ranks(self, why: str) -> None:
        """From another thread: the ranks must end now (through torch's shutdown, in the main thread)."""
        if self.killed is None:
            self.killed = why
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def _exit_without_torch(self) -> None:
        _say(f"dashrun: still running {self.grace + self.overrun:g}s after {self.signal.name} (torch's shutdown did "
             "not end): killing what is left of the ranks and exiting")
        for pid in self.ranks():
            try:
                os.killpg(pid, signal.SIGKILL)  # torch starts each rank in a session of its own: its children too
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        os._exit(int(ExitCode.PREEMPTED))

    def tick(self) -> None:
        """Pass a stop signal on to the ranks, and kill them once the grace is over (see the class's text)."""
        if self.signal is None:
            return
        if not self._announced:
            self._announced = True
            again = "; Ctrl-C again kills them now" if self.signal == signal.SIGINT else ""
            _say(f"dashrun: {self.signal.name}: the ranks take an emergency checkpoint and stop (within "
                 f"{self.grace:g}s{again})")
        if time.monotonic() - self._received_at > self.grace + self.overrun:
            self._exit_without_torch()
        if not self.launching:
            return
        for pid in set(self.ranks()) - self._told:
            self._told.add(pid)
            try:
                os.kill(pid, signal.SIGTERM)  # the rank alone: its own children (data loader workers) stay
            except ProcessLookupError:
                pass
        if self.killed is None and time.monotonic() - self._received_at > self.grace:
            _say(f"dashrun: the ranks did not stop within {self.grace:g}s of {self.signal.name}: killing them")
            self.kill_ranks(f"the grace of {self.grace:g}s ran out")


class PreemptionWatcher:
    """Watches for the agent's record that this node must stop; stops ranks that run past the deadline.

    The ranks stop by themselves after their emergency checkpoint. Ranks that
    never call save() again (a long evaluation, a hang) are stopped shortly
    before the notice's deadline — through torch's own shutdown, which sends
    them SIGTERM and SIGKILL after ``--shutdown-timeout`` — so that the node
    goes away with its processes ended, not cut off.
    """

    def __init__(self, path: Path, stop: StopSignals | None = None):
        self.path = path
        self.stop = stop
        self.stopped_ranks = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dashrun-preemption", daemon=True)

    def __enter__(self) -> PreemptionWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def record(self) -> PreemptionRecord | None:
        try:
            return PreemptionRecord.from_json(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _watch(self) -> None:
        while not self._done.wait(POLL):
            if self.stop is not None:
                self.stop.tick()
            record = self.record()
            deadline = record.deadline if record is not None else None
            if deadline is not None and time.time() >= deadline - STOP_MARGIN and not self.stopped_ranks:
                log.error("the ranks have not finished their emergency checkpoint and the notice's deadline is "
                          "%.0fs away: stopping them now", deadline - time.time())
                self.stopped_ranks = True
                if self.stop is not None:
                    self.stop.kill_ranks("the notice's deadline is near")
                else:
                    os.kill(os.getpid(), signal.SIGTERM)  # torch's elastic agent stops the workers


def report_preempted(options: LaunchOptions, watcher: PreemptionWatcher) -> int:
    """Exit 75, saying why and where the job stands."""
    record, stop = watcher.record(), watcher.stop
    stopped_by = stop.signal if stop is not None else None
    if stopped_by is not None:
        why = stopped_by.name
    elif record is not None and record.reason == record.NOTICE:
        why = f"{record.cloud} {record.kind} notice"
    else:
        why = "an interruption notice on another node of the job"
    newest, resumable = None, False
    try:
        with MemdClient(*options.memd, read_token(options.token_file), timeout=10, tls=options.tls) as client:
            newest = client.latest(options.job_id)
            resumable = client.get_spec(options.job_id) is not None  # signed by the operator at launch
        where = f"step {newest.step} is safe in dash-memd" if newest else "no checkpoint of this job is committed yet"
    except DashError as e:
        where = f"dash-memd could not be asked where the job stands ({e})"
    # This node's ranks handed over their emergency checkpoint (dash-agent's record of it) and it is the newest.
    emergency = (record is not None and record.reason == record.JOB and newest is not None
                 and newest.step == record.step)
    if watcher.stopped_ranks:
        _say("dashrun: error: the ranks were stopped before the notice's deadline without an emergency "
             "checkpoint; the newest committed one is used on resume")
    elif stopped_by is not None and not emergency:
        killed = f" (killed: {stop.killed})" if stop.killed else ""
        _say(f"dashrun: error: the ranks did not commit an emergency checkpoint after {stopped_by.name}{killed}; "
             "the newest committed one is used on resume")
    how = f" (or dashrun resume --job-id {options.job_id})" if resumable else ""
    _say(f"dashrun: preempted by {why}: {where}; run the same command{how} to continue")
    return int(ExitCode.PREEMPTED)


def _say(message: str) -> None:
    """``message`` on stderr, which may be a terminal that hung up (the SSH session of a fan-out, closed after
    its grace): what is said is lost then, not what the caller goes on to do (the watcher's thread must still
    stop what is left of the ranks, the launcher still exit 75)."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)
