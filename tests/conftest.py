"""Fixtures with real parts: a dash-memd process on a free loopback port, tokens, helpers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dashrun.errors import UnavailableError
from dashrun.util import daemon
from dashrun.util.tokens import write_token
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.operator import write_key_pair
from dashrun.wire.tls import TlsSettings

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "bin" / "train.py"


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


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    try:
        return daemon.wait_until(predicate, timeout, what, interval=interval)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def kill_tree(proc: subprocess.Popen | psutil.Process, sig: int = signal.SIGKILL) -> None:
    """Signal a process and every descendant (the agent runs in its own session, so not by group)."""
    try:
        root = psutil.Process(proc.pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for p in (proc, *descendants):
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    if isinstance(proc, subprocess.Popen):
        proc.wait(timeout=30)  # reaped by Popen itself, so its returncode is the real one
    else:
        psutil.wait_procs([proc], timeout=30)
    psutil.wait_procs(descendants, timeout=30)


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


class Memd:
    """A dash-memd process started by a test; stopped (or killed) by it."""

    def __init__(self, data_dir: Path, token_file: Path, *extra: str, log_path: Path):
        self.data_dir, self.token_file, self.extra, self.log_path = data_dir, token_file, extra, log_path
        self.proc: subprocess.Popen | None = None
        self.host, self.port = "127.0.0.1", 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def token(self) -> bytes:
        return self.token_file.read_bytes().strip()

    @property
    def operator_key(self) -> Path:
        """The operator's private key of this cluster (made beside the token file the first time it is asked
        for); its public key is :attr:`operator_pubkey`."""
        key = self.token_file.with_name(self.token_file.name + ".operator")
        if not key.exists():
            write_key_pair(key)
        return key

    @property
    def operator_pubkey(self) -> Path:
        return self.operator_key.with_name(self.operator_key.name + ".pub")

    def start(self, port: int | None = None) -> Memd:
        ready = self.data_dir.parent / f"memd-ready-{os.getpid()}-{time.monotonic_ns()}"
        listen = f"127.0.0.1:{self.port if port is None else port}"
        try:
            self.proc = daemon.start(
                [sys.executable, "-m", "dashrun.memd", "start", "--listen", listen, "--data-dir", str(self.data_dir),
                 "--token-file", str(self.token_file), "--ready-file", str(ready), *self.extra],
                ready=daemon.file_written(ready), what="dash-memd", log=self.log_path, timeout=30)
        except UnavailableError as e:
            raise AssertionError(f"{e}: {self.log()[-2000:]}") from None
        self.host, port = ready.read_text().strip().rsplit(":", 1)
        self.port = int(port)
        ready.unlink()
        return self

    @property
    def tls_args(self) -> list[str]:
        """The options a client of this dash-memd needs: --no-tls if it was started with it."""
        return ["--no-tls"] if "--no-tls" in self.extra else []

    def client(self, **kwargs) -> MemdClient:
        kwargs.setdefault("tls", TlsSettings(plaintext=bool(self.tls_args)))
        return MemdClient(self.host, self.port, self.token, **kwargs)

    def stop(self) -> int | None:
        return daemon.stop(self.proc, timeout=30) if self.proc is not None else None

    def kill(self) -> None:
        daemon.stop(self.proc, timeout=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def memd_factory(tmp_path, token_file):
    started: list[Memd] = []

    def make(*extra: str, data_dir: Path | None = None) -> Memd:
        memd = Memd(data_dir or tmp_path / f"memd-data-{len(started)}", token_file, *extra,
                    log_path=tmp_path / f"memd-{len(started)}.log")
        started.append(memd)
        return memd.start()

    yield make
    for memd in started:
        memd.stop()


@pytest.fixture
def memd(memd_factory) -> Memd:
    return memd_factory("--memory-limit", "256MiB")


def dashrun_cmd(memd: Memd, *args: str, job: str, nproc: int = 2) -> list[str]:
    """A launch as the operator runs it: with the cluster's token and the key that signs its launch spec."""
    key = getattr(memd, "operator_key", None)  # a relay in front of dash-memd stands in for it, keyless
    return [sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(memd.token_file),
            *(["--operator-key", str(key)] if key else []), *memd.tls_args, "--job-id", job,
            "--nproc-per-node", str(nproc), *args]


class Agent:
    """A dash-agent process started by a test."""

    def __init__(self, memd: Memd, socket_path: Path, log_path: Path, env: dict | None = None):
        self.memd, self.socket_path, self.log_path = memd, socket_path, log_path
        try:
            self.proc = daemon.start(
                [sys.executable, "-m", "dashrun.agent", "--memd", memd.address, "--token-file", str(memd.token_file),
                 "--socket", str(socket_path), "--memd-timeout", "10", "--drain-timeout", "10", *memd.tls_args],
                ready=daemon.accepting(socket_path), what="dash-agent", log=log_path, timeout=30,
                env={**os.environ, **(env or {})})
        except UnavailableError as e:
            raise AssertionError(f"{e}: {self.log()[-2000:]}") from None

    def stop(self) -> None:
        daemon.stop(self.proc, timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def agent_factory(short_tmp, tmp_path):
    started: list[Agent] = []

    def make(memd: Memd, env: dict | None = None) -> Agent:
        agent = Agent(memd, short_tmp / f"a{len(started)}.sock", tmp_path / f"agent-{len(started)}.log", env)
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


@pytest.fixture
def fleet_factory():
    """``fleet_factory(count)``: nodes in network namespaces on a bridge (tests/netns.py), removed after the test;
    the test is skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""
    from netns import Fleet, unavailable

    made: list[Fleet] = []

    def make(count: int = 1) -> Fleet:
        reason = unavailable()
        if reason:
            pytest.skip(reason)
        fleet = Fleet(count)
        made.append(fleet)
        return fleet.__enter__()

    yield make
    for fleet in made:
        fleet.close()


class SmallFs:
    """A size-limited file system (tmpfs) mounted at ``path``; ``resize`` remounts it with another size."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=30)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True,
                       timeout=30)

    def fill(self) -> Path:
        """Write a file that takes every byte left; deleting it gives the space back."""
        filler = self.path / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * (64 << 10)):
                    pass
            except OSError:  # no space left
                pass
        return filler

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)  # still in use: detach


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size)``: a tmpfs of ``size`` (mount's units: ``4m``), always unmounted; skips unless root."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited file system needs root and mount(8)")
    mounted: list[SmallFs] = []

    def make(size: str) -> SmallFs:
        fs = SmallFs(tmp_path / f"small-fs-{len(mounted)}", size)
        mounted.append(fs)
        return fs

    yield make
    for fs in mounted:
        fs.unmount()
