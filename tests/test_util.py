"""The one-per-mechanism helpers: retry with backoff, log each problem once, start a daemon; sizes; the
preemption record between dash-agent and the launcher."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dashrun.env import PreemptionRecord
from dashrun.errors import UnavailableError, UsageError
from dashrun.util import daemon
from dashrun.util.problems import ProblemLog
from dashrun.util.retry import Backoff, countdown, retry
from dashrun.util.units import format_size, parse_size

# --- retry ---------------------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_longest_and_resets():
    backoff = Backoff(0.5, 3.0, jitter=0.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_backoff_jitter_stays_within_its_band():
    backoff = Backoff(2.0, 2.0, jitter=0.5)
    assert all(1.0 <= backoff.next_delay() <= 2.0 for _ in range(200))


def test_retry_tries_until_it_works_and_says_why_it_waits():
    calls, told, slept = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise UnavailableError(f"down {len(calls)}")
        return "up"

    result = retry(flaky, on=UnavailableError, backoff=Backoff(1.0, 8.0, jitter=0.0),
                   on_retry=lambda e, pause: told.append((str(e), pause)), sleep=slept.append)
    assert result == "up" and len(calls) == 3
    assert told == [("down 1", 1.0), ("down 2", 2.0)] and slept == [1.0, 2.0]


def test_retry_gives_up_after_its_attempts_with_the_last_error():
    calls = []

    def down():
        calls.append(1)
        raise UnavailableError(f"down {len(calls)}")

    with pytest.raises(UnavailableError, match="down 4"):
        retry(down, on=UnavailableError, backoff=Backoff(0.01, 0.01), attempts=4, sleep=lambda s: None)
    assert len(calls) == 4


def test_retry_never_pauses_past_its_deadline():
    calls = []

    def down():
        calls.append(1)
        raise UnavailableError("down")

    paused: list[float] = []
    with pytest.raises(UnavailableError):
        retry(down, on=UnavailableError, backoff=Backoff(10.0, 10.0, jitter=0.0), deadline=time.monotonic() + 5,
              sleep=paused.append)
    # The 10 s pause would end past the deadline: retry gave up at once, without pausing at all.
    assert len(calls) == 1 and paused == []


def test_retry_lets_other_errors_and_hopeless_ones_through_at_once():
    with pytest.raises(UsageError):
        retry(lambda: (_ for _ in ()).throw(UsageError("bad")), on=UnavailableError, backoff=Backoff())
    calls = []

    def refused():
        calls.append(1)
        raise UnavailableError("refused")

    with pytest.raises(UnavailableError):
        retry(refused, on=UnavailableError, backoff=Backoff(), giving_up=lambda e: "refused" in str(e))
    assert len(calls) == 1


def test_a_wait_with_a_deadline_says_how_long_more_once_then_every_ten_seconds():
    """30 s of tries every 2 s: three lines that count down, not fifteen that say it goes on."""
    clock = [time.monotonic()]  # what the sleeps below advance: the 16 tries of 30 s take no time
    said: list[str] = []

    def down():
        raise UnavailableError("cannot reach dash-memd")

    def sleep(pause: float) -> None:
        clock[0] += pause

    deadline = clock[0] + 30
    with pytest.raises(UnavailableError):
        retry(down, on=UnavailableError, backoff=Backoff(2.0, 2.0, jitter=0.0), deadline=deadline,
              on_retry=countdown(said.append, deadline, clock=lambda: clock[0]), sleep=sleep, attempts=16)
    assert said == ["cannot reach dash-memd; retrying for 30 s more", "cannot reach dash-memd; retrying for 20 s more",
                    "cannot reach dash-memd; retrying for 10 s more"]


# --- log each problem once ----------------------------------------------------------------------


def test_each_kind_of_problem_is_logged_once_until_it_works_again(caplog):
    caplog.set_level(logging.DEBUG, logger="test.problems")
    problems = ProblemLog(logging.getLogger("test.problems"))
    assert problems.problem("job-a", "timeout", "job-a: %s", "timed out")
    assert not problems.problem("job-a", "timeout", "job-a: %s", "timed out again")
    assert problems.problem("job-a", "refused", "job-a: refused")
    assert problems.problem("job-b", "timeout", "job-b: timed out")  # per key
    assert problems.failing("job-a")
    assert problems.ok("job-a", "job-a works again")
    assert not problems.ok("job-a", "job-a works again")  # said once
    assert problems.problem("job-a", "timeout", "job-a: timed out after it worked")
    loud = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert loud == [(logging.WARNING, "job-a: timed out"), (logging.WARNING, "job-a: refused"),
                    (logging.WARNING, "job-b: timed out"), (logging.INFO, "job-a works again"),
                    (logging.WARNING, "job-a: timed out after it worked")]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == ["job-a: timed out again"]


# --- start a daemon -----------------------------------------------------------------------------


def test_a_daemon_is_started_when_ready_and_stopped(tmp_path):
    ready = tmp_path / "ready"
    code = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
            f"time.sleep(0.3); pathlib.Path({str(ready)!r}).write_text('up'); time.sleep(60)")
    proc = daemon.start([sys.executable, "-c", code], ready=daemon.file_written(ready), what="the test daemon",
                        timeout=30)
    try:
        assert proc.poll() is None and ready.read_text() == "up"
    finally:
        assert daemon.stop(proc, timeout=10) == 7  # SIGTERM first: it exits its own way


def test_a_daemon_that_dies_before_it_is_ready_is_reported_with_its_log(tmp_path):
    log = tmp_path / "daemon.log"
    with pytest.raises(UnavailableError, match=r"exited with code 3 before it was ready; see .*daemon\.log"):
        daemon.start([sys.executable, "-c", "import sys; print('cannot bind'); sys.exit(3)"],
                     ready=daemon.file_written(tmp_path / "never"), what="the test daemon", log=log, timeout=30)
    assert "cannot bind" in log.read_text()


def test_a_daemon_that_never_gets_ready_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    with pytest.raises(UnavailableError, match="not ready within"):
        daemon.start([sys.executable, "-c", code], ready=lambda: False, what="the test daemon", timeout=1)
    pid = int(daemon.wait_until(lambda: pid_file.exists() and pid_file.read_text(), 10, "the pid"))
    daemon.wait_until(lambda: subprocess.run(["ps", "-p", str(pid), "-o", "stat="], capture_output=True,
                                             text=True).stdout.strip() in ("", "Z"), 10, "the daemon to be gone")


def test_wait_until_returns_the_value_or_times_out():
    values = iter([0, None, "", 5])
    assert daemon.wait_until(lambda: next(values), 5, "a value") == 5
    with pytest.raises(TimeoutError, match="waiting for nothing"):
        daemon.wait_until(lambda: False, 0.1, "nothing")


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("48GiB", 48 << 30), ("48Gi", 48 << 30), ("512MiB", 512 << 20), ("1.5KiB", 1536), ("2TiB", 2 << 40),
    ("40GB", 40 * 10**9), ("40G", 40 * 10**9), ("2kB", 2000), ("3 MB", 3 * 10**6), ("1073741824", 1 << 30),
    ("100B", 100), (4096, 4096),
])
def test_sizes_follow_the_usual_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-1GiB", "1,5GB", "48 GiBs"])
def test_a_size_that_is_not_one_is_refused_with_a_hint(text):
    with pytest.raises(UsageError, match="not a size") as info:
        parse_size(text)
    assert "48GiB" in info.value.hint


def test_sizes_are_shown_in_binary_units():
    assert format_size(48 << 30) == "48.0 GiB" and format_size(512) == "512 B"


# --- the preemption record ----------------------------------------------------------------------


def test_the_preemption_record_round_trips_and_refuses_what_it_did_not_write():
    for record in (PreemptionRecord(PreemptionRecord.NOTICE, cloud="aws", kind="terminate", deadline=1.7e9),
                   PreemptionRecord(PreemptionRecord.JOB, step=1400)):
        assert PreemptionRecord.from_json(record.to_json()) == record
    for text in ('{"reason": "bored"}', "[]", '{"reason": "job", "step": "12"}',
                 '{"reason": "notice", "deadline": "x"}', "not json"):
        with pytest.raises(ValueError):
            PreemptionRecord.from_json(text)


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "through-the-cache"])
def test_write_new_hands_over_every_byte_written_once_in_order(tmp_path, aligned):
    import mmap
    import os

    from dashrun.util.files import write_new

    size = (16 << 20) + 5000  # two O_DIRECT chunks and an unaligned tail
    buffer = mmap.mmap(-1, size + 1)  # page-aligned; one byte in, it is not
    data = memoryview(buffer)[:size] if aligned else memoryview(buffer)[1:]
    data[:] = os.urandom(size)
    pieces: list[bytes] = []
    write_new(tmp_path / "f", data, bypass_cache=True, written_piece=lambda piece: pieces.append(bytes(piece)))
    assert b"".join(pieces) == bytes(data) == (tmp_path / "f").read_bytes()
    data.release()
    buffer.close()


# --- scratch folders -------------------------------------------------------------------------------

_MAKER = """import sys, time
from dashrun.util.scratch import Scratch
folder = Scratch("dashrun-test-")
(folder.path / "job-credential").write_text("secret")
print(folder.path, flush=True)
time.sleep(600)
"""


def test_a_scratch_folder_whose_maker_was_killed_outright_is_removed_by_the_next(tmp_path, monkeypatch):
    from dashrun.util.scratch import GRACE_S, Scratch, sweep

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    makers = [subprocess.Popen([sys.executable, "-c", _MAKER], env=env, stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        killed, alive = (Path(maker.stdout.readline().strip()) for maker in makers)
        makers[0].send_signal(signal.SIGKILL)  # no finally runs: its folder and the credential in it stay
        makers[0].wait(timeout=30)
        assert (killed / "job-credential").exists()
        unlocked = tmp_path / "dashrun-test-not-ours"  # no lock file: not one of these folders
        unlocked.mkdir()
        old = time.time() - 2 * GRACE_S
        for folder in (killed, alive, unlocked):
            os.utime(folder, (old, old))
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
        made = Scratch("dashrun-test-")  # sweeps first
        try:
            assert not killed.exists()
            assert (alive / "job-credential").read_text() == "secret"  # its maker holds the lock
            assert unlocked.is_dir()
            assert sweep("dashrun-test-", grace_s=0) == []  # the new one is held too
        finally:
            made.remove()
        assert not made.path.exists()
        makers[1].terminate()
        makers[1].wait(timeout=30)
        assert sweep("dashrun-test-", grace_s=0) == [alive]
    finally:
        for maker in makers:
            if maker.poll() is None:
                maker.kill()
            maker.wait()
            maker.stdout.close()
