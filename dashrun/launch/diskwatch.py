"""The training terminal hears when its job's checkpoints stop reaching dash-memd's disk, and when they do again.

A disk that fails (full, read-only, gone) leaves dash-memd serving from RAM,
and says so in its own log and in ``dashrun status``: places a person
training does not look. :class:`DiskWatch` asks dash-memd about the job every
few seconds (one small LIST, filtered to the job) and prints one line when
the job's ``disk_error`` appears, and one when it clears.
"""

from __future__ import annotations

import logging
import sys
import threading

from dashrun.errors import DashError
from dashrun.launch.options import LaunchOptions
from dashrun.util.tokens import read_token
from dashrun.wire.memd_client import MemdClient

__all__ = ["POLL", "DiskWatch"]

log = logging.getLogger(__name__)

#: Seconds between looks.
POLL = 3.0


class DiskWatch:
    """A thread that looks at the job's ``disk_error`` in dash-memd every ``poll`` seconds, and once more at the end
    (a short run can end before the first look)."""

    def __init__(self, options: LaunchOptions, poll: float = POLL):
        self.options = options
        self.poll = poll
        self.failing = False
        self._token = read_token(options.token_file)
        self._client: MemdClient | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dashrun-disk-watch", daemon=True)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.look()
        if self._client is not None:
            self._client.close()

    def _watch(self) -> None:
        while not self._done.wait(self.poll):
            self.look()

    def look(self) -> None:
        """Ask dash-memd once; print a line if the job's checkpoints stopped reaching its disk, or reach it again."""
        job = self.options.job_id
        try:
            if self._client is None:
                self._client = MemdClient(*self.options.memd, self._token, timeout=5, tls=self.options.tls)
            jobs = self._client.list(job)["jobs"]
        except DashError as e:  # unreachable: dash-agent says so when it matters, as shards fail to go
            log.debug("could not ask dash-memd about %s's disk writes: %s", job, e)
            if self._client is not None:
                self._client.close()
                self._client = None
            return
        summary = next((j for j in jobs if j.get("job") == job), None)
        error = summary.get("disk_error") if summary is not None else None
        if isinstance(error, str) and error and not self.failing:
            self.failing = True
            print(f"dashrun: {job}'s checkpoints are not reaching dash-memd's disk: {error}; they are kept in its "
                  "RAM", file=sys.stderr)
        elif error is None and self.failing:
            self.failing = False
            print(f"dashrun: {job}'s checkpoints reach dash-memd's disk again", file=sys.stderr)
