"""The daemons as commands: clean shutdown on signals, one-line errors with hints, exit codes."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from conftest import TRAIN, wait_for

from dashrun import __version__, env
from dashrun.agent.config import AgentConfig
from dashrun.agent.restores import RestoreCache
from dashrun.memd.config import cgroup_memory_limit, default_memory_limit
from dashrun.util.units import format_size
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind

GiB = 1 << 30

def memd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dashrun.memd", *args]


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGTERM] * 5])
def test_memd_stops_cleanly_on_signals(memd, signals):
    for sig in signals:  # a burst of signals must not deadlock the shutdown
        memd.proc.send_signal(sig)
    assert memd.proc.wait(timeout=60) == 0
    assert "shutting down" in memd.log()


def test_agent_stops_cleanly_on_repeated_sigterm(memd, agent_factory):
    agent = agent_factory(memd)
    for _ in range(3):
        agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=60) == 0
    assert not agent.socket_path.exists()


#: A launcher as dashrun's is to its dash-agent: the agent in a session of its own, told the launcher's pid; then
#: the launcher blocks (on its stdin) until it is killed.
LAUNCHER = """
import os, subprocess, sys
with open(sys.argv[1], "w") as log:
    agent = subprocess.Popen([sys.executable, "-m", "dashrun.agent", *sys.argv[2:], "--parent-pid", str(os.getpid())],
                             stdout=log, stderr=log, start_new_session=True)
print(agent.pid, flush=True)
sys.stdin.read()
"""


def test_agent_exits_by_itself_when_its_launcher_is_killed_outright(memd, tmp_path):
    """SIGKILL leaves the launcher no time to stop its agent, and the agent's own session spares it the terminal's
    signals: the agent sees its --parent-pid go, delivers what it holds, removes its socket and exits."""
    from dashrun.util import daemon

    socket_path, log = tmp_path / "agent.sock", tmp_path / "agent.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(log), "--memd", memd.address, "--token-file", str(memd.token_file),
         "--socket", str(socket_path), "--drain-timeout", "10", *memd.tls_args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    agent = None
    try:
        agent = psutil.Process(int(launcher.stdout.readline()))
        wait_for(daemon.accepting(socket_path), 60, "dash-agent to accept on its socket")
        assert agent.ppid() == launcher.pid
        launcher.kill()
        assert launcher.wait(timeout=60) == -signal.SIGKILL
        # Orphaned, the agent is no child of this test's: gone (or a zombie its new parent has yet to reap).
        wait_for(lambda: not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE, 60,
                 "dash-agent to exit once its launcher is gone")
    finally:
        launcher.kill()
        launcher.wait()
        if agent is not None and agent.is_running():
            agent.kill()
    assert f"launcher (pid {launcher.pid}) is gone" in log.read_text()
    assert not socket_path.exists()


def hand_over(link: AgentLink, job: str, step: int):
    """Hand the agent a fully staged 3000-byte shard, as a rank does; the future of its reply."""
    fd = os.memfd_create("test-shard")
    try:
        os.write(fd, os.urandom(3000))
        header = ShardHeader(job, step, 0, 1, 2000, 0, 2000, 900, 100, "ab" * 32)
        return link.request(Kind.SNAPSHOT, {"shard": header.to_body(), "ready": header.nbytes}, fds=[fd])
    finally:
        os.close(fd)


@pytest.mark.slow
def test_the_agent_forgets_finished_connections_and_survives_running_out_of_descriptors(stack, rank_env):
    """Workers restarting all day: each connection the agent took is closed and forgotten once its rank is gone and
    its shards are delivered, and running out of descriptors costs the ranks that came then, not the node."""
    memd, agent = stack
    proc = psutil.Process(agent.proc.pid)
    fds, threads = proc.num_fds(), proc.num_threads()
    proc.rlimit(psutil.RLIMIT_NOFILE, (fds + 48, proc.rlimit(psutil.RLIMIT_NOFILE)[1]))
    for n in range(1, 301):  # a rank that pings and exits, or hands a shard over and exits (waiting or not)
        link = AgentLink(str(agent.socket_path), connect_timeout=10)
        if n % 10 == 0:
            done = hand_over(link, "churn", n)
            if n % 20 == 0:
                done.result(timeout=30)
        else:
            link.call(Kind.PING, timeout=10)
        link.close()
    # More ranks at once than the agent has descriptors: those it cannot take wait, or are refused.
    burst = [AgentLink(str(agent.socket_path), connect_timeout=10) for _ in range(96)]
    for link in burst:
        link.request(Kind.PING)
    wait_for(lambda: "Too many open files" in agent.log(), 30, "the agent to run out of descriptors")
    for link in burst:
        link.close()
    wait_for(lambda: proc.num_fds() <= fds + 4 and proc.num_threads() <= threads + 4, 60,
             "the agent to close and forget every finished connection")
    with memd.client() as client:
        wait_for(lambda: client.latest("churn", 300), 30, "the last shard handed over to commit")
    model = torch.nn.Linear(8, 8)
    ckpt = rank_env(agent, "after-churn", 0, 1, model=model)
    assert ckpt.save(0, force=True) and ckpt.wait(60)  # a new rank is served end to end
    ckpt.close()
    with memd.client() as client:
        assert client.latest("after-churn").step == 0


def test_a_restore_image_being_sent_stays_open_when_the_cache_drops_it(memd):
    """The descriptor a rank is being sent is the sender's own: another rank served, or the image expiring, closes
    the cache's descriptor, never the one on its way (whose number the system could otherwise give to another file)."""
    payload = os.urandom(3000)
    header = ShardHeader("leased", 7, 0, 1, 2000, 0, 2000, 900, 100, "ab" * 32)
    with memd.client() as client:
        assert client.put_shard(header, [payload])["committed"]
    cache = RestoreCache(AgentConfig(memd.host, memd.port, memd.token))
    sending = cache.get("leased", None)
    other = cache.get("leased", None)  # the node's other rank, served from the same image
    cache.handed_out(other.image, local_ranks=1)
    cache.expire(everything=True)
    with mmap.mmap(sending.fd, os.fstat(sending.fd).st_size, prot=mmap.PROT_READ) as image:
        assert image[:2000] == payload[:2000]
        tail = sending.tails[0]
        assert image[tail:tail + 1000] == payload[2000:]
    sending.close()
    other.close()


