"""A node told to stop: watch for dash-agent's preemption record, and report exit 75.

dash-agent writes a :class:`dashrun.env.PreemptionRecord` beside its socket
when this node must stop (an interruption notice of its cloud, or the job's
emergency checkpoint taken on another node). The launcher watches for it
while the ranks run, stops ranks that run past the notice's deadline, and
ends with exit code 75 and one line saying where the job stands.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dashrun.env import PreemptionRecord
from dashrun.errors import DashError, ExitCode
from dashrun.launch.options import LaunchOptions
from dashrun.util.tokens import read_token
from dashrun.wire.memd_client import MemdClient

__all__ = ["PreemptionWatcher", "report_preempted"]

log = logging.getLogger(__name__)

#: Seconds between looks at the record.
POLL = 0.2
#: Ranks still running this long before a notice's deadline are stopped.
STOP_MARGIN = 5.0


class PreemptionWatcher:
    """Watches for the agent's record that this node must stop; stops ranks that run past the deadline.

    The ranks stop by themselves after their emergency checkpoint. Ranks that
    never call save() again (a long evaluation, a hang) are stopped shortly
    before the notice's deadline — through torch's own shutdown, which sends
    them SIGTERM and SIGKILL after ``--shutdown-timeout`` — so that the node
    goes away with its processes ended, not cut off.
    """

    def __init__(self, path: Path):
        self.path = path
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
            record = self.record()
            deadline = record.deadline if record is not None else None
            if deadline is not None and time.time() >= deadline - STOP_MARGIN:
                log.error("the ranks have not finished their emergency checkpoint and the notice's deadline is "
                          "%.0fs away: stopping them now", deadline - time.time())
                self.stopped_ranks = True
                os.kill(os.getpid(), signal.SIGTERM)  # torch's elastic agent stops the workers
                return


def report_preempted(options: LaunchOptions, watcher: PreemptionWatcher) -> int:
    """Exit 75, saying why and where the job stands."""
    record = watcher.record()
    why = (f"{record.cloud} {record.kind} notice" if record is not None and record.reason == record.NOTICE else
           "an interruption notice on another node of the job")
    try:
        with MemdClient(*options.memd, read_token(options.token_file), timeout=10, tls=options.tls) as client:
            newest = client.latest(options.job_id)
        where = f"step {newest.step} is safe in dash-memd" if newest else "no checkpoint of this job is committed yet"
    except DashError as e:
        where = f"dash-memd could not be asked where the job stands ({e})"
    if watcher.stopped_ranks:
        print("dashrun: error: the ranks were stopped before the notice's deadline without an emergency "
              "checkpoint; the newest committed one is used on resume", file=sys.stderr)
    print(f"dashrun: preempted by {why}: {where}; run the same command (or dashrun resume --job-id "
          f"{options.job_id}) to continue", file=sys.stderr)
    return int(ExitCode.PREEMPTED)
