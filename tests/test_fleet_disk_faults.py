"""The fleet view's records with a failing disk: rendezvous states change in RAM and are written once the disk
works again, tokens are never handed out beyond what is reserved on disk, and a world generation is raised only
once it is saved. In-process with the records' file writes made to fail, and end to end on a full file system."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from dashrun.memd.fleet import membership, rendezvous
from dashrun.memd.fleet.requests import FleetRequests
from dashrun.memd.fleet.membership import Membership
from dashrun.memd.fleet.rendezvous import RendezvousStates, TokenSource
from dashrun.wire.messages import MembershipEvent, ShardHeader


class FailingDisk:
    """While ``failing`` holds an errno, the records' file writes and removals fail with it, as a full disk (or a
    broken one) fails them; ``attempts`` counts the writes tried while failing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.failing: int | None = None
        self.attempts = 0
        for module in (rendezvous, membership):
            monkeypatch.setattr(module, "write_atomic", self._failing(module.write_atomic))
        monkeypatch.setattr(rendezvous, "discard_tree", self._failing(rendezvous.discard_tree))

    def _failing(self, real):
        def call(path, *args, **kwargs):
            if self.failing is not None:
                self.attempts += 1
                raise OSError(self.failing, os.strerror(self.failing), str(path))
            return real(path, *args, **kwargs)
        return call


@pytest.fixture
def disk(monkeypatch) -> FailingDisk:
    return FailingDisk(monkeypatch)


def restarted(root: Path) -> RendezvousStates:
    """What a dash-memd started on ``root`` now would serve."""
    states = RendezvousStates(root)
    states.load()
    return states


def warnings(caplog, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage())


# --- rendezvous states --------------------------------------------------------------------------------


def test_heartbeats_while_the_disk_is_full_are_answered_from_ram_and_written_once_it_works(tmp_path, disk, caplog):
    caplog.set_level(logging.INFO, logger=rendezvous.__name__)
    root = tmp_path / "rendezvous"
    states = restarted(root)
    _, first, _ = states.set("job", "run", b"round 0", None)
    states.set("job", "other-run", b"other 0", None)
    disk.failing = errno.ENOSPC

    token = first
    for beat in range(1, 6):  # an agent's heartbeats: each sets the state with the token it last got
        state, newer, won = states.set("job", "run", f"beat {beat}".encode(), token)
        assert (state, won) == (f"beat {beat}".encode(), True) and newer > token
        assert states.get("job", "run") == (state, newer)
        token = newer
    assert states.set("job", "run", b"stale", first) == (b"beat 5", token, False)  # the compare still fences
    _, other, _ = states.set("job", "other-run", b"other 1", states.get("job", "other-run")[1])
    tried = disk.attempts
    _, token, _ = states.set("job", "run", b"beat 6", token)
    assert disk.attempts == tried + 1  # two files behind, one write tried: a failing disk is not asked per file
    assert warnings(caplog, "cannot write the state files") == 1  # once, not once per heartbeat
    # Until the disk works, a restart serves what the files hold: older states, whose tokens lose every compare.
    assert restarted(root).get("job", "run") == (b"round 0", first)

    disk.failing = None
    _, token, _ = states.set("job", "run", b"recovered", token)
    again = restarted(root)
    assert again.get("job", "run") == (b"recovered", token)
    assert again.get("job", "other-run") == (b"other 1", other)  # behind since the failure: written with it
    assert warnings(caplog, "cannot write the state files") == 1
    assert any("written again" in r.getMessage() for r in caplog.records)


def test_a_stopping_dash_memd_writes_the_states_a_failing_disk_kept_behind(tmp_path, disk):
    fleet = FleetRequests(tmp_path)
    fleet.load()
    _, token, _ = fleet.rendezvous.set("job", "run", b"round 0", None)
    disk.failing = errno.EIO
    _, token, _ = fleet.rendezvous.set("job", "run", b"round 1", token)
    assert not fleet.rendezvous.flush()  # still failing: it says so, and keeps the state for the next try
    disk.failing = None
    fleet.close()
    assert restarted(tmp_path / rendezvous.RENDEZVOUS).get("job", "run") == (b"round 1", token)


def test_a_job_removal_the_disk_fails_is_done_in_ram_and_on_disk_once_it_works(tmp_path, disk):
    root = tmp_path / "rendezvous"
    states = restarted(root)
    _, old, _ = states.set("gone", "run", b"old", None)
    states.set("kept", "run", b"kept", None)
    disk.failing = errno.EIO
    states.delete_job("gone")
    assert states.get("gone", "run") is None
    assert states.set("gone", "run", b"stale node", old) is None  # no state: a node of the removed job loses
    _, new, _ = states.set("gone", "new-run", b"after the removal", None)

    disk.failing = None
    states.set("kept", "run", b"kept 1", states.get("kept", "run")[1])
    again = restarted(root)
    assert again.get("gone", "run") is None and again.get("gone", "new-run") == (b"after the removal", new)
    assert again.get("kept", "run")[0] == b"kept 1"


