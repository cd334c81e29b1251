"""SIGTERM and SIGINT as preemption notices, in one process: the launcher's handler and grace, the rank's notice.

The end-to-end runs are in test_preemption.py (SIGTERM to a launcher, and to its whole group and ranks) and
test_e2e.py (a launcher killed outright); here the parts are driven directly, each real signal sent to this
process with the handler under test installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for
from torch.distributed.elastic.multiprocessing.api import SignalException

from dashrun.launch.preemption import StopSignals, torch_signals
from dashrun.rank.notices import NoticeBoard
from dashrun.util import daemon
from dashrun.wire.messages import Notice


@pytest.fixture
def stop_signals():
    """``stop_signals(grace, ranks)``: a StopSignals installed in this process, its handlers put back after."""
    made: list[StopSignals] = []

    def make(grace: float = 30.0, ranks=lambda: ()) -> StopSignals:
        made.append(StopSignals(grace, ranks=ranks).install())
        return made[-1]

    yield make
    for stop in reversed(made):  # each puts back what it replaced
        stop.restore()


def handler_raises(cause, what: str) -> BaseException:
    """Call ``cause``, then wait (polling) until the handler raises here, in the main thread; what it raised."""
    try:
        cause()
        daemon.wait_until(lambda: False, 10, what)
    except (SignalException, KeyboardInterrupt) as e:
        return e
    raise AssertionError(f"the handler never raised: {what}")


def test_a_stop_signal_is_passed_on_to_each_rank_once_and_the_grace_ends_in_torch_s_shutdown(stop_signals):
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stop = stop_signals(grace=1.0, ranks=lambda: {rank.pid})
        stop.launching = True
        signalled = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler: nothing else happens here
        assert stop.signal == signal.SIGTERM and stop.killed is None
        stop.tick()  # as the watcher's thread does: the rank gets SIGTERM
        assert rank.wait(timeout=30) == -signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # again (the group, then the launcher alone): the grace runs on
        assert stop.killed is None

        wait_for(lambda: time.monotonic() > signalled + stop.grace, 10, "the grace to pass")
        raised = handler_raises(threading.Thread(target=stop.tick).start,  # as the watcher's thread does
                                "the ranks to be killed once the grace is over")
    finally:
        rank.kill()
        rank.wait()
    # torch's agent, running in this thread, kills the ranks at once: they had their SIGTERM and their grace.
    assert isinstance(raised, SignalException) and raised.sigval == signal.SIGKILL
    assert stop.killed == "the grace of 1s ran out"


def test_a_second_sigint_kills_the_ranks_at_once_or_ends_the_set_up(stop_signals):
    stop = stop_signals()
    stop.launching = True
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signal == signal.SIGINT and stop.killed is None  # the first: the same path as SIGTERM
    raised = handler_raises(lambda: os.kill(os.getpid(), signal.SIGINT), "a second SIGINT")
    assert isinstance(raised, SignalException) and raised.sigval == signal.SIGKILL
    assert stop.killed == "a second SIGINT"

    before = stop_signals()  # no rank runs yet (or any more): Ctrl-C twice is Python's KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT)
    assert isinstance(handler_raises(lambda: os.kill(os.getpid(), signal.SIGINT), "a second SIGINT during the set-up"),
                      KeyboardInterrupt)
    assert before.signal == signal.SIGINT


def test_torch_handles_the_other_signals_it_is_told_to():
    assert torch_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGHUP,SIGQUIT"
    assert torch_signals(" SIGUSR1 , SIGTERM") == "SIGUSR1"
    assert torch_signals("SIGTERM") == "SIGHUP"  # torch reads an empty list as one bad name


def test_sigterm_is_a_rank_s_own_notice_with_the_launcher_s_grace_as_its_deadline():
    board = NoticeBoard(world=1, early_interval=2, term_grace=25.0)
    assert not board.agree().emergency and not board.noticed_here
    before = time.time()
    board.on_signal()
    board.on_signal()  # the scheduler's and the launcher's: one notice
    agreed = board.agree()
    assert agreed.emergency and board.noticed_here
    assert before + 25.0 <= agreed.deadline <= time.time() + 25.0
    assert board.signal_unsaid() and not board.signal_unsaid()  # said once

    # A cloud's deadline that comes sooner is the one kept.
    board.on_notice(Notice("aws", "terminate", time.time() + 5).to_body())
    assert board.agree().deadline < before + 10


HUNG_SHUTDOWN = """
import os, signal, subprocess, sys, threading
from torch.distributed.elastic.multiprocessing.api import SignalException
from dashrun.launch.preemption import StopSignals

# a rank that ignores SIGTERM, in a session of its own as torch starts it, with a child of its own
rank = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time; "
                         "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                         "print(child.pid, flush=True); time.sleep(300)"], start_new_session=True,
                        stdout=subprocess.PIPE, text=True)
print(rank.pid, rank.stdout.readline().strip(), flush=True)
stop = StopSignals(0.5, ranks=lambda: {rank.pid}, overrun=1.0).install()
stop.launching = True
done = threading.Event()
def watch():  # the PreemptionWatcher's thread
    while not done.wait(0.05):
        stop.tick()
threading.Thread(target=watch, daemon=True).start()
print("ready", flush=True)
blocked = threading.Event()
try:
    blocked.wait()            # torch's agent runs the ranks
except SignalException:
    print("torch's shutdown", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    blocked.wait()            # and hangs in it, as in a TCPStore whose host is gone
sys.exit(3)
"""


@pytest.mark.parametrize("terminal", ["there", "hung up"])
def test_a_launcher_whose_torch_shutdown_hangs_exits_after_the_grace_and_kills_its_ranks(tmp_path, terminal):
    """And so it does when its terminal hung up before it could say so (a fan-out closes a host's SSH session
    after its grace: every write to stderr fails from then on)."""
    launcher = subprocess.Popen([sys.executable, "-c", HUNG_SHUTDOWN], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert launcher.stdout.readline().strip() == "ready"
        if terminal == "hung up":
            launcher.stderr.close()  # its writes to stderr fail (EPIPE), as to a terminal hung up (EIO)
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)  # what it writes in the meantime fits the pipes' buffers
        stdout = launcher.stdout.read()
        stderr = launcher.stderr.read() if terminal == "there" else ""
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for stream in (launcher.stdout, launcher.stderr):
            stream.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 75, stderr
    assert "torch's shutdown" in stdout  # the grace ran out into torch's shutdown, which never ended
    if terminal == "there":
        assert "still running 1.5s after SIGINT (torch's shutdown did not end)" in stderr
    for pid in pids:  # the rank and its child are gone (reaped by init once their parents are)
        wait_for(lambda: not _alive(pid), 30, f"process {pid} to be gone")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
