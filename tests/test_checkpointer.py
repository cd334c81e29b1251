"""The rank side against a real dash-agent and dash-memd: ranks simulated in one process.

Each simulated rank is a Checkpointer built under its own RANK/WORLD_SIZE;
they share the process, which is all the replicated/private split needs.
"""

from __future__ import annotations

import logging
import mmap
import os

import pytest
import torch
from conftest import load_fake_metadata, wait_for
from runs import Cursor

from dashrun.errors import UnavailableError
from dashrun.rank import restore as restore_module
from dashrun.rank import staging
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind


def trained_objects(seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def fresh_objects():
    return trained_objects(seed=99, steps=0)


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if isinstance(a, torch.optim.Optimizer):
        return sa["param_groups"] == sb["param_groups"] and all(
            torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in sa["state"][k])
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def save_world(rank_env, agent, job, world, step, model, opt, sched, positions):
    ranks = [rank_env(agent, job, r, world, model=model, optimizer=opt, scheduler=sched,
                      data=Cursor(positions[r])) for r in range(world)]
    for ckpt in ranks:
        assert ckpt.save(step, force=True)
    assert all(ckpt.wait(timeout=60) for ckpt in ranks)
    for ckpt in ranks:
        ckpt.close()


def test_round_trip_restores_every_object(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "rt", 1, 7, model, opt, sched, [41])
    model2, opt2, sched2 = fresh_objects()
    cursor = Cursor()
    ckpt = rank_env(agent, "rt", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=cursor)
    assert ckpt.restore() == 8
    assert same_state(model, model2) and same_state(opt, opt2)
    assert sched2.state_dict() == sched.state_dict() and cursor.position == 41
    opt2.step()  # the restored optimizer state is owned, not a view of the restore image
    ckpt.close()


@pytest.mark.skipif(not staging.streaming, reason="dashrun.util._ntcopy not built, or not x86-64 with SSE4.2")
def test_large_tensors_are_staged_with_streaming_stores_and_restore_exactly(stack, rank_env, monkeypatch):
    _, agent = stack
    torch.manual_seed(3)
    model = torch.nn.Linear(512, 512)                     # 1 MiB of weights: well past memcpy's range
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    streamed = []
    helper = staging._ntcopy

    class Recording:
        STREAMING = helper.STREAMING

        @staticmethod
        def copy_crc(dst, src, nbytes, crc):
            streamed.append(nbytes)
            return helper.copy_crc(dst, src, nbytes, crc)

    monkeypatch.setattr(staging, "_ntcopy", Recording)
    ckpt = rank_env(agent, "streamed", 0, 1, model=model, optimizer=opt)
    assert ckpt.save(0, force=True) and ckpt.wait(timeout=60)
    ckpt.close()
    assert sum(streamed) >= 3 * 512 * 512 * 4             # weights and both AdamW moments
    model2 = torch.nn.Linear(512, 512)
    opt2 = torch.optim.AdamW(model2.parameters())
    ckpt = rank_env(agent, "streamed", 0, 1, model=model2, optimizer=opt2)
    assert ckpt.restore() == 1
    assert same_state(model, model2) and same_state(opt, opt2)
    ckpt.close()


def _final_progress(ckpt, monkeypatch) -> list[dict]:
    """The PROGRESS notes a Checkpointer sends its agent that announce the whole shard staged."""
    sent = []
    notify = ckpt._link.notify

    def recording(kind, body):
        if kind == Kind.PROGRESS and body.get("ready") is not None:
            sent.append(dict(body))
        return notify(kind, body)

    monkeypatch.setattr(ckpt._link, "notify", recording)
    return sent


@pytest.mark.skipif(not staging.streaming, reason="dashrun.util._ntcopy not built, or not x86-64 with SSE4.2")
def test_the_rank_checksums_its_shard_and_dash_memd_verifies_that_checksum(stack, rank_env, monkeypatch):
    memd, agent = stack
    model, opt, sched = trained_objects()
    ckpt = rank_env(agent, "rankcrc", 0, 1, model=model, optimizer=opt, scheduler=sched, data=Cursor(3))
    sent = _final_progress(ckpt, monkeypatch)
    assert ckpt.save(5, force=True) and ckpt.wait(timeout=60)
    with memd.client() as client:
        info = client.latest("rankcrc")
    assert info.step == 5
    assert [b.get("crc") for b in sent if b["ready"] == info.shards[0].nbytes] == [info.shards[0].crc]

    # A checksum that does not match the bytes: dash-memd refuses the shard, the previous checkpoint stays.
    real_crc_of = staging.crc_of
    monkeypatch.setattr(staging, "crc_of", lambda region, crc: real_crc_of(region, crc) ^ 1)
    assert ckpt.save(10, force=True)
    assert not ckpt.wait(timeout=60)
    with memd.client() as client:
        assert client.latest("rankcrc").step == 5
    monkeypatch.setattr(staging, "crc_of", real_crc_of)
    assert ckpt.save(15, force=True) and ckpt.wait(timeout=60)  # and the next one is stored again
    ckpt.close()


def test_without_the_rank_checksum_the_agent_computes_it(stack, rank_env, monkeypatch):
    memd, agent = stack
    monkeypatch.setattr(staging, "streaming", False)
    model, opt, sched = trained_objects()
    ckpt = rank_env(agent, "agentcrc", 0, 1, model=model, optimizer=opt, scheduler=sched, data=Cursor(3))
    sent = _final_progress(ckpt, monkeypatch)
    assert ckpt.save(5, force=True) and ckpt.wait(timeout=60)
    assert sent and all("crc" not in b for b in sent)
    ckpt.close()
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "agentcrc", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    assert ckpt.restore() == 6 and same_state(model, model2) and same_state(opt, opt2)
    ckpt.close()


def test_fresh_job_restores_nothing(stack, rank_env):
    _, agent = stack
    model, opt, _ = fresh_objects()
    ckpt = rank_env(agent, "never-saved", 0, 1, model=model, optimizer=opt)
    assert ckpt.restore() == 0
    ckpt.close()


def test_replicated_state_crosses_the_wire_once(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "split", 4, 4, model, opt, sched, [0, 1, 2, 3])
    with memd.client() as client:
        info = client.latest("split")
        used = client.list()["memory"]["used"]  # what dash-memd's RAM holds, by its own count
    assert info.world == 4
    # The ranks' slices of the replicated state tile it: each byte sent by one rank, about a quarter each.
    slices = sorted((s.rep_start, s.rep_end) for s in info.shards)
    assert [a for a, _ in slices] == [0] + [b for _, b in slices[:-1]] and slices[-1][1] == info.rep_total, slices
    assert max(b - a for a, b in slices) <= info.rep_total // 4 + 64
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert info.rep_total >= param_bytes * 3            # parameters + two AdamW moments
    # Counted from the objects, not from the checkpoint's description: every tensor of the model and the
    # optimizer. Four ranks each sending the replicated state would put four times that in dash-memd's RAM.
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) + sum(
        t.nbytes for per_param in opt.state_dict()["state"].values() for t in per_param.values()
        if isinstance(t, torch.Tensor))
    assert info.rep_total <= state_bytes <= used < 2 * state_bytes, (info.rep_total, state_bytes, used)