# --- tokens ----------------------------------------------------------------------------------------------------


def test_tokens_reserved_ahead_carry_a_failing_disk_and_none_is_handed_out_beyond_the_reservation(tmp_path, disk):
    path = tmp_path / "TOKENS"
    tokens = TokenSource(path, block=4)
    handed_out = []

    def take() -> int:
        token = tokens.next()
        # Durable before use: the counter's file covers every token handed out, whatever happens next.
        assert int(path.read_text()) >= token
        handed_out.append(token)
        return token

    for _ in range(3):
        take()
    disk.failing = errno.ENOSPC
    while len(handed_out) < 8:  # the block reserved ahead of need, before the disk failed
        take()
    with pytest.raises(OSError):
        tokens.next()
    with pytest.raises(OSError):  # a refusal uses up nothing: the same token is the next one tried
        tokens.next()
    assert handed_out == list(range(1, 9))

    disk.failing = None
    assert tokens.next() == 9
    after_restart = TokenSource(path, block=4)
    after_restart.load()
    assert after_restart.next() > 9


def test_a_set_that_needs_a_token_no_reservation_covers_fails_and_changes_nothing(tmp_path, disk):
    root = tmp_path / "rendezvous"
    states = restarted(root)
    states.tokens.block = 4
    _, token, _ = states.set("job", "run", b"round 0", None)
    disk.failing = errno.ENOSPC
    answered = [token]
    with pytest.raises(OSError):
        for beat in range(1, 100):
            answered.append(states.set("job", "run", f"beat {beat}".encode(), answered[-1])[1])
    assert len(answered) > 2  # the tokens reserved ahead were used first
    assert states.get("job", "run") == (f"beat {len(answered) - 1}".encode(), answered[-1])

    disk.failing = None
    again = restarted(root)
    _, fresh, _ = again.set("job", "run", b"after the restart", again.get("job", "run")[1])
    assert fresh > max(answered)  # never one handed out before


# --- the world generation -----------------------------------------------------------------------------------


def shard_of(job: str, generation: int) -> ShardHeader:
    return ShardHeader(job, 1, 0, 1, 256, 0, 256, 0, 0, "ab" * 32, generation=generation)


def test_a_generation_whose_save_fails_stays_as_it_was(tmp_path, disk):
    root = tmp_path / "membership"
    records = Membership(root)
    assert records.raise_generation("job", 3) == 3
    disk.failing = errno.ENOSPC
    with pytest.raises(OSError):
        records.raise_generation("job", 5)
    assert records.generation("job") == 3
    records.check_shard(shard_of("job", 3))  # the fence is the one on disk: a shard of generation 3 still commits
    with pytest.raises(OSError):
        records.raise_generation("new-job", 2)
    assert records.generation("new-job") == 0 and records.history("new-job") == []

    event = MembershipEvent(1_790_000_000.0, "node-a", "joined", "", 1, 3, None, None)
    with pytest.raises(OSError):
        records.record("job", event)
    disk.failing = None
    assert records.raise_generation("job", 5) == 5
    again = Membership(root)
    again.load()
    assert again.generation("job") == 5 and again.history("job") == [event]  # the event went with the next save
    assert again.generation("new-job") == 0


# --- end to end: dash-memd on a full file system --------------------------------------------------------------


def test_rendezvous_heartbeats_go_on_while_dash_memds_disk_is_full(small_fs, memd_factory):
    fs = small_fs("4m")
    memd = memd_factory(data_dir=fs.path / "data")
    with memd.client() as client:
        _, token, _ = client.rendezvous_set("elastic", "run", b"round 0", None)  # the token block is reserved
        filler = fs.fill()
        for beat in range(1, 4):
            state, token, won = client.rendezvous_set("elastic", "run", f"beat {beat}".encode(), token)
            assert won and state == f"beat {beat}".encode()
        assert client.rendezvous_get("elastic", "run") == (b"beat 3", token)
        filler.unlink()
        _, token, _ = client.rendezvous_set("elastic", "run", b"space is back", token)
    memd.kill()  # SIGKILL: what it served is what its files hold
    memd.start()
    with memd.client() as client:
        assert client.rendezvous_get("elastic", "run") == (b"space is back", token)
    assert memd.log().count("cannot write the state files") == 1