def test_token_command_writes_a_private_token_and_never_overwrites(tmp_path):
    path = tmp_path / "tok"
    assert subprocess.run(memd_cmd("token", "--out", str(path)), capture_output=True).returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(path.read_text().strip()) == 64
    again = subprocess.run(memd_cmd("token", "--out", str(path)), capture_output=True, text=True)
    assert again.returncode != 0


def test_memd_version_and_every_option_has_an_env_twin():
    version = subprocess.run(memd_cmd("--version"), capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"dash-memd {__version__}"
    shown = subprocess.run(memd_cmd("start", "--help"), capture_output=True, text=True, timeout=60).stdout
    shown += subprocess.run(memd_cmd("token", "--help"), capture_output=True, text=True, timeout=60).stdout
    shown += subprocess.run(memd_cmd("keys", "--help"), capture_output=True, text=True, timeout=60).stdout
    shown = " ".join(shown.split())  # help text wraps anywhere
    missing = [v.name for v in env.ALL if "dash-memd" in v.read_by and v.name not in shown]
    assert missing == []


def fake_root(tmp_path, cgroup: str, files: dict[str, str]):
    """A directory laid out like / for the cgroup files: /proc/self/cgroup and what is under /sys/fs/cgroup."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / "sys/fs/cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys/fs/cgroup" / path).write_text(text)
    return tmp_path


def test_default_memory_limit_honours_a_cgroup_v2_limit(tmp_path):
    root = fake_root(tmp_path, "0::/kubepods/pod-1\n", {"kubepods/pod-1/memory.max": f"{4 * GiB}\n",
                                                          "kubepods/memory.max": "max\n"})
    assert cgroup_memory_limit(root) == 4 * GiB
    assert default_memory_limit(root, host_total=64 * GiB) == 2 * GiB
    assert default_memory_limit(root, host_total=2 * GiB) == 1 * GiB  # the machine is the smaller


def test_default_memory_limit_with_cgroup_v2_max_is_half_the_machine(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"memory.max": "max\n"})
    assert cgroup_memory_limit(root) is None
    assert default_memory_limit(root, host_total=64 * GiB) == 32 * GiB


def test_default_memory_limit_honours_a_cgroup_v1_limit(tmp_path):
    root = fake_root(tmp_path, "4:memory:/docker/abc\n0::/\n",
                     {"memory/memory.limit_in_bytes": f"{6 * GiB}\n"})
    assert cgroup_memory_limit(root) == 6 * GiB
    assert default_memory_limit(root, host_total=64 * GiB) == 3 * GiB
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # "unlimited"
    assert cgroup_memory_limit(root) is None


def test_default_memory_limit_without_any_cgroup_is_half_the_machine(tmp_path):
    assert cgroup_memory_limit(tmp_path) is None
    assert default_memory_limit(tmp_path, host_total=64 * GiB) == 32 * GiB


@pytest.mark.parametrize("args, message", [
    (["--memory-limit", "lots"], "not a size"),
    (["--listen", "127.0.0.1:notaport"], "invalid port"),
    (["--keep-ram", "0"], "--keep-ram"),
])
def test_memd_usage_errors_are_one_line_with_exit_code_2(tmp_path, token_file, args, message):
    result = subprocess.run(memd_cmd("start", "--data-dir", str(tmp_path / "d"), "--token-file", str(token_file),
                                     *args), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_memd_refuses_a_missing_or_weak_token(tmp_path):
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    weak.chmod(0o600)  # private, so that its weakness is what is refused
    for token in (tmp_path / "missing", weak):
        result = subprocess.run(memd_cmd("start", "--data-dir", str(tmp_path / "d"), "--token-file", str(token)),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "hint: create" in result.stderr and "Traceback" not in result.stderr


def test_memd_refuses_a_memory_limit_above_what_the_machine_lets_it_use(tmp_path, token_file):
    usable = 2 * default_memory_limit()
    result = subprocess.run(memd_cmd("start", "--data-dir", str(tmp_path / "d"), "--token-file", str(token_file),
                                     "--memory-limit", "64TiB"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--memory-limit 64TiB (64.0 TiB) is more than this machine lets dash-memd use ({format_size(usable)}" \
        in result.stderr, result.stderr
    assert not (tmp_path / "d").exists()


def test_memd_reports_a_busy_port(memd, tmp_path, token_file):
    result = subprocess.run(memd_cmd("start", "--listen", memd.address, "--data-dir", str(tmp_path / "other"),
                                     "--token-file", str(token_file)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "cannot listen" in result.stderr


def test_a_private_memd_in_use_is_named_and_one_whose_launcher_died_exits_by_itself(tmp_path):
    """The private dash-memd of a live dashrun is refused by pid; one whose dashrun was killed outright watches it
    go (--parent-pid), finishes and exits, and the next command gets the data dir (waiting for it if it must)."""
    from dashrun.errors import UsageError
    from dashrun.launch.private_memd import PrivateMemd

    root = tmp_path / "memd"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from dashrun.launch.private_memd import "
         "PrivateMemd; memd = PrivateMemd(Path(sys.argv[1]), attach=False).__enter__(); print(memd.proc.pid, "
         "flush=True); time.sleep(600)", str(root)], stdout=subprocess.PIPE, text=True)
    memd = None
    try:
        memd = psutil.Process(int(launcher.stdout.readline()))
        with pytest.raises(UsageError, match=rf"in use by another dashrun on this machine \(dash-memd pid "
                                             rf"{memd.pid}, started by pid {launcher.pid}\)"):
            PrivateMemd(root, attach=False).__enter__()
        launcher.kill()
        launcher.wait()
        with PrivateMemd(root, attach=False) as again:
            assert again.address is not None and not memd.is_running()
    finally:
        launcher.kill()
        launcher.wait()
        if memd is not None and memd.is_running():
            memd.kill()
    assert "is gone: shutting down" in (root / "memd.log").read_text()


def test_the_launcher_closes_the_agent_s_socket_once_it_gives_up_restarting_it(memd, tmp_path, monkeypatch):
    """An agent that cannot start (here: its token file is gone) is restarted a few times; then its socket goes,
    so that a rank is refused at once instead of waiting in the queue of a socket nobody will serve."""
    from dashrun.errors import UnavailableError
    from dashrun.launch import launcher
    from dashrun.launch.options import LaunchOptions
    from dashrun.wire.tls import TlsSettings

    monkeypatch.setattr(launcher, "AGENT_MAX_RESTARTS", 1)
    host, port = memd.address.rsplit(":", 1)
    options = LaunchOptions(memd=(host, int(port)), token_file=tmp_path / "gone", job_id="broken", cloud="none",
                            tls=TlsSettings(plaintext=bool(memd.tls_args)))
    with launcher.AgentProcess(options) as agent:
        wait_for(lambda: not agent.socket_path.exists(), 60, "the launcher to give up on its agent")
        assert agent.restarts == 1 and agent.proc.poll() is not None
        with pytest.raises(UnavailableError, match="cannot reach dash-agent"):
            AgentLink(str(agent.socket_path)).call(Kind.PING, timeout=5)


@pytest.mark.parametrize("given", ["not a socket", "a TCP socket"])
def test_agent_refuses_a_listen_fd_that_is_not_a_listening_unix_socket(memd, tmp_path, given):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as tcp, open(tmp_path / "file", "w") as file:
        fd = file.fileno() if given == "not a socket" else tcp.fileno()
        result = subprocess.run([sys.executable, "-m", "dashrun.agent", "--memd", memd.address, "--token-file",
                                 str(memd.token_file), "--socket", str(tmp_path / "agent.sock"), "--listen-fd", str(fd),
                                 *memd.tls_args], pass_fds=(fd,), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"--listen-fd {fd}" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "agent.sock").exists()


def test_dashrun_usage_errors(tmp_path, token_file):
    base = [sys.executable, "-m", "dashrun", "--memd", "127.0.0.1:1", "--token-file"]
    bad_id = subprocess.run(base + [str(token_file), "--job-id", "../x", str(TRAIN)], capture_output=True,
                            text=True, timeout=60)
    assert bad_id.returncode == 2 and "not a valid job id" in bad_id.stderr
    no_token = subprocess.run(base + [str(tmp_path / "nope"), str(TRAIN)], capture_output=True, text=True,
                              timeout=60)
    assert no_token.returncode == 2 and "cannot read token file" in no_token.stderr
    assert "Traceback" not in bad_id.stderr + no_token.stderr



def test_dashrun_refuses_to_start_with_a_token_memd_does_not_accept(memd, tmp_path):
    from dashrun.util.tokens import write_token

    other = tmp_path / "other-token"
    write_token(other)
    result = subprocess.run([sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(other),
                             "--nproc-per-node", "1", str(TRAIN)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "refused this node's token" in result.stderr and "Traceback" not in result.stderr


def test_ranks_reach_the_launcher_s_agent_before_it_is_up_and_while_it_is_restarted(memd):
    """The launcher makes the agent's socket and starts the ranks at once: a rank that connects before the
    agent serves, or while a dead agent is restarted, waits in the socket's queue and is answered."""
    from dashrun.launch.launcher import AgentProcess
    from dashrun.launch.options import LaunchOptions
    from dashrun.wire.tls import TlsSettings

    host, port = memd.address.rsplit(":", 1)
    options = LaunchOptions(memd=(host, int(port)), token_file=memd.token_file, job_id="queued", cloud="none",
                            tls=TlsSettings(plaintext=bool(memd.tls_args)))
    with AgentProcess(options) as agent:
        first = AgentLink(str(agent.socket_path))  # connects now, as the agent is still starting
        try:
            assert first.call(Kind.PING, timeout=60).kind == Kind.OK
        finally:
            first.close()
        dead = agent.proc
        dead.kill()
        dead.wait(timeout=30)
        assert agent.proc is dead or agent.proc.poll() is None  # not yet restarted, or restarted: either waits
        meanwhile = AgentLink(str(agent.socket_path))
        try:
            assert meanwhile.call(Kind.PING, timeout=60).kind == Kind.OK
        finally:
            meanwhile.close()
        assert agent.restarts == 1 and agent.proc is not dead
        # An agent stopped cleanly by someone else (SIGTERM) leaves the socket to the one restarted after it.
        stopped = agent.proc
        stopped.terminate()
        assert stopped.wait(timeout=60) == 0
        after = AgentLink(str(agent.socket_path))
        try:
            assert after.call(Kind.PING, timeout=30).kind == Kind.OK
        finally:
            after.close()
        assert agent.restarts == 2
    assert not agent.socket_path.exists()