@pytest.mark.parametrize("new_world", [2, 3])
def test_restore_into_fewer_ranks(stack, rank_env, caplog, new_world):
    _, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, f"shrink{new_world}", 4, 9, model, opt, sched, [10, 11, 12, 13])
    caplog.set_level(logging.WARNING, logger="dashrun")
    for rank in range(new_world):
        model2, opt2, sched2 = fresh_objects()
        cursor = Cursor()
        ckpt = rank_env(agent, f"shrink{new_world}", rank, new_world, model=model2, optimizer=opt2,
                        scheduler=sched2, data=cursor)
        assert ckpt.restore() == 10
        assert same_state(model, model2) and same_state(opt, opt2)
        assert cursor.position == 10 + rank              # private state goes to the same rank number
        ckpt.close()
    assert f"of ranks {new_world}..3 is not restored" in caplog.text


def test_restore_into_more_ranks_reports_ranks_without_state(stack, rank_env, caplog):
    _, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "grow", 2, 4, model, opt, sched, [5, 6])
    caplog.set_level(logging.WARNING, logger="dashrun")
    model2, opt2, sched2 = fresh_objects()
    cursor = Cursor(position=-1)
    ckpt = rank_env(agent, "grow", 3, 4, model=model2, optimizer=opt2, scheduler=sched2, data=cursor)
    assert ckpt.restore() == 5
    assert same_state(model, model2) and cursor.position == -1
    assert "rank 3: checkpoint of step 4 was saved by 2 ranks" in caplog.text
    ckpt.close()


