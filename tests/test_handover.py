"""A staging buffer handed to dash-agent is written again only once the agent is done with it.

The agent keeps streaming a fully staged shard whatever happens to its rank,
so a hand-over the link dropped before answering may still be read: these
tests drop the rank's link while dash-memd is stopped (the agent's stream of
the buffer waits on it) and check what the rank writes where. (dash-memd
drops a step still arriving once a newer one of the job commits, so a test
that checks an older step's bytes keeps the newer one from the agent.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from dashrun.rank import staging
from dashrun.rank.stager import MAX_SET_ASIDE


def stage_segments() -> int:
    """Staging segments this process holds open (by descriptor or mapping)."""
    segments = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:dashrun-stage"):
                segments.add(os.stat(fd).st_ino)
        except OSError:
            pass
    return len(segments)


def staged(ckpt):
    """Wait until the stager handed the newest snapshot over, told the agent it is complete, and is idle."""
    ckpt._stager._thread.submit(lambda: None).result(timeout=60)
    return ckpt._current


def drop_link(ckpt) -> None:
    """The rank's link to the agent breaks (both ends see it; the next request connects again)."""
    ckpt._link.close()


@pytest.fixture
def memd_stopped(memd):
    """dash-memd frozen (SIGSTOP) until the test calls the returned function or ends."""
    memd.proc.send_signal(signal.SIGSTOP)
    resumed = []

    def resume():
        if not resumed:
            resumed.append(memd.proc.send_signal(signal.SIGCONT))
    yield resume
    resume()


@pytest.mark.slow
@pytest.mark.parametrize("rank_checksum", [True, False], ids=["rank-checksums", "agent-checksums"])
def test_a_buffer_the_agent_may_still_stream_is_not_written_after_the_link_dropped(stack, rank_env, monkeypatch,
                                                                                 memd_stopped, rank_checksum):
    memd, agent = stack
    if not rank_checksum:  # the agent checksums what it reads: a buffer overwritten under it would commit
        monkeypatch.setattr(staging, "streaming", False)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB: more than the socket buffers between the agent and dash-memd
    ckpt = rank_env(agent, "unanswered", 0, 1, model=model)
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert ckpt.save(1, force=True)
    first = staged(ckpt)
    expected = bytes(first.buffer.tensor[:first.header.nbytes].numpy())
    away = agent.socket_path.with_name("away.sock")
    agent.socket_path.rename(away)  # the next snapshot finds no agent: step 1 alone goes to dash-memd
    try:
        drop_link(ckpt)  # before dash-memd stored step 1: the agent still has it to stream
        with torch.no_grad():
            model.weight.fill_(2.0)
        assert ckpt.save(2, force=True)
        second = staged(ckpt)
        assert second.buffer is not first.buffer
        memd_stopped()
        with memd.client() as client:
            wait_for(lambda: client.latest("unanswered", 1), 30, "step 1 to commit")
            got = bytearray(len(expected))
            client.get_shard_into("unanswered", 1, 0, [memoryview(got)])
        assert got == expected, "step 1 was overwritten while the agent streamed it"
    finally:
        away.rename(agent.socket_path)
    assert ckpt.save(3, force=True) and ckpt.wait(60)  # and the rank goes on with the agent
    ckpt.close()


@pytest.mark.slow
def test_buffers_set_aside_are_bounded_and_come_back_once_the_agent_lets_go(stack, rank_env, memd_stopped):
    memd, agent = stack
    model = torch.nn.Linear(256, 256)
    ckpt = rank_env(agent, "aside", 0, 1, model=model)
    before = stage_segments()
    for step in range(1, 2 + MAX_SET_ASIDE + 1):  # each hand-over unanswered: its buffer stays the agent's
        assert ckpt.save(step, force=True)
        staged(ckpt)
        drop_link(ckpt)
        assert stage_segments() - before <= 2 + MAX_SET_ASIDE
    last = step
    assert not ckpt.save(last + ckpt.interval)  # due, but every buffer may still be read: skipped, not allocated
    assert ckpt.stats.skipped == 1 and stage_segments() - before == 2 + MAX_SET_ASIDE
    memd_stopped()
    assert ckpt.save(last + 2 * ckpt.interval, force=True)  # the agent lets go once it delivered them
    assert ckpt.wait(60)
    assert stage_segments() - before <= 2 + MAX_SET_ASIDE
    ckpt.close()
    assert stage_segments() == before
