"""Faults with real processes: dash-memd hung, killed and restarted, its link cut, its disk full.

Each test runs a real job (dashrun, dash-agent, 2 gloo ranks of
tests/bin/train.py) against a real dash-memd, injects the fault while the
job trains, and checks what the README promises: training goes on, nothing
committed is lost, nothing partial is ever visible, checkpointing comes back
by itself, and a relaunch resumes bit for bit where the uninterrupted run
would be.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REFERENCE_STEPS, REPO, TRAIN, dashrun_cmd, kill_tree, wait_for
from runs import assert_identical, last_step, starts

from dashrun.errors import DashError
from dashrun.memd.store.tiers.base import MANIFEST
from dashrun.memd.store.tiers.disk import DiskTier
from dashrun.testing.netns import Relay
from dashrun.testing.processes import free_port
from dashrun.wire import layout
from dashrun.wire.messages import ShardHeader
from dashrun.wire.planner import MemdSource, Planner, everything

pytestmark = pytest.mark.slow

#: How long dash-memd stays hung (SIGSTOP) in the hang test.
HANG = 30.0


class Launch:
    """A process started by a test, its output in a file; killed with its whole tree unless it ended."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float = 240) -> int:
        """Wait for the process to end; its exit code."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g}s: {self.output()[-3000:]}") from None

    def kill(self) -> None:
        kill_tree(self.proc)


@pytest.fixture
def launch(tmp_path):
    """``launch(cmd, env=None)``: start a process (a job) that is killed, with its tree, when the test ends."""
    started: list[Launch] = []

    def make(cmd: list[str], env: dict | None = None) -> Launch:
        started.append(Launch(cmd, tmp_path / f"launch-{len(started)}.log", env))
        return started[-1]

    yield make
    for job in started:
        job.kill()


def via(address: str, memd) -> SimpleNamespace:
    """What dashrun_cmd needs of a dash-memd, reached at another address (a relay)."""
    return SimpleNamespace(address=address, token_file=memd.token_file, tls_args=memd.tls_args)


def job_listing(memd, job: str) -> dict | None:
    with memd.client() as client:
        return next((j for j in client.list()["jobs"] if j["job"] == job), None)


def committed(memd, job: str) -> list[int]:
    listing = job_listing(memd, job)
    return [c["step"] for c in listing["checkpoints"]] if listing else []


def newest(memd, job: str) -> int:
    steps = committed(memd, job)
    return max(steps) if steps else -1


def receiving(memd, job: str) -> list[int]:
    listing = job_listing(memd, job)
    return listing["receiving"] if listing else []


def verify_all(memd, job: str) -> list[int]:
    """Read back every checkpoint dash-memd lists, whole, every piece checked against its CRC-32C; their steps."""
    steps = []
    with memd.client() as client:
        for step in committed(memd, job):
            info = client.latest(job, step)
            if info is None:  # deleted by retention since the listing
                continue
            tails, size = layout.image_tails(info)
            Planner([MemdSource(client.another)]).read(info, everything(info, tails), memoryview(bytearray(size)))
            steps.append(step)
    return steps


def disk_steps(data_dir: Path, job: str) -> list[int]:
    """The job's checkpoints on disk; fails unless each is complete and its bytes match its manifest."""
    disk = DiskTier(data_dir)
    steps = []
    for path in sorted(p for p in (disk.jobs / job).glob("*") if p.name.isdigit()):
        assert (path / MANIFEST).exists(), f"step directory without a manifest: {path}"
        disk.verify(path, disk.read_manifest(path))
        steps.append(int(path.name))
    return steps


def leftovers(data_dir: Path, job: str) -> list[str]:
    """What a disk write in progress (or one that failed and was not cleaned up) has on disk."""
    return [p.name for p in (data_dir / "jobs" / job).glob(".*") if p.name.startswith((".tmp-", ".trash-"))]


def written(memd, job: str, step: int) -> None:
    """Wait until dash-memd has written ``step`` to disk (a check of the disk before may meet it half-written)."""
    with memd.client() as client:
        assert client.wait(job, step, 60, on_disk=True), f"{job} step {step} was not written to disk"