def test_tied_parameters_stay_tied(stack, rank_env):
    _, agent = stack

    def tied():
        embed = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = embed.weight
        return torch.nn.ModuleDict({"embed": embed, "head": head})

    torch.manual_seed(1)
    model = tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = rank_env(agent, "tied", 0, 1, model=model, optimizer=opt)
    ckpt.save(0, force=True)
    assert ckpt.wait(60)
    ckpt.close()
    torch.manual_seed(2)
    model2 = tied()
    ckpt = rank_env(agent, "tied", 0, 1, model=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1))
    ckpt.restore()
    assert model2.head.weight is model2.embed.weight
    assert torch.equal(model2.embed.weight, model.embed.weight)
    ckpt.close()


def test_interval_and_overlapped_copy(stack, rank_env):
    _, agent = stack
    model, opt, _ = trained_objects()
    ckpt = rank_env(agent, "interval", 0, 1, model=model, optimizer=opt)
    due = [step for step in range(12) if ckpt.save(step)]
    assert due == [4, 9]
    assert ckpt.wait(60)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()  # the pre-step hook waited for the background copy of step 9
    ckpt.close()
    model2, opt2, _ = fresh_objects()
    ckpt = rank_env(agent, "interval", 0, 1, model=model2, optimizer=opt2)
    assert ckpt.restore() == 10
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in saved.items())
    ckpt.close()


class FailingState:
    """An object whose state_dict() raises while ``fails``."""

    fails = True

    def state_dict(self):
        if self.fails:
            raise RuntimeError("the state cannot be read")
        return {"n": 1}

    def load_state_dict(self, state):
        pass


def test_a_save_whose_capture_fails_gives_its_staging_buffer_back(stack, rank_env):
    """save() raises what state_dict() raised, and the staging buffer it had reserved is free again: after two
    such failures (one per buffer) the next due save still starts."""
    _, agent = stack
    model, opt, _ = trained_objects()
    failing = FailingState()
    ckpt = rank_env(agent, "capture-fails", 0, 1, model=model, optimizer=opt, extra=failing)
    for step in (4, 9):  # due, not forced: a buffer is reserved only if one is free
        with pytest.raises(RuntimeError, match="cannot be read"):
            ckpt.save(step)
    failing.fails = False
    assert ckpt.save(14)
    assert ckpt.wait(60) and ckpt.stats.skipped == 0
    ckpt.close()


def test_a_dead_agent_never_blocks_training(rank_env, caplog):
    caplog.set_level(logging.WARNING, logger="dashrun")
    model, opt, _ = trained_objects()
    ckpt = rank_env(None, "orphan", 0, 1, model=model, optimizer=opt)
    for step in range(20):
        ckpt.save(step, force=step % 5 == 4)
    assert ckpt.wait(timeout=10) is False
    assert ckpt.stats.failed == 4 and ckpt.stats.stored == 0
    assert caplog.text.count("not stored") == 1        # reported once, not once per save
    ckpt.close()


