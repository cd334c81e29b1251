"""A Spot fleet that changes under a running job: real launchers, agents, ranks and one dash-memd.

Every node runs the identical command (``--nnodes MIN:MAX``, no rendezvous
endpoint: dash-memd serves it). A notice on one node: the job agrees on a
step, checkpoints it, the noticed node exits 75 and the others go on at the
smaller world from that step. A node killed outright: the others notice
within seconds and go on from the newest committed checkpoint. A node that
joins: the job checkpoints, then grows. Each test rebuilds the committed
history from the ranks' logs (tests/bin/elastic_train.py) and checks it: no
step done twice after a notice, at most ``interval`` redone after a kill,
and every sample of an epoch seen exactly once.

The loopback variants give each node its own 127.0.0.x address; the
namespace variants put each node in a network namespace of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from conftest import dashrun_cmd, kill_tree, load_fake_metadata, wait_for

from dashrun.launch.jobstate import JobState, job_state

pytestmark = pytest.mark.slow

ELASTIC_TRAIN = Path(__file__).parent / "bin" / "elastic_train.py"
FakeMetadata = load_fake_metadata().FakeMetadata
PREEMPTED = 75
SAMPLES, GLOBAL_BATCH = 96, 12  # 8 steps an epoch, at any world size of 1-3 nodes of 1-2 ranks


@dataclasses.dataclass(frozen=True)
class Record:
    node: str
    step: int
    epoch: int
    world: int
    generation: int
    samples: tuple[int, ...]


def records(out: Path) -> list[Record]:
    found = []
    for path in out.glob("*.log"):
        for line in path.read_text().splitlines():
            if line and line[0].isdigit():
                step, epoch, world, generation, samples = line.split(" ")
                found.append(Record(path.stem, int(step), int(epoch), int(world), int(generation),
                                    tuple(map(int, samples.split(",")))))
    return found


def committed_history(out: Path) -> dict[int, list[Record]]:
    """Per step, the records of the newest world that ran it: steps redone after a rollback replace the lost."""
    by_step: dict[int, list[Record]] = defaultdict(list)
    for record in records(out):
        by_step[record.step].append(record)
    return {step: [r for r in rs if r.generation == max(x.generation for x in rs)] for step, rs in by_step.items()}


def assert_each_sample_once(out: Path) -> None:
    history = committed_history(out)
    epochs: dict[int, list[int]] = defaultdict(list)
    for step in sorted(history):
        batch = [s for r in history[step] for s in r.samples]
        assert len(batch) == GLOBAL_BATCH, f"step {step}: global batch of {len(batch)} ({history[step]})"
        epochs[history[step][0].epoch].extend(batch)
    for epoch, seen in epochs.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample seen twice"
    for epoch in sorted(epochs)[:-1]:  # every epoch but the last ran to its end
        assert sorted(epochs[epoch]) == list(range(SAMPLES)), f"epoch {epoch} missed samples"


def runs_of_steps(out: Path) -> dict[int, set[int]]:
    """step -> the generations that ran it."""
    ran: dict[int, set[int]] = defaultdict(set)
    for record in records(out):
        ran[record.step].add(record.generation)
    return ran


def assert_no_step_twice(out: Path, steps: int) -> None:
    """Every step of the run ran, each in one world only: nothing redone at a change."""
    ran = runs_of_steps(out)
    assert sorted(ran) == list(range(steps))
    assert all(len(gens) == 1 for gens in ran.values()), "a step was done twice"


def committed_step(memd, job: str) -> int:
    """The newest step of ``job`` dash-memd has committed now (-1: none)."""
    with memd.client() as client:
        info = client.latest(job)
    return -1 if info is None else info.step


def assert_redone_at_most(out: Path, steps: int, interval: int, lost_after: int,
                          committed_before: int | None = None) -> None:
    """Every step ran; those run twice are the run of steps after the checkpoint the next world restored, up to
    the lost node's last step (or the one it was in, ``lost_after + 1``), and none that dash-memd had committed
    before the loss (``committed_before``, where the test read it). That is ``interval`` steps, or fewer, where
    the newest checkpoint due had been committed; a checkpoint is committed after the step it holds, so one still
    on its way from the lost node (its shard dies with the node's dash-agent) adds the steps run meanwhile."""
    ran = runs_of_steps(out)
    assert sorted(ran) == list(range(steps))
    redone = sorted(step for step, gens in ran.items() if len(gens) > 1)
    if not redone:
        return
    assert redone == list(range(redone[0], redone[-1] + 1)), f"steps {redone} redone: not one run of steps"
    restored = {int(line.split(" ")[1]) for path in out.glob("*.log") for line in path.read_text().splitlines()
                if line.startswith("start ")}  # the step each rank's restore() resumed at
    assert redone[0] in restored, f"steps {redone} redone, but no rank resumed at {redone[0]}: {sorted(restored)}"
    assert redone[-1] <= lost_after + 1, f"steps {redone} redone: past the lost node's step {lost_after}"
    if committed_before is not None:
        assert redone[0] > committed_before, f"steps {redone} redone: step {committed_before} was committed"
    else:
        assert len(redone) <= interval + 1, f"steps {redone} redone: more than the interval"


def worlds(out: Path) -> list[int]:
    """World sizes (ranks) in the order of the committed history."""
    history = committed_history(out)
    sizes = [history[step][0].world for step in sorted(history)]
    return [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w]


class Node:
    """One node's dashrun, as its boot script would start it."""

    def __init__(self, memd, job: str, out: Path, index: int, steps: int, *extra: str, nnodes: str = "2:3",
                 delay: float = 0.15, interval: int = 4, netns=None, script: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        self.name = netns.address if netns is not None else f"127.0.0.{index}"
        cmd = dashrun_cmd(memd, "--nnodes", nnodes, "--local-addr", self.name, "--monitor-interval", "0.1", *extra,
                          str(ELASTIC_TRAIN), "--out", str(out), "--steps", str(steps), "--samples", str(SAMPLES),
                          "--global-batch", str(GLOBAL_BATCH), "--interval", str(interval), "--delay", str(delay),
                          *script, job=job, nproc=1)
        self.log_path = out.parent / f"node-{index}.err"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(netns.command(cmd) if netns is not None else cmd, stdout=subprocess.DEVNULL,
                                     stderr=self._log, env={**os.environ, "OMP_NUM_THREADS": "1", **self._gloo(netns),
                                          **(env or {})},
                                     start_new_session=True)

    @staticmethod
    def _gloo(netns) -> dict[str, str]:
        """In a namespace the host name resolves to loopback: gloo must be told the node's interface, as on a
        machine whose host name does not resolve to its address."""
        return {"GLOO_SOCKET_IFNAME": netns.node_end} if netns is not None else {}

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.name} still running: {self.log()[-3000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        kill_tree(self.proc)
        self._log.close()


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


@pytest.fixture
def fakes():
    started = []

    def make(cloud: str = "aws", **kwargs) -> FakeMetadata:
        fake = FakeMetadata(cloud, **kwargs).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.stop()


def watched(fake) -> list[str]:
    return ["--cloud", "aws", "--metadata-endpoint", fake.url, "--poll-interval", "0.2"]


def newest_step(out: Path) -> int:
    return max((r.step for r in records(out)), default=-1)


def test_a_notice_on_one_node_of_three_shrinks_the_world_and_loses_no_step(memd, nodes, fakes, tmp_path):
    out, job, steps = tmp_path / "out", "shrink", 30
    fake = fakes()
    nodes += [Node(memd, job, out, 1, steps, "--cloud", "none"), Node(memd, job, out, 2, steps, "--cloud", "none"),
              Node(memd, job, out, 3, steps, *watched(fake))]
    wait_for(lambda: newest_step(out) >= 6 or any(n.proc.poll() is not None for n in nodes), 180,
             "the three nodes to train")
    assert all(n.proc.poll() is None for n in nodes), nodes[0].log()[-3000:]
    with memd.client() as client:  # what dashrun status shows of it now
        events, live = client.membership_view(job)
        assert live == 3 and job_state(events, live) is JobState.RUNNING
    fake.notice()
    assert nodes[2].wait() == PREEMPTED, nodes[2].log()[-3000:]
    assert nodes[0].wait() == 0, nodes[0].log()[-3000:]
    assert nodes[1].wait() == 0, nodes[1].log()[-3000:]
    assert_no_step_twice(out, steps)
    assert worlds(out) == [3, 2]
    assert "world 3 -> 2: 127.0.0.3 noticed" in nodes[0].log()
    assert_each_sample_once(out)
    with memd.client() as client:
        history = client.membership(job)
    assert [(e.node, e.change) for e in history if e.change in ("left", "died")] == [("127.0.0.3", "left")]
    assert sorted(e.node for e in history if e.change == "finished") == ["127.0.0.1", "127.0.0.2"]
    membership = json.loads((out / "membership.json").read_text())  # ckpt.membership, as rank 0 ended with it
    assert membership["nodes"] == ["127.0.0.1", "127.0.0.2"] and membership["generation"] > 0
    assert ("127.0.0.3", "left") in [(e["node"], e["change"]) for e in membership["history"]]
    # The job's ledger (dashrun report): three stays, one ended by its notice; a shrink at a checkpoint redoes
    # nothing; the noticed node's agent read its instance type and market from its metadata service.
    ledger = subprocess.run([sys.executable, "-m", "dashrun", "report", job, "--memd", memd.address, "--token-file",
                             str(memd.token_file), *memd.tls_args, "--json"], capture_output=True, text=True,
                            timeout=60)
    assert ledger.returncode == 0, ledger.stderr
    body = json.loads(ledger.stdout)
    assert body["steps_redone"] == 0 and body["preemptions"] == {"notice": 1, "killed": 0}
    assert sorted((s["node"], s["why"]) for s in body["nodes"]) == [
        ("127.0.0.1", "finished"), ("127.0.0.2", "finished"), ("127.0.0.3", "notice")]
    assert body["largest_world"] == 3 and 0 < body["goodput"] <= 1


def test_a_notice_on_every_node_ends_the_job_with_75_and_loses_no_step(memd, nodes, fakes, tmp_path):
    out, job = tmp_path / "out", "all-noticed"
    fake = fakes()  # one metadata service for both nodes: the notice reaches them at once
    nodes += [Node(memd, job, out, index, 1000, *watched(fake), nnodes="1:2") for index in (1, 2)]
    wait_for(lambda: newest_step(out) >= 4 or any(n.proc.poll() is not None for n in nodes), 180,
             "the two nodes to train")
    fake.notice()
    for node in nodes:  # promptly: no exit barrier, no waiting for nodes that will not come
        assert node.wait(60) == PREEMPTED, node.log()[-3000:]
    last = newest_step(out)
    with memd.client() as client:
        assert client.latest(job).step == last  # the emergency checkpoint holds the last step done
        # what dashrun status shows: both nodes left on their notices, none heartbeats, none came back
        assert job_state(client.membership(job), client.live_members(job)) is JobState.PREEMPTED
    assert_no_step_twice(out, last + 1)
    assert worlds(out) == [2]


def test_a_change_of_members_uses_up_no_restart_a_ranks_own_failure_does(memd, nodes, fakes, tmp_path):
    """--max-restarts 1: a notice shrinks the world (no restart used), then a rank's own bug on another node
    fails it once: restarted, which uses the one restart, and the job still ends well."""
    out, job, steps, interval = tmp_path / "out", "restarts", 40, 4
    fake = fakes()
    fail = ("--fail-once-at", "20")
    nodes += [Node(memd, job, out, 1, steps, "--cloud", "none", "--max-restarts", "1", delay=0.2, script=fail),
              Node(memd, job, out, 2, steps, "--cloud", "none", "--max-restarts", "1", delay=0.2),
              Node(memd, job, out, 3, steps, *watched(fake), "--max-restarts", "1", delay=0.2)]
    wait_for(lambda: newest_step(out) >= 4 or any(n.proc.poll() is not None for n in nodes), 180,
             "the three nodes to train")
    fake.notice()
    assert nodes[2].wait() == PREEMPTED, nodes[2].log()[-3000:]
    assert nodes[0].wait() == 0, nodes[0].log()[-3000:]
    assert nodes[1].wait() == 0, nodes[1].log()[-3000:]
    assert (out / "failed-once").exists()
    shrunk_at = min(r.step for r in records(out) if r.world == 2)
    assert shrunk_at < 20, "the rank failed before the world shrank"
    assert "1/1 restarts left" in nodes[0].log(), nodes[0].log()[-3000:]
    assert_redone_at_most(out, steps, interval, 20)
    assert_each_sample_once(out)


def test_the_first_node_killed_outright_the_others_go_on(memd, nodes, tmp_path):
    """The node started first is SIGKILLed with all its processes. It is also the world's rank 0, which holds
    the TCPStore the ranks formed their process group with (torch numbers the nodes by address)."""
    out, job, steps, interval = tmp_path / "out", "killed", 30, 4
    nodes += [Node(memd, job, out, index, steps, "--cloud", "none", interval=interval) for index in (1, 2, 3)]
    wait_for(lambda: newest_step(out) >= 9 or any(n.proc.poll() is not None for n in nodes), 180,
             "the three nodes to train")
    assert worlds(out) == [3], nodes[0].log()[-3000:]
    committed_before = committed_step(memd, job)
    killed_after = newest_step(out)
    nodes[0].stop()  # SIGKILL, the launcher's whole session
    assert nodes[1].wait() == 0, nodes[1].log()[-3000:]
    assert nodes[2].wait() == 0, nodes[2].log()[-3000:]
    assert_redone_at_most(out, steps, interval, killed_after, committed_before)
    assert worlds(out) == [3, 2]
    assert "world 3 -> 2: 127.0.0.1 lost" in nodes[1].log() + nodes[2].log()
    assert_each_sample_once(out)
    with memd.client() as client:
        history = client.membership(job)
    assert [(e.node, e.change) for e in history if e.change in ("left", "died")] == [("127.0.0.1", "died")]


def test_a_node_that_joins_is_admitted_at_a_checkpoint(memd, nodes, tmp_path):
    out, job, steps = tmp_path / "out", "grow", 60
    nodes += [Node(memd, job, out, 1, steps, "--cloud", "none", delay=0.3),
              Node(memd, job, out, 2, steps, "--cloud", "none", delay=0.3)]
    wait_for(lambda: newest_step(out) >= 2 or any(n.proc.poll() is not None for n in nodes), 180,
             "the two nodes to train")
    assert worlds(out) == [2], nodes[0].log()[-3000:]
    # The same boot command on every node, --fresh included: it must not start a running job over.
    nodes.append(Node(memd, job, out, 3, steps, "--cloud", "none", "--fresh", delay=0.3))
    for node in nodes:
        assert node.wait() == 0, node.log()[-3000:]
    assert "running on other nodes" in nodes[2].log()
    assert_no_step_twice(out, steps)
    assert worlds(out) == [2, 3]
    assert "world 2 -> 3: 127.0.0.3 joined" in nodes[0].log()
    assert_each_sample_once(out)
    late = Node(memd, job, out, 4, steps, "--cloud", "none")  # the job is done: nothing to join
    nodes.append(late)
    assert late.wait(120) == 0, late.log()[-3000:]
    assert "has finished" in late.log()


@pytest.mark.parametrize("in_namespaces", [False, True], ids=["loopback", "namespaces"])
def test_below_min_the_job_waits_then_resumes_when_a_node_joins(in_namespaces, memd_factory, fleet_factory, nodes,
                                                                 fakes, tmp_path):
    out, job, steps = tmp_path / "out", "below-min", 30
    if in_namespaces:
        fleet = fleet_factory(3)
        memd = memd_factory("--listen", f"{fleet.host_address}:0")
        fake = fakes(host=fleet.host_address)
        place = {"netns": fleet[0]}, {"netns": fleet[1]}, {"netns": fleet[2]}
    else:
        memd, fake, place = memd_factory("--memory-limit", "256MiB"), fakes(), ({}, {}, {})
    nodes += [Node(memd, job, out, 1, steps, "--cloud", "none", **place[0]),
              Node(memd, job, out, 2, steps, *watched(fake), **place[1])]
    wait_for(lambda: newest_step(out) >= 4 or any(n.proc.poll() is not None for n in nodes), 180,
             "the two nodes to train")
    fake.notice()
    assert nodes[1].wait() == PREEMPTED, nodes[1].log()[-3000:]
    stopped_at = newest_step(out)
    assert nodes[0].proc.poll() is None  # one node of MIN 2: it waits, it does not end
    nodes.append(Node(memd, job, out, 3, steps, "--cloud", "none", **place[2]))
    assert nodes[0].wait() == 0, nodes[0].log()[-3000:]
    assert nodes[2].wait() == 0, nodes[2].log()[-3000:]
    assert_no_step_twice(out, steps)
    assert min(step for step, gens in runs_of_steps(out).items() if max(gens) > 0) == stopped_at + 1
    assert_each_sample_once(out)
    last = max(r.generation for r in records(out))
    assert {r.node.rsplit("-", 1)[0] for r in records(out) if r.generation == last} == {nodes[0].name, nodes[2].name}


def test_a_node_gone_silent_the_others_go_on(memd, nodes, tmp_path):
    """The loopback stand-in for a pulled cable: every process of the third node is stopped (SIGSTOP), so its
    peers hear nothing more from it and no connection is reset; the namespaced variant is below."""
    out, job, steps, interval = tmp_path / "out", "silent", 30, 4
    nodes += [Node(memd, job, out, index + 1, steps, "--cloud", "none", interval=interval) for index in range(3)]
    wait_for(lambda: newest_step(out) >= 9 or any(n.proc.poll() is not None for n in nodes), 180,
             "the three nodes to train")
    assert worlds(out) == [3], nodes[0].log()[-3000:]
    committed_before = committed_step(memd, job)
    silent_after = newest_step(out)
    launcher = psutil.Process(nodes[2].proc.pid)
    for process in (launcher, *launcher.children(recursive=True)):
        process.suspend()  # SIGKILLed, stopped or not, by the fixture
    assert nodes[0].wait() == 0, nodes[0].log()[-3000:]
    assert nodes[1].wait() == 0, nodes[1].log()[-3000:]
    assert_redone_at_most(out, steps, interval, silent_after, committed_before)
    assert worlds(out) == [3, 2]
    assert f"world 3 -> 2: {nodes[2].name} lost" in nodes[0].log() + nodes[1].log()
    assert_each_sample_once(out)


def test_a_node_cut_off_the_network_the_others_go_on(fleet_factory, memd_factory, nodes, tmp_path):
    """Each node in a network namespace of its own; the third one's cable is pulled: packets dropped both ways,
    no connection reset, its peers hear nothing more from it."""
    fleet = fleet_factory(3)
    memd = memd_factory("--listen", f"{fleet.host_address}:0")
    out, job, steps, interval = tmp_path / "out", "cut", 30, 4
    nodes += [Node(memd, job, out, index + 1, steps, "--cloud", "none", interval=interval, netns=fleet[index])
              for index in range(3)]
    wait_for(lambda: newest_step(out) >= 9 or any(n.proc.poll() is not None for n in nodes), 180,
             "the three nodes to train")
    assert worlds(out) == [3], nodes[0].log()[-3000:]
    committed_before = committed_step(memd, job)
    cut_after = newest_step(out)
    fleet[2].link_down()
    assert nodes[0].wait() == 0, nodes[0].log()[-3000:]
    assert nodes[1].wait() == 0, nodes[1].log()[-3000:]
    assert_redone_at_most(out, steps, interval, cut_after, committed_before)
    assert worlds(out) == [3, 2]
    assert f"world 3 -> 2: {fleet[2].address} lost" in nodes[0].log() + nodes[1].log()
    assert_each_sample_once(out)


def test_a_fleet_in_namespaces_shrinks_grows_and_loses_its_first_node(fleet_factory, memd_factory, nodes, fakes,
                                                                      tmp_path):
    """The loopback scenarios above, one after another, with each node in a network namespace of its own and
    dash-memd in the root one: a notice on one node of three, a replacement that joins, then the node started
    first (the world's rank 0, holding its store) SIGKILLed with all its processes."""
    fleet = fleet_factory(4)
    memd = memd_factory("--listen", f"{fleet.host_address}:0")
    fake = fakes(host=fleet.host_address)
    out, job, steps, interval = tmp_path / "out", "fleet", 80, 4

    def node(index: int, *extra: str) -> Node:
        return Node(memd, job, out, index + 1, steps, *extra, interval=interval, delay=0.2, netns=fleet[index])

    first, second, noticed = node(0, "--cloud", "none"), node(1, "--cloud", "none"), node(2, *watched(fake))
    nodes += [first, second, noticed]
    running = lambda: all(n.proc.poll() is None for n in nodes if n is not noticed)  # noqa: E731
    wait_for(lambda: newest_step(out) >= 4 or not running(), 180, "the three nodes to train")
    assert worlds(out) == [3], first.log()[-3000:]
    fake.notice()
    assert noticed.wait() == PREEMPTED, noticed.log()[-3000:]
    wait_for(lambda: worlds(out)[-1:] == [2] or not running(), 120, "the two others to go on")
    joined = node(3, "--cloud", "none")
    nodes.append(joined)
    wait_for(lambda: worlds(out) == [3, 2, 3] or not running(), 180, "the new node to be admitted")
    grown_at = newest_step(out)
    wait_for(lambda: newest_step(out) >= grown_at + interval + 2 or not running(), 120, "the grown world to train")
    assert running() and worlds(out) == [3, 2, 3], first.log()[-3000:]
    committed_before = committed_step(memd, job)
    killed_after = newest_step(out)
    first.stop()  # SIGKILL, the launcher's whole session
    assert second.wait() == 0, second.log()[-3000:]
    assert joined.wait() == 0, joined.log()[-3000:]
    assert worlds(out) == [3, 2, 3, 2]
    assert_redone_at_most(out, steps, interval, killed_after, committed_before)
    redone = [step for step, gens in runs_of_steps(out).items() if len(gens) > 1]
    assert all(step > grown_at for step in redone), f"steps {redone} redone at the notice or the join"
    console = second.log() + joined.log()
    assert f"world 3 -> 2: {fleet[2].address} noticed" in second.log()
    assert f"world 2 -> 3: {fleet[3].address} joined" in second.log()
    assert f"world 3 -> 2: {fleet[0].address} lost" in console
    assert_each_sample_once(out)
    with memd.client() as client:
        history = client.membership(job)
    assert [(e.node, e.change) for e in history if e.change in ("left", "died")] == [(fleet[2].address, "left"),
                                                                             (fleet[0].address, "died")]


def test_dash_memd_killed_mid_job_the_rendezvous_comes_back_with_it(memd, nodes, tmp_path):
    """dash-memd serves the rendezvous: killed and started again on its port while two nodes train, the job
    goes on in the same world, and a node that comes after is admitted into it through the restarted one."""
    out, job, steps, interval = tmp_path / "out", "memd-restart", 60, 4
    nodes += [Node(memd, job, out, index, steps, "--cloud", "none", interval=interval, delay=0.25)
              for index in (1, 2)]
    wait_for(lambda: newest_step(out) >= 6 or any(n.proc.poll() is not None for n in nodes), 180,
             "the two nodes to train")
    assert worlds(out) == [2], nodes[0].log()[-3000:]
    memd.kill()  # SIGKILL: what it had only in RAM is gone; its rendezvous state is on disk
    restarted_after = newest_step(out)
    memd.start(port=memd.port)
    wait_for(lambda: newest_step(out) >= restarted_after + interval + 1 or any(n.proc.poll() is not None
                                                                              for n in nodes), 120,
             "the job to go on")
    nodes.append(Node(memd, job, out, 3, steps, "--cloud", "none", interval=interval, delay=0.25))
    for node in nodes:
        assert node.wait() == 0, node.log()[-3000:]
    assert worlds(out) == [2, 3]
    assert "world 2 -> 3: 127.0.0.3 joined" in nodes[0].log()
    assert_redone_at_most(out, steps, interval, restarted_after)
    assert_each_sample_once(out)
    with memd.client() as client:
        assert client.latest(job).step >= steps - interval