def rank_stats(out: Path, rank: int = 0) -> dict:
    """The rank's Checkpointer counters after its newest step (train.py --log-stats)."""
    lines = [line for line in (out / f"rank{rank}.log").read_text().splitlines() if line.startswith("stats ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else {}


def relaunch(memd, args: list[str], out: Path, job: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(dashrun_cmd(memd, str(TRAIN), *args, "--out", str(out), job=job), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# --- dash-memd hung ---------------------------------------------------------------------------------------


def test_memd_hung_for_30s_training_goes_on_and_checkpointing_comes_back(memd, tmp_path, reference, launch):
    # Steps of 2 s, a snapshot after each: the job outlasts the hang whatever the machine's speed, and a
    # relaunch is compared with the session's reference run.
    args = ["--steps", str(REFERENCE_STEPS), "--interval", "1"]
    out, job = tmp_path / "out", "hung"
    run = launch(dashrun_cmd(memd, str(TRAIN), *args, "--out", str(out), "--delay", "2", "--log-stats", job=job))
    wait_for(lambda: newest(memd, job) >= 1 or not run.running(), 180, "the first checkpoints", interval=0.2)
    first = last_step(out)
    started = time.monotonic()
    wait_for(lambda: last_step(out) >= first + 4 or not run.running(), 60, "4 steps before the hang")
    before = (last_step(out) - first) / (time.monotonic() - started)
    held = newest(memd, job)

    os.kill(memd.proc.pid, signal.SIGSTOP)
    try:
        hung_at, hung_step = time.monotonic(), last_step(out)
        # The fault lasts HANG seconds; the job must keep running (and training) all along.
        wait_for(lambda: not run.running() or time.monotonic() - hung_at >= HANG, HANG + 10, "the hang to last")
        during = (last_step(out) - hung_step) / (time.monotonic() - hung_at)
        stats = rank_stats(out)
    finally:
        os.kill(memd.proc.pid, signal.SIGCONT)
    resumed_step = last_step(out)
    assert run.running(), run.output()[-3000:]
    # Steps of 2 s through a 30 s hang: a training held by its checkpoints would end at most the step it was in.
    assert resumed_step - hung_step >= 3, \
        f"training stalled: {resumed_step - hung_step} steps while dash-memd hung ({during:.2f}/s, {before:.2f} before)"
    assert stats["skipped"] > 0, stats  # due snapshots were skipped (both buffers on their way), and counted

    # Checkpointing comes back by itself: a snapshot taken after the hang commits.
    wait_for(lambda: newest(memd, job) > resumed_step or not run.running(), 60, "a checkpoint after the hang",
             interval=0.2)
    assert newest(memd, job) > max(held, resumed_step)

    run.kill()  # launcher, agent and ranks, SIGKILL
    assert run.proc.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    resume_from = newest(memd, job)
    # Without the 2 s steps a snapshot every step would often find both buffers busy; the interval changes no state.
    relaunch(memd, ["--steps", str(REFERENCE_STEPS), "--interval", "5"], out, job)
    assert starts(out) == [0, resume_from + 1]
    assert_identical(reference, out)


def test_ranks_snapshot_the_same_steps_again_after_one_of_them_skipped(memd, agent_factory, rank_env):
    """Rank 1's link to dash-memd is down: its two buffers stay on their way and it skips due snapshots that
    rank 0 takes. Once the link is back both ranks must snapshot the same steps again, or none ever commits."""
    job = "skipped-alike"
    with Relay((memd.host, memd.port)) as relay:
        relay.link_down()
        agents = [agent_factory(memd), agent_factory(via(relay.address, memd))]
        models = []
        for _ in agents:
            torch.manual_seed(0)
            models.append(torch.nn.Linear(8, 8))  # replicated state: the same on both ranks
        ranks = [rank_env(agent, job, rank, 2, model=model) for rank, (agent, model) in enumerate(zip(agents, models))]

        def train(steps: range, paced: list) -> None:
            for step in steps:
                for ckpt in ranks:
                    if ckpt.save(step) and ckpt in paced:  # each snapshot delivered before the next is due
                        wait_for(lambda: ckpt.stats.stored + ckpt.stats.failed == ckpt.stats.snapshots, 30,
                                 f"rank {ckpt.rank}'s snapshot of step {step} to be stored")

        train(range(0, 20), paced=ranks[:1])
        assert (ranks[0].stats.skipped, ranks[1].stats.snapshots) == (0, 2) and ranks[1].stats.skipped > 0
        relay.link_up()
        wait_for(lambda: ranks[1].stats.stored == 2, 60, "rank 1's snapshots to be stored once the link is back")
        train(range(20, 30), paced=ranks)
        assert all(ckpt.wait(timeout=20) for ckpt in ranks)
        for ckpt in ranks:
            ckpt.close()
    with memd.client() as client:
        assert client.latest(job).step == 29


_TWO_RANKS = """
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from dashrun.rank.checkpointer import Checkpointer

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
ckpt = Checkpointer(interval=2, model=torch.nn.Linear(8, 8))

def delivered():  # each snapshot stored before the next is due (polled, with a deadline)
    deadline = time.monotonic() + 60
    while ckpt.stats.stored + ckpt.stats.failed < ckpt.stats.snapshots and time.monotonic() < deadline:
        time.sleep(0.01)

def report(name, **extra):
    part = out / f"{name}-{rank}.part"  # the test polls for the file: it appears whole, by rename
    part.write_text(json.dumps({"skipped": ckpt.stats.skipped, "snapshots": ckpt.stats.snapshots, **extra}))
    os.replace(part, out / f"{name}-{rank}.json")

for step in range(10):
    if ckpt.save(step) and rank == 0:
        delivered()
report("cut")
deadline = time.monotonic() + 120
while not (out / "link-up").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
delivered()
for step in range(10, 20):
    if ckpt.save(step):
        delivered()
report("end", committed=ckpt.wait(timeout=30))
ckpt.close()
dist.destroy_process_group()
"""


def test_a_rank_without_a_free_buffer_makes_every_rank_skip(memd, agent_factory, tmp_path):
    """Two gloo ranks; rank 1's link to dash-memd is down, so its two buffers stay on their way. Every rank must
    skip the due snapshots rank 1 cannot take (rank 0's shards of them would never commit, and the job's last
    wait() would block), then both snapshot again once the link is back."""
    job, out = "skip-together", tmp_path / "out"
    out.mkdir()
    with Relay((memd.host, memd.port)) as relay:
        relay.link_down()
        agents = [agent_factory(memd), agent_factory(via(relay.address, memd))]
        port = free_port()
        ranks = []
        for rank, agent in enumerate(agents):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DASH_AGENT_SOCKET": str(agent.socket_path),
                   "DASH_JOB_ID": job}
            log = open(tmp_path / f"rank-{rank}.log", "wb")
            ranks.append(subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(out)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        try:
            wait_for(lambda: all((out / f"cut-{r}.json").exists() for r in (0, 1)), 120, "both ranks at step 10")
            cut = [json.loads((out / f"cut-{r}.json").read_text()) for r in (0, 1)]
            assert cut[0] == cut[1], f"the ranks snapshotted different steps: {cut}"
            assert cut[1]["snapshots"] == 2 and cut[1]["skipped"] > 0, cut
            relay.link_up()
            (out / "link-up").touch()
            wait_for(lambda: all((out / f"end-{r}.json").exists() for r in (0, 1)), 120, "both ranks to finish")
            end = [json.loads((out / f"end-{r}.json").read_text()) for r in (0, 1)]
            assert all(e["committed"] for e in end), end
            assert all(rank.wait(timeout=60) == 0 for rank in ranks)
        finally:
            for rank in ranks:
                kill_tree(rank)
    assert newest(memd, job) == 19


# --- dash-memd killed and restarted -----------------------------------------------------------------------


def on_disk(memd, job: str) -> list[int]:
    listing = job_listing(memd, job)
    return [c["step"] for c in listing["checkpoints"] if "disk" in c["tiers"]] if listing else []


def test_memd_killed_mid_stream_and_restarted(memd, tmp_path, reference, launch):
    args = ["--steps", str(REFERENCE_STEPS), "--interval", "2"]
    out, job = tmp_path / "out", "memd-mid-stream"
    with Relay((memd.host, memd.port)) as relay:
        run = launch(dashrun_cmd(via(relay.address, memd), str(TRAIN), *args, "--out", str(out), "--delay", "0.5",
                                 job=job))
        wait_for(lambda: on_disk(memd, job) or not run.running(), 180, "a checkpoint on disk", interval=0.2)
        relay.cut_after(10_000)  # a few KiB into the next shard (about 33 KiB): dash-memd holds part of it
        wait_for(lambda: not relay.up or not run.running(), 60, "the next shard to be cut")
        wait_for(lambda: receiving(memd, job), 10, "dash-memd to hold part of a checkpoint")
        partial = receiving(memd, job)
        kept = on_disk(memd, job)
        assert run.running(), run.output()[-3000:]

        memd.kill()
        memd.start()  # same port, same data dir
        assert "interrupted write" not in memd.log()
        steps = committed(memd, job)
        assert set(kept) <= set(steps), f"lost {set(kept) - set(steps)}"
        assert not set(partial) & set(steps), "a checkpoint that was partly received is listed"
        assert verify_all(memd, job) == steps
        assert set(kept) <= set(disk_steps(memd.data_dir, job)) and not leftovers(memd.data_dir, job)

        relay.link_up()
        assert run.finish() == 0, run.output()[-3000:]
    assert newest(memd, job) == REFERENCE_STEPS - 1  # committed after the restart
    assert starts(out) == [0]  # training never noticed
    assert_identical(reference, out)
    written(memd, job, REFERENCE_STEPS - 1)
    assert REFERENCE_STEPS - 1 in disk_steps(memd.data_dir, job) and not leftovers(memd.data_dir, job)
    assert verify_all(memd, job)


def test_memd_killed_mid_restore_and_restarted(memd, tmp_path, reference, launch, monkeypatch):
    args = ["--steps", str(REFERENCE_STEPS), "--interval", "5"]
    out, job = tmp_path / "out", "memd-mid-restore"
    relaunch(memd, [*args, "--stop-after", "12"], out, job)
    with memd.client() as client:
        assert client.latest(job).step == 9 and client.wait(job, 9, 60, on_disk=True)

    memd.stop()
    monkeypatch.setenv("DASH_CRASH_AT", "channel.mid_data")  # dies once the first piece of a shard is sent
    memd.start()
    monkeypatch.delenv("DASH_CRASH_AT")
    monkeypatch.setenv("DASH_NO_PREFETCH", "1")  # the ranks' restore() meets the crash, not the agent's prefetch
    run = launch(dashrun_cmd(memd, str(TRAIN), *args, "--out", str(out), job=job))
    wait_for(lambda: memd.proc.poll() is not None or not run.running(), 180, "dash-memd to die in the restore")
    assert memd.proc.returncode == -signal.SIGKILL, run.output()[-3000:]
    memd.start()
    assert run.finish() == 0, run.output()[-3000:]
    assert "restore waits for dash-memd" in run.output()
    assert starts(out) == [0, 10]
    assert_identical(reference, out)


# --- a node's link to dash-memd cut ------------------------------------------------------------------------

#: How long a silent dash-memd is waited for by the node's agent in the link tests (the default is a minute).
AGENT_MEMD_TIMEOUT = {"DASH_MEMD_TIMEOUT": "3"}


def cut_and_restore(memd, job: str, out: Path, run: Launch, cut, restore, hold: Path) -> None:
    """Cut the link while a shard is on its way, wait for the node to notice, restore it; check what dash-memd
    shows all along: nothing partial, and checkpoints committed again after the cut. The run holds its last
    step while ``hold`` exists: it cannot finish before the link is back, however slow the machine."""
    wait_for(lambda: newest(memd, job) >= 0 or not run.running(), 180, "a first checkpoint", interval=0.2)
    cut()
    wait_for(lambda: receiving(memd, job) or not run.running(), 60, "a shard cut on its way", interval=0.05)
    partial = receiving(memd, job)
    wait_for(lambda: "not stored" in run.output() or not run.running(), 60, "the node to notice the cut")
    cut_at = last_step(out)
    assert run.running(), run.output()[-3000:]
    assert not set(partial) & set(committed(memd, job))
    restore()
    hold.unlink()
    wait_for(lambda: newest(memd, job) > cut_at or not run.running(), 120, "a checkpoint after the cut",
             interval=0.2)
    assert run.finish() == 0, run.output()[-3000:]
    assert starts(out) == [0]
    assert newest(memd, job) == REFERENCE_STEPS - 1
    assert verify_all(memd, job) == committed(memd, job)  # the cut checkpoint, if listed, too


def test_link_cut_mid_stream_and_restored(memd, tmp_path, reference, launch):
    """On loopback, through a relay the test controls (runs everywhere)."""
    out, job, hold = tmp_path / "out", "relay-cut", tmp_path / "hold"
    hold.touch()
    with Relay((memd.host, memd.port)) as relay:
        run = launch(dashrun_cmd(via(relay.address, memd), str(TRAIN), "--steps", str(REFERENCE_STEPS),
                                 "--interval", "2", "--out", str(out), "--delay", "0.5", "--hold-file", str(hold),
                                 job=job),
                     env=AGENT_MEMD_TIMEOUT)
        cut_and_restore(memd, job, out, run, lambda: relay.cut_after(10_000), relay.link_up, hold)
    assert_identical(reference, out)


def test_a_shard_sent_again_after_its_link_went_silent_mid_shard_is_taken_at_once(memd):
    """The first copy's connection stalls mid-shard (a silent cut: no reset, dash-memd's recv would wait out its
    idle timeout); the agent's retry over a new connection is taken, and the step commits."""
    header = ShardHeader("silent-cut", 9, 0, 2, 16 << 20, 0, 8 << 20, 0, 0, "ab" * 32)
    payload = os.urandom(header.nbytes)
    stalled, outcome, chunks = threading.Event(), {}, []

    def first_copy():
        def gate(offset):
            chunks.append(offset)
            if len(chunks) > 1:  # the first chunk went out; the rest never comes
                stalled.set()
                release.wait(60)
        try:
            with memd.client() as client:
                client.put_shard(header, [payload], gate=gate)
        except Exception as e:  # noqa: BLE001 (what the first copy's sender saw, asserted below)
            outcome["error"] = e
        else:
            outcome["error"] = None

    release = threading.Event()
    sender = threading.Thread(target=first_copy)
    sender.start()
    try:
        wait_for(stalled.is_set, 30, "the first copy to stall mid-shard")
        with memd.client() as client:
            assert client.put_shard(header, [payload])["committed"] is False  # taken, waiting for rank 1
            rank1 = dataclasses.replace(header, rank=1, rep_start=8 << 20, rep_end=16 << 20)
            assert client.put_shard(rank1, [os.urandom(rank1.nbytes)])["committed"]
            got = bytearray(header.nbytes)
            client.get_shard_into("silent-cut", 9, 0, [memoryview(got)])
            assert bytes(got) == payload
    finally:
        release.set()
        sender.join(60)
    assert isinstance(outcome["error"], DashError)  # dash-memd hung up on the stalled copy


def test_link_cut_mid_stream_in_a_network_namespace(fleet_factory, memd_factory, tmp_path, reference, launch):
    """The node (dashrun, its agent and ranks) in a network namespace; its veth link goes down and up again."""
    fleet = fleet_factory(1)
    node = fleet[0]
    memd = memd_factory("--listen", f"{fleet.host_address}:0")
    node.shape("256kbit")  # a shard (about 33 KiB) takes about a second on the wire: the cut lands in one
    out, job, hold = tmp_path / "out", "netns-cut", tmp_path / "hold"
    hold.touch()
    run = launch(node.command(dashrun_cmd(memd, str(TRAIN), "--steps", str(REFERENCE_STEPS), "--interval", "2",
                                          "--out", str(out), "--delay", "0.5", "--hold-file", str(hold), job=job)),
                 env=AGENT_MEMD_TIMEOUT)

    def restore() -> None:
        node.link_up()
        node.shape(None)  # the backlog drains at once: the ranks' last snapshots are not skipped

    cut_and_restore(memd, job, out, run, node.link_down, restore, hold)
    assert_identical(reference, out)


# --- dash-memd's disk full ---------------------------------------------------------------------------------


def test_memd_disk_full_ram_serves_and_writing_resumes(small_fs, memd_factory, tmp_path, reference, launch):
    fs = small_fs("4m")
    memd = memd_factory(data_dir=fs.path / "data")
    filler = fs.fill()
    args = ["--steps", str(REFERENCE_STEPS), "--interval", "5"]
    out, job = tmp_path / "out", "disk-full"
    first = relaunch(memd, [*args, "--stop-after", "12"], out, job)  # launches, trains, commits in RAM
    # The training terminal hears of it: one line (not one per checkpoint), and a line per commit.
    failing = f"dashrun: {job}'s checkpoints are not reaching dash-memd's disk: "
    again = f"dashrun: {job}'s checkpoints reach dash-memd's disk again"
    assert first.stderr.count(failing) == 1 and again not in first.stderr, first.stderr[-3000:]
    line = next(line for line in first.stderr.splitlines() if line.startswith(failing))
    assert "No space left" in line and line.endswith("; they are kept in its RAM"), line
    assert re.search(rf"{job}: step 9 committed \(\d+\.\d [KM]iB, \d+ ms\)", first.stderr), first.stderr[-3000:]
    listing = job_listing(memd, job)
    assert [(c["step"], c["tiers"]) for c in listing["checkpoints"]] == [(4, ["ram"]), (9, ["ram"])]
    assert "No space left" in (listing["disk_error"] or "")
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file",
                             str(memd.token_file), *memd.tls_args],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert f"{job}: disk tier failing: No space left on device" in " ".join(status.stdout.split())
    assert disk_steps(memd.data_dir, job) == []  # no checkpoint appears on disk, whole or partial
    wait_for(lambda: not leftovers(memd.data_dir, job), 30, "the failed writes to be cleaned up")

    # The relaunch restores from RAM; once space is back, the next checkpoints are written again. It is held before
    # its last step until its terminal has said so.
    hold = tmp_path / "hold"
    hold.touch()
    run = launch(dashrun_cmd(memd, str(TRAIN), *args, "--out", str(out), "--delay", "0.3", "--hold-file", str(hold),
                             job=job))
    wait_for(lambda: newest(memd, job) >= 14 or not run.running(), 180, "a checkpoint after the restore",
             interval=0.2)
    assert disk_steps(memd.data_dir, job) == [] and job_listing(memd, job)["disk_error"]
    wait_for(lambda: failing in run.output() or not run.running(), 30, "the launcher to say the disk fails")
    wait_for(lambda: not leftovers(memd.data_dir, job), 30, "the failed writes to be cleaned up")
    filler.unlink()
    wait_for(lambda: again in run.output() or not run.running(), 60, "the launcher to say the disk works again",
             interval=0.2)
    hold.unlink()
    assert run.finish() == 0, run.output()[-3000:]
    output = run.output()
    assert output.count(failing) == 1 and output.count(again) == 1 and output.index(failing) < output.index(again)
    assert starts(out) == [0, 10]
    assert_identical(reference, out)
    written(memd, job, REFERENCE_STEPS - 1)
    assert job_listing(memd, job)["disk_error"] is None
    assert REFERENCE_STEPS - 1 in disk_steps(memd.data_dir, job) and not leftovers(memd.data_dir, job)


# --- the soak, short -----------------------------------------------------------------------------------------


def test_soak_with_random_kills_loses_nothing(tmp_path):
    """scripts/soak.py for half a minute with 3 nodes: ranks, agents and dash-memd killed, nothing lost."""
    summary_path = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--nodes", "3", "--minutes", "0.5",
                             "--warmup", "3", "--kill-every", "3", "--sample-every", "5", "--step-time", "0.1",
                             "--json", str(summary_path), "--workdir", str(tmp_path / "soak")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and summary["lost"] == 0 and summary["bounded"], summary
    assert summary["committed"] > 0 and summary["verified_reads"] > 0
    assert all(summary["kills"].values()), summary["kills"]  # ranks, agents and dash-memd were each killed
    assert summary["memd_starts"] == 1 + summary["kills"]["memd"]
