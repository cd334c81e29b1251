"""Fixtures with real parts, from the harness (dashrun/testing/): dash-memd, dash-agent, moto, namespaces, tmpfs.

Every test runs under the leak check (``no_leaked_processes``): each process it
started must be gone after its teardown. The harness's names that tests import
from here (``wait_for``, ``kill_tree``, ``Memd``, ``dashrun_cmd``) are
re-exported so that they keep one home, the harness.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from dashrun.testing import leaks, netns, smallfs
from dashrun.testing.agent import Agent
from dashrun.testing.memd import Memd, dashrun_cmd
from dashrun.testing.processes import free_port, kill_tree, wait_for
from dashrun.testing.s3 import S3Server, make_bucket, use_endpoint
from dashrun.util.tokens import write_token

__all__ = ["REFERENCE_STEPS", "REPO", "TRAIN", "Agent", "Memd", "dashrun_cmd", "free_port", "kill_tree",
           "load_fake_metadata", "wait_for"]

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "bin" / "train.py"


# Ctrl-C as on a terminal: a suite started in the background of a non-interactive shell (`cmd &`, nohup, some CI
# runners) inherits SIGINT ignored, and so would every process a test starts (Python keeps an inherited SIG_IGN),
# so a test's SIGINT would reach no one. Put back what an interactive shell gives a command.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Fail the test (after killing them) if processes it started outlive its teardown (dashrun.testing.leaks).

    Autouse and function-scoped, so it is set up before and torn down after every other function fixture of
    the test; module- and session-scoped fixtures are set up before it, outside the tag, and so are exempt.
    """
    with leaks.tagged() as watch:
        yield watch
    leaks.check(watch)


@pytest.fixture(autouse=True)
def no_cloud_probes(monkeypatch):
    """Never let a dash-agent started by a test look for a cloud metadata service beyond loopback."""
    monkeypatch.setenv("DASH_CLOUD", "none")


def load_fake_metadata():
    """scripts/fake_metadata.py as a module (it is a script, not part of the package)."""
    import importlib.util

    if "fake_metadata" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fake_metadata", REPO / "scripts" / "fake_metadata.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_metadata"] = module
        spec.loader.exec_module(module)
    return sys.modules["fake_metadata"]


@pytest.fixture
def short_tmp():
    """A short directory (Unix socket paths max out near 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    write_token(path)
    return path


@pytest.fixture
def memd_factory(tmp_path, token_file):
    """``make(*options, data_dir=None, netns=None)``: a started dash-memd (harness Memd), stopped after the test;
    with ``netns``, a fleet node's, inside that node's namespace."""
    started: list[Memd] = []

    def make(*extra: str, data_dir: Path | None = None, netns=None) -> Memd:
        memd = Memd(data_dir or tmp_path / f"memd-data-{len(started)}", token_file, *extra,
                    log_path=tmp_path / f"memd-{len(started)}.log", netns=netns)
        started.append(memd)
        return memd.start()

    yield make
    for memd in started:
        memd.stop()


@pytest.fixture
def memd(memd_factory) -> Memd:
    return memd_factory("--memory-limit", "256MiB")


@pytest.fixture
def agent_factory(short_tmp, tmp_path):
    """``make(memd, env=None, netns=None)``: a serving dash-agent (harness Agent), stopped after the test; with
    ``netns``, a fleet node's, inside that node's namespace."""
    started: list[Agent] = []

    def make(memd: Memd, env: dict | None = None, netns=None) -> Agent:
        agent = Agent(memd, short_tmp / f"a{len(started)}.sock", tmp_path / f"agent-{len(started)}.log", env,
                      netns=netns)
        started.append(agent)
        return agent

    yield make
    for agent in started:
        agent.stop()


@pytest.fixture
def rank_env(monkeypatch):
    """Build a Checkpointer as rank ``rank`` of ``world`` (ranks simulated in one process), talking to ``agent``."""
    from dashrun.rank.checkpointer import Checkpointer

    def make(agent, job, rank, world, **objects) -> Checkpointer:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        monkeypatch.setenv("DASH_AGENT_SOCKET", str(agent.socket_path) if agent else "/nonexistent/agent.sock")
        monkeypatch.setenv("DASH_JOB_ID", job)
        if agent:  # dash-memd, as dashrun's launcher tells its ranks
            monkeypatch.setenv("DASH_MEMD", agent.memd.address)
            monkeypatch.setenv("DASH_TOKEN_FILE", str(agent.memd.token_file))
            if agent.memd.tls_args:
                monkeypatch.setenv("DASH_NO_TLS", "1")
        return Checkpointer(interval=5, **objects)
    return make


@pytest.fixture
def stack(memd, agent_factory):
    return memd, agent_factory(memd)


#: The reference run: the uninterrupted job every interrupted one is compared with.
REFERENCE_STEPS = 30


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, dict]:
    """Final state of each rank after an uninterrupted run of tests/bin/train.py, under plain torchrun."""
    from runs import final_states, reference_run

    out = tmp_path_factory.mktemp("reference")
    result = reference_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(TRAIN),
                            "--steps", str(REFERENCE_STEPS), "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return final_states(out)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """One moto S3 server for the module's tests (harness S3Server); empty again only if a test restarts it."""
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path):
    """A fresh bucket on ``s3_server``, and this process's AWS chain pointed at it alone."""
    use_endpoint(monkeypatch, s3_server.endpoint, tmp_path)
    return make_bucket(s3_server)


@pytest.fixture
def fleet_factory():
    """``fleet_factory(count)``: nodes in network namespaces on a bridge (dashrun.testing.netns), removed after
    the test; the test is skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""
    made: list[netns.Fleet] = []

    def make(count: int = 1) -> netns.Fleet:
        reason = netns.unavailable()
        if reason:
            pytest.skip(reason)
        fleet = netns.Fleet(count)
        made.append(fleet)
        return fleet.__enter__()

    yield make
    for fleet in made:
        fleet.close()


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size)``: a tmpfs of ``size`` (mount's units: ``4m``), always unmounted; skips unless root."""
    reason = smallfs.unavailable()
    if reason:
        pytest.skip(reason)
    mounted: list[smallfs.SmallFs] = []

    def make(size: str) -> smallfs.SmallFs:
        fs = smallfs.SmallFs(tmp_path / f"small-fs-{len(mounted)}", size)
        mounted.append(fs)
        return fs

    yield make
    for fs in mounted:
        fs.unmount()