def test_restore_without_an_agent_fails_loudly(rank_env, monkeypatch):
    monkeypatch.setattr(restore_module, "RESTORE_TIMEOUT", 1.0)
    model, opt, _ = trained_objects()
    ckpt = rank_env(None, "orphan", 0, 1, model=model, optimizer=opt)
    with pytest.raises(UnavailableError, match="cannot restore"):
        ckpt.restore()                                  # never silently starts from scratch
    ckpt.close()


def test_a_rank_that_starts_after_the_notice_takes_the_emergency_checkpoint_at_once(memd, agent_factory,
                                                                                   rank_env, monkeypatch):
    """The agent pushes a notice it already has the moment a rank connects, before any reply."""
    monkeypatch.setattr(restore_module, "RESTORE_TIMEOUT", 10.0)  # a lost reply fails here, not in 2 min
    fake = load_fake_metadata().FakeMetadata("gcp").start()
    try:
        fake.notice()
        agent = agent_factory(memd, {"DASH_CLOUD": "gcp", "DASH_METADATA_ENDPOINT": fake.url,
                                     "DASH_POLL_INTERVAL": "0.1"})
        wait_for(lambda: "preempt notice" in agent.log(), 30, "the agent to see the notice")
        model, opt, _ = trained_objects()
        for attempt in range(20):  # the notice races the rank's own start-up: give the race chances to show
            ckpt = rank_env(agent, "late", 0, 1, model=model, optimizer=opt)
            assert ckpt.restore() == attempt  # the step after the last emergency checkpoint
            assert ckpt.save(attempt) and ckpt.preempted, f"attempt {attempt}: the notice was lost"
            ckpt.close()
            with memd.client() as client:
                assert client.latest("late").step == attempt
    finally:
        fake.stop()


def test_a_dead_memd_is_reported_once_and_the_next_save_retries(memd, agent_factory, rank_env, caplog):
    agent = agent_factory(memd)
    caplog.set_level(logging.INFO, logger="dashrun")
    model, opt, _ = trained_objects()
    ckpt = rank_env(agent, "flaky", 0, 1, model=model, optimizer=opt)
    assert ckpt.save(0, force=True) and ckpt.wait(60)
    port = memd.port
    memd.kill()
    for step in (1, 2, 3):
        ckpt.save(step, force=True)
        wait_for(lambda: ckpt.stats.failed + ckpt.stats.stored == step + 1, 30, "the failed save to settle")
    assert ckpt.stats.failed == 3 and caplog.text.count("not stored") == 1
    memd.start(port=port)
    ckpt.save(4, force=True)
    assert ckpt.wait(60)
    assert "reach dash-memd again" in caplog.text
    with memd.client() as client:
        assert client.latest("flaky").step == 4
    ckpt.close()


def test_a_shard_handed_over_is_delivered_even_if_its_rank_dies(stack, short_tmp):
    memd, agent = stack
    payload = os.urandom(3000)
    fd = os.memfd_create("test-shard")
    os.write(fd, payload)
    header = ShardHeader("handoff", 3, 0, 1, 2000, 0, 2000, 900, 100, "ab" * 32)
    link = AgentLink(str(agent.socket_path))
    link.request(Kind.SNAPSHOT, {"shard": header.to_body(), "ready": header.nbytes}, fds=[fd])  # fully staged
    os.close(fd)
    link.close()  # the rank is gone before the agent answered
    with memd.client() as client:
        info = wait_for(lambda: client.latest("handoff"), 30, "the orphaned shard to commit")
        buf = bytearray(3000)
        client.get_shard_into("handoff", 3, 0, [memoryview(buf)])
    assert info.step == 3 and bytes(buf) == payload


def test_a_shard_whose_rank_dies_while_staging_is_never_sent_whole(stack):
    memd, agent = stack
    fd = os.memfd_create("test-shard")
    os.ftruncate(fd, 3000)
    header = ShardHeader("half", 3, 0, 1, 2000, 0, 2000, 900, 100, "ab" * 32)
    link = AgentLink(str(agent.socket_path))
    done = link.request(Kind.SNAPSHOT, {"shard": header.to_body(), "ready": 0}, fds=[fd])
    link.notify(Kind.PROGRESS, {"id": done.request_id, "ready": 1000})
    os.close(fd)
    link.close()  # the rank dies with 2000 of its 3000 bytes unstaged
    with memd.client() as client:
        wait_for(lambda: "half step 3: receiving" in memd.log() and client.list()["memory"]["used"] == 0, 30,
                 "the agent to stream what was staged, then abandon the shard")
        assert client.latest("half") is None


def test_restore_image_is_fetched_once_per_node(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "once", 2, 4, model, opt, sched, [0, 1])
    for rank in range(2):
        model2, opt2, sched2 = fresh_objects()
        ckpt = rank_env(agent, "once", rank, 2, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
        assert ckpt.restore() == 5
        ckpt.close()
    assert agent.log().count("fetched once step 4") == 1


def test_restore_image_mapping_is_private(stack, rank_env):
    """Loading must not write into the shared image other ranks of the node map."""
    _, agent = stack
    model, opt, _ = trained_objects()
    ckpt = rank_env(agent, "private-map", 0, 1, model=model, optimizer=opt)
    ckpt.save(2, force=True)
    assert ckpt.wait(60)
    ckpt.close()
    reply = AgentLink(str(agent.socket_path)).call(Kind.RESTORE, {"job": "private-map", "step": None}, timeout=30)
    fd = reply.fds[0]
    size = os.fstat(fd).st_size
    before = mmap.mmap(fd, size, prot=mmap.PROT_READ)[:]
    model2, opt2, _ = fresh_objects()
    again = rank_env(agent, "private-map", 0, 1, model=model2, optimizer=opt2)
    again.restore()
    opt2.step()
    assert mmap.mmap(fd, size, prot=mmap.PROT_READ)[:] == before
    os.close(fd)
    again.close()


def test_close_leaves_no_thread_behind_to_free_what_the_checkpointer_held(stack, rank_env, tmp_path):
    """After close() nothing of the Checkpointer lives on in the agent link's reader thread: the process group of the
    notice agreement and its last collective, freed there while the script tears torch.distributed down, aborted a
    rank at exit ("terminate called without an active exception")."""
    import threading

    import torch.distributed as dist

    memd, agent = stack
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model, opt, sched = trained_objects()
        ckpt = rank_env(agent, "closing", 0, 2, model=model, optimizer=opt, scheduler=sched, data=Cursor(3))
        assert not ckpt.save(0)  # not due: only the notice agreement's all-reduce starts
        readers = [t for t in threading.enumerate() if t.name == "dashrun-agent-reader"]
        assert readers and ckpt._notices._group is not None
        ckpt.close()
        assert not any(t.is_alive() for t in readers)
        assert ckpt._notices._group is None and ckpt._notices._work is None
    finally:
        dist.destroy_process_group()


def test_the_notices_tensor_is_let_go_only_once_nothing_else_holds_it(tmp_path, monkeypatch):
    """gloo's worker thread drops its hold on a finished all-reduce a moment after wait() returns, under the GIL:
    past the interpreter's shutdown that aborted a rank at exit (seen in a core dump). close() waits for it: here a
    thread stands in for the worker, letting go 0.3 s late; a holder that never lets go delays close() by a bound."""
    import threading

    import torch.distributed as dist

    from dashrun.rank import notices

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        board = notices.NoticeBoard(world=2, early_interval=1)
        board.publish(starved=False)
        assert board.agree() == notices.Agreement()
        board.publish(starved=False)
        held = [board._flag]
        threading.Timer(0.3, held.clear).start()
        board.close()
        assert not held and board._flag is None and board._group is None

        stuck = notices.NoticeBoard(world=2, early_interval=1)
        stuck.publish(starved=False)
        forever = [stuck._flag]
        monkeypatch.setattr(notices, "RELEASE_TIMEOUT", 0.2)
        stuck.close()
        assert stuck._flag is None and forever
    finally:
        dist.destroy_process_group()


def test_the_world_change_hook_is_called_at_restore_with_both_sizes(stack, rank_env):
    _, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "hooked", 2, 4, model, opt, sched, [1, 2])
    calls = []
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "hooked", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    ckpt.on_world_change = lambda old, new: calls.append((old, new, same_state(opt, opt2)))
    assert ckpt.restore() == 5
    assert calls == [(2, 1, True)]  # after the optimizer was loaded: the place to rescale its learning rate
    ckpt.close()


def test_an_elastic_sampler_is_job_wide_state_even_under_a_per_rank_name(stack, rank_env):
    from dashrun import ElasticSampler

    _, agent = stack
    data = list(range(48))
    samplers = [ElasticSampler(data, num_replicas=2, rank=r, seed=3) for r in range(2)]
    iterators = [iter(s) for s in samplers]
    for it in iterators:  # every rank takes 5 samples: the job has consumed 10
        [next(it) for _ in range(5)]
    ranks = [rank_env(agent, "sampled", r, 2, data=samplers[r]) for r in range(2)]
    for ckpt in ranks:
        assert ckpt.save(0, force=True)
    assert all(ckpt.wait(timeout=60) for ckpt in ranks)
    for ckpt in ranks:
        ckpt.close()
    # a rank of a bigger world that did not exist at save time still gets the job's position
    grown = ElasticSampler(data, num_replicas=3, rank=2, seed=3)
    ckpt = rank_env(agent, "sampled", 2, 3, data=grown)
    assert ckpt.restore() == 1
    assert grown.position == 10
    ckpt.close()


def test_a_rank_of_an_older_world_generation_cannot_commit(stack, rank_env, monkeypatch):
    """A node cut off from the others still reaches dash-memd: the new world's generation fences it out."""
    memd, agent = stack
    with memd.client() as client:
        client.set_generation("fenced", 5)
    monkeypatch.setenv("DASH_GENERATION", "3")
    model, opt, _ = trained_objects()
    ckpt = rank_env(agent, "fenced", 0, 1, model=model, optimizer=opt)
    assert ckpt.save(0, force=True)
    assert not ckpt.wait(timeout=30)
    ckpt.close()
    monkeypatch.setenv("DASH_GENERATION", "5")
    ckpt = rank_env(agent, "fenced", 0, 1, model=model, optimizer=opt)
    assert ckpt.save(1, force=True)
    assert ckpt.wait(timeout=30)
    ckpt.close()
    with memd.client() as client:
        assert client.latest("fenced").step == 1


def test_take_sigterm_wins_sigterm_back_from_a_framework_s_handler_and_close_puts_the_script_s_back(stack, rank_env):
    """Lightning's Trainer installs its own SIGTERM handler after the Checkpointer was made (DashrunCheckpoint
    calls take_sigterm() in on_train_start): SIGTERM is the Checkpointer's notice again, the framework's handler
    not chained, and close() gives back the handler the script had before the Checkpointer."""
    import signal

    _, agent = stack
    scripts, frameworks = [], []
    before = signal.signal(signal.SIGTERM, lambda *a: scripts.append(a))
    try:
        model = torch.nn.Linear(2, 2)
        ckpt = rank_env(agent, "take-sigterm", 0, 1, model=model)
        signal.signal(signal.SIGTERM, lambda *a: frameworks.append(a))  # the framework's, installed after
        ckpt.take_sigterm()
        signal.raise_signal(signal.SIGTERM)
        # a notice for the next save(); the script's handler chained, the framework's not
        assert ckpt._notices.signalled_at is not None and len(scripts) == 1 and not frameworks
        ckpt.close()
        signal.raise_signal(signal.SIGTERM)  # the script's own handler again, alone
        assert len(scripts) == 2 and not frameworks
    finally:
        signal.signal(signal.SIGTERM, before)
