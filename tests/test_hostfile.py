"""``dashrun --hostfile``: hostfile parsing, and launches on two "hosts" through real sshd processes.

The two hosts are two OpenSSH servers on loopback ports, each with its own
generated host key; a generated ssh config names them hostA and hostB, and a
generated known_hosts file vouches for their keys. The job is the real thing:
both hosts' dashrun meet in one c10d rendezvous and checkpoint to a real
dash-memd.
"""

from __future__ import annotations

import getpass
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, TRAIN, kill_tree, wait_for

from dashrun.errors import UnavailableError, UsageError
from dashrun.launch import fanout
from dashrun.launch import hostfile as hosts
from dashrun.launch.options import build_parser
from dashrun.testing import leaks
from dashrun.testing.processes import free_port
from dashrun.testing.sshd import Sshd, keygen, unavailable

needs_sshd = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


# --- the hostfile (fast) -----------------------------------------------------------


def test_a_hostfile_lists_hosts_and_slots():
    text = """
    # the cluster
    nodeA slots=8      # the first host hosts the rendezvous
    10.0.0.2 slots=2

    nodeC
    """
    assert hosts.parse_hostfile(text) == (hosts.Host("nodeA", 8), hosts.Host("10.0.0.2", 2), hosts.Host("nodeC", 1))


@pytest.mark.parametrize("text, message", [
    ("a slots=2\nb slots=0\n", "hostfile:2: slots=0 for host 'b' is not a whole number >= 1"),
    ("a slots=-1\n", "hostfile:1: slots=-1"),
    ("a slots=two\n", "hostfile:1: slots=two"),
    ("a slots=2\n# b\na slots=1\n", "hostfile:3: host 'a' is listed twice (first on line 1)"),
    ("a gpus=2\n", "hostfile:1: unknown field 'gpus=2'"),
    ("a slots\n", "hostfile:1: unknown field 'slots'"),
    ("slots=2\n", "hostfile:1: 'slots=2' is not a host name"),
    ("# nobody\n\n", "hostfile lists no hosts"),
])
def test_a_bad_hostfile_is_one_line_with_a_hint(text, message):
    with pytest.raises(UsageError) as caught:
        hosts.parse_hostfile(text)
    assert caught.value.message.startswith(message), caught.value.message
    assert "\n" not in caught.value.message and caught.value.hint


def test_a_missing_hostfile_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read hostfile"):
        hosts.read_hostfile(tmp_path / "nope")


def _config(tmp_path, monkeypatch, *argv: str, hostfile="hostA slots=2\nhostB slots=1\n"):
    monkeypatch.setenv("DASH_CRASH_AT", "rank.staging@step=3")  # fault injection travels to every host
    (tmp_path / "hostfile").write_text(hostfile)
    (tmp_path / "ssh_config").write_text("Host hostA\n  HostName 10.1.1.1\n  Port 2201\n  User alice\n"
                                         "Host hostB\n  HostName 10.1.1.2\n")
    monkeypatch.chdir(tmp_path)
    argv = ["--hostfile", "hostfile", "--ssh-config", "ssh_config", *argv]
    parser = build_parser()
    return fanout.config_from_args(argv, parser.parse_args(argv), parser)


def test_each_host_gets_its_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("DASH_MEMD", "ignored:1")  # the flag wins, as on one node
    config = _config(tmp_path, monkeypatch, "--memd", "stable:7070", "--token-file", "tok", "--fresh",
                     "--nproc-per-node", "4", "--max-restarts", "1", "train.py", "--lr", "3e-4", "--hostfile", "x")
    assert config.rdzv_endpoint == "10.1.1.1:29400"
    assert [t.hostname for t in config.targets] == ["10.1.1.1", "10.1.1.2"]
    assert (config.targets[0].port, config.targets[0].user, config.targets[1].port) == (2201, "alice", 22)
    words = [shlex.split(c) for c in config.commands]
    for rank, (command, slots) in enumerate(zip(words, (2, 1))):
        assert command[:5] == ["cd", str(tmp_path), "&&", "exec", "env"]
        assignments = dict(w.split("=", 1) for w in command[5:command.index(sys.executable)])
        assert assignments == {"DASH_HOSTFILE": "", "DASH_SSH_CONFIG": "", "DASH_JOB_ID": config.job_id,
                               "DASH_MEMD": "stable:7070", "DASH_TOKEN_FILE": str(tmp_path / "tok"),
                               "DASH_FRESH": "1" if rank == 0 else "0", "PET_MAX_RESTARTS": "2",
                               "DASH_CRASH_AT": "rank.staging@step=3",
                               "PET_LOCAL_ADDR": ("10.1.1.1", "10.1.1.2")[rank],
                               "PET_RDZV_CONF": f"is_host={int(rank == 0)}"}
        argv = command[command.index(sys.executable) + 1:]
        # the same on every host but for the slots: what each stores for 'dashrun resume'
        assert argv == ["-m", "dashrun", "--max-restarts", "1", "--nnodes", "2", "--nproc-per-node", str(slots),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.1.1:29400", "--rdzv-id", config.job_id,
                        "train.py", "--lr", "3e-4", "--hostfile", "x"]  # the script's own args stay
    assert config.job_id.startswith("train-")  # derived here once, the same for every host


def test_an_explicit_rendezvous_is_kept(tmp_path, monkeypatch):
    config = _config(tmp_path, monkeypatch, "--memd", "m:1", "--token-file", "t", "--master-port", "4444",
                     "--rdzv-conf", "join_timeout=60", "x.py")
    assert config.rdzv_endpoint == "10.1.1.1:4444"
    assert "--rdzv-conf join_timeout=60" in config.commands[1] and "is_host" not in config.commands[0]
    config = _config(tmp_path, monkeypatch, "--memd", "m:1", "--token-file", "t", "--rdzv-endpoint=h:5",
                     "--rdzv-id", "r1", "--job-id", "j", "x.py")
    assert config.rdzv_endpoint == "h:5" and "--rdzv-endpoint=h:5" not in config.commands[0]
    assert "--rdzv-id r1" in config.commands[1] and "DASH_JOB_ID=j" in config.commands[1]
    assert "is_host" not in config.commands[0]  # the store is where the user said: torch finds out who hosts it


def test_an_elastic_job_runs_the_same_command_on_every_host(tmp_path, monkeypatch):
    """--nnodes MIN:MAX with --memd: dash-memd serves the rendezvous; no host hosts a store or is named."""
    config = _config(tmp_path, monkeypatch, "--memd", "stable:7070", "--token-file", "tok", "--nnodes", "1:2",
                     "x.py")
    assert config.elastic and "stable:7070" in config.rdzv_endpoint
    argvs = [shlex.split(c) for c in config.commands]
    for argv, slots in zip(argvs, (2, 1)):
        launcher = argv[argv.index(sys.executable) + 1:]
        assert launcher == ["-m", "dashrun", "--nnodes", "1:2", "--nproc-per-node", str(slots), "--rdzv-id",
                            config.job_id, "x.py"]
        assert not any(w.startswith("PET_RDZV_CONF=") for w in argv)


def test_a_host_that_leaves_an_elastic_job_does_not_stop_the_others():
    class Session:  # what _supervise reads of an SSH session
        def __init__(self, index, name):
            self.index, self.host, self.interrupted = index, hosts.Host(name, 1), False

        def interrupt(self):
            self.interrupted = True

        def close(self):
            pass

    sessions = [Session(0, "a"), Session(1, "b"), Session(2, "c")]
    results = queue.Queue()
    for index, code in ((2, 75), (1, -1), (0, 0)):  # c noticed, b lost, a finished the job
        results.put((index, code))
    assert fanout._supervise(sessions, results, elastic=True) == 0
    assert not any(s.interrupted for s in sessions)
    for index, code in ((0, 75), (1, 75), (2, 75)):
        results.put((index, code))
    assert fanout._supervise(sessions, results, elastic=True) == 75
    results.put((0, 75))
    results.put((1, -1))
    assert fanout._supervise(sessions[:2], results, elastic=False) == 75  # not elastic: the first exit stops all
    assert sessions[1].interrupted


@pytest.mark.parametrize("argv, message", [
    (["x.py"], "a job on several hosts needs a dash-memd"),
    (["--memd", "m:1", "x.py"], "--memd needs --token-file"),
    (["--memd", "m:1", "--token-file", "t", "--standalone", "x.py"], "--standalone runs on one node"),
    (["--memd", "m:1", "--token-file", "t", "--job-id", "../x", "x.py"], "--job-id '../x' is not a valid job id"),
    (["--memd", "m:1", "--token-file", "t", "--local-addr", "a", "x.py"], "--local-addr names one node"),
])
def test_a_launch_on_several_hosts_is_checked_before_connecting(tmp_path, monkeypatch, argv, message):
    with pytest.raises(UsageError) as caught:
        _config(tmp_path, monkeypatch, *argv)
    assert caught.value.message.startswith(message) and caught.value.hint


def test_the_options_have_env_twins(monkeypatch):
    monkeypatch.setenv("DASH_HOSTFILE", "/h")
    monkeypatch.setenv("DASH_SSH_CONFIG", "/c")
    args = build_parser().parse_args(["x.py"])
    assert (args.hostfile, args.ssh_config) == ("/h", "/c")


def test_the_ssh_config_is_read_as_ssh_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "config"
    config.write_text("Host a\n  HostName 10.0.0.9\n  IdentityFile ~/k\n  UserKnownHostsFile ~/kh /x/kh2\n"
                      "Host b\n  ProxyJump bastion\n")
    (a,) = hosts.ssh_targets((hosts.Host("a"),), str(config))
    assert (a.hostname, a.port, a.identity_files) == ("10.0.0.9", 22, (str(tmp_path / "k"),))
    assert a.known_hosts_files == ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2", str(tmp_path / "kh"),
                                   "/x/kh2")  # UserKnownHostsFile replaces ~/.ssh/known_hosts, as in ssh
    (other,) = hosts.ssh_targets((hosts.Host("c"),), None)  # no ~/.ssh/config: the name is the address
    assert (other.hostname, other.known_hosts_files[2]) == ("c", str(tmp_path / ".ssh" / "known_hosts"))
    with pytest.raises(UsageError, match="through proxyjump, which dashrun does not support"):
        hosts.ssh_targets((hosts.Host("b"),), str(config))
    with pytest.raises(UsageError, match="cannot read ssh config"):
        hosts.ssh_targets((hosts.Host("a"),), str(tmp_path / "missing"))


def test_stripping_understands_argparse_spellings():
    parser = build_parser()
    head = ["--memd=a:1", "--log-dir=--memd", "--hostf", "f", "--no-python", "-r", "3", "--nnodes", "4"]
    assert fanout._without(head, parser, frozenset({"memd", "hostfile", "nnodes"})) == [
        "--log-dir=--memd", "--no-python", "-r", "3"]


# --- two hosts through two real sshd ------------------------------------------------


@pytest.fixture
def cluster(tmp_path):
    """``make(env_b=...)``: hostA and hostB, two sshd on loopback, and the ssh config and known_hosts for them."""
    started: list[Sshd] = []

    def make(env_b: dict | None = None, known: tuple[str, ...] = ("hostA", "hostB")) -> Path:
        root = tmp_path / "ssh"
        root.mkdir()
        authorized = root / "authorized_keys"
        authorized.write_text(keygen(root / "client_key") + "\n")
        for name, env in (("hostA", None), ("hostB", env_b)):
            started.append(Sshd(name, root / name, authorized, env=env))
        known_hosts = root / "known_hosts"
        known_hosts.write_text("".join(f"[127.0.0.1]:{s.port} {s.host_key}\n" for s in started if s.name in known))
        config = root / "config"
        config.write_text("".join(
            f"Host {s.name}\n  HostName 127.0.0.1\n  Port {s.port}\n  User {getpass.getuser()}\n"
            f"  IdentityFile {root / 'client_key'}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n"
            f"  GlobalKnownHostsFile none\n" for s in started))
        return config

    make.hosts = started  # the Sshd of each host, for a test that takes one away
    yield make
    for sshd in started:
        sshd.stop()


def fan_out(ssh_config: Path, command_a: str, command_b: str) -> fanout.HostsConfig:
    """A fan-out to hostA and hostB of plain shell commands: the SSH side alone, without torch."""
    both = (hosts.Host("hostA"), hosts.Host("hostB"))
    return fanout.HostsConfig(hosts=both, targets=hosts.ssh_targets(both, str(ssh_config)),
                              commands=(command_a, command_b), job_id="shell", rdzv_endpoint="-")


@needs_sshd
def test_every_line_comes_back_prefixed_with_its_host(cluster, capsys):
    config = fan_out(cluster(), "printf 'one\\ntwo\\n'; printf 'no newline'", "echo three >&2")
    assert fanout.run(config) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[hostA] no newline", "[hostA] one", "[hostA] two", "[hostB] three"]
    assert lines.index("[hostA] one") < lines.index("[hostA] two")


@needs_sshd
def test_a_host_that_ignores_ctrl_c_is_hung_up_on(cluster, monkeypatch, caplog):
    monkeypatch.setattr(fanout, "STOP_GRACE", 1.0)
    deaf = "trap '' INT; sleep 3131"
    config = fan_out(cluster(), deaf, "sleep 1; exit 5")
    started = time.monotonic()
    assert fanout.run(config) == 5
    assert time.monotonic() - started < 20
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors[0] == "host hostB failed first (exit code 5)"
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "3131"]],
             15, "the remote sleep to end with its session")


def test_an_unreachable_host_starts_nothing(tmp_path):
    config = tmp_path / "config"
    config.write_text(f"Host gone\n  HostName 127.0.0.1\n  Port {free_port()}\n  ConnectTimeout 5\n")
    (target,) = hosts.ssh_targets((hosts.Host("gone"),), str(config))
    with pytest.raises(UnavailableError, match=r"cannot reach gone \(.*@127\.0\.0\.1:[0-9]+\)") as caught:
        fanout._connect(target)
    assert caught.value.hint


def launch(memd, ssh_config: Path, hostfile: Path, *args: str, job: str, env: dict | None = None,
           ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dashrun", "--hostfile", str(hostfile), "--ssh-config", str(ssh_config),
         "--memd", memd.address, "--token-file", str(memd.token_file), "--job-id", job,
         # The rendezvous on the first host, as by default, on a free port: it hosts the store, so the test's
         # hosts (one machine, one address) do not race for it.
         "--master-port", str(free_port()), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def finish(proc: subprocess.Popen, timeout: float = 90) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"dashrun did not finish within {timeout:.0f}s:\n{out[-3000:]}\n{err[-3000:]}")


def assert_no_leftovers(watch: leaks.Watch, memd, cluster, timeout: float = 90) -> None:
    """Every process of the job is gone within ``timeout``, only dash-memd and the sshd servers left (the leak
    check names the command line of any that lingers, and kills it).

    A host that did not stop within the fan-out's grace is hung up on, and only then begins its own graceful
    stop (torch's 30 s shutdown timeout): the deadline covers that whole chain on a loaded machine.
    """
    leaks.check(watch, timeout, keep=[memd.proc.pid, *(sshd.proc.pid for sshd in cluster.hosts)])


def write_hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


@needs_sshd
@pytest.mark.slow
def test_a_job_runs_on_both_hosts(cluster, memd, tmp_path, no_leaked_processes):
    ssh_config = cluster()
    out = tmp_path / "out"
    proc = launch(memd, ssh_config, write_hostfile(tmp_path, "hostA slots=2\nhostB slots=1\n"),
                  str(TRAIN), "--steps", "12", "--interval", "5", "--out", str(out), job="two-hosts")
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert "on 2 hosts (hostAx2, hostBx1), 3 ranks" in stderr
    lines = stdout.splitlines()
    for host in ("hostA", "hostB"):
        assert any(line.startswith(f"[{host}] ") and "job two-hosts" in line for line in lines), stdout[-3000:]
    assert all(line.startswith(("[hostA] ", "[hostB] ")) for line in lines)
    for rank in range(3):  # WORLD_SIZE is the hostfile's total slots: every host's ranks trained
        steps = (out / f"rank{rank}.log").read_text().splitlines()
        assert steps[0] == "start 0" and steps[-1].startswith("11 "), steps
    assert not (out / "rank3.log").exists()
    with memd.client() as client:
        newest = client.latest("two-hosts")
    assert (newest.step, newest.world) == (9, 3)
    assert_no_leftovers(no_leaked_processes, memd, cluster)


@needs_sshd
@pytest.mark.slow
def test_the_first_host_that_fails_stops_the_others(cluster, memd, tmp_path, no_leaked_processes):
    # hostB's ranks exit 3 as they start (hostB's sshd gives its sessions a sitecustomize that does it), so
    # hostA's ranks wait in the process group's rendezvous until dashrun stops them.
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "sitecustomize.py").write_text("import os\nif 'LOCAL_RANK' in os.environ:\n    os._exit(3)\n")
    ssh_config = cluster(env_b={"PYTHONPATH": str(failing)})
    out = tmp_path / "out"
    proc = launch(memd, ssh_config, write_hostfile(tmp_path, "hostA slots=1\nhostB slots=1\n"),
                  "--shutdown-timeout", "5", str(TRAIN), "--steps", "12", "--out", str(out), job="one-fails")
    stdout, stderr = finish(proc)
    assert proc.returncode == 1, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    errors = [line for line in stderr.splitlines() if " ERROR " in line or " WARNING " in line]
    assert errors and "hostB failed (exit code 1): stopping hostA" in errors[0], stderr[-3000:]
    assert "host hostB failed first (exit code 1)" in stderr
    assert any(line.startswith("[hostB] dashrun: error: rank ") and "failed first (exit code 3)" in line
               for line in stdout.splitlines()), stdout[-3000:]
    assert_no_leftovers(no_leaked_processes, memd, cluster)


@needs_sshd
@pytest.mark.slow
def test_a_host_lost_from_an_elastic_job_is_a_shrink(cluster, memd, tmp_path, no_leaked_processes):
    """--nnodes 1:2 over SSH: hostB's sshd is SIGKILLed with everything its session runs, as a host taken away
    is; hostA goes on alone from the newest checkpoint and the job ends well."""
    from test_elastic import ELASTIC_TRAIN, assert_each_sample_once, assert_redone_at_most, newest_step, worlds

    ssh_config = cluster()
    out, steps, interval = tmp_path / "out", 40, 4
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashrun", "--hostfile", str(write_hostfile(tmp_path, "hostA\nhostB\n")),
         "--ssh-config", str(ssh_config), "--memd", memd.address, "--token-file", str(memd.token_file),
         "--job-id", "lose-a-host", "--nnodes", "1:2", "--monitor-interval", "0.1", str(ELASTIC_TRAIN),
         "--out", str(out), "--steps", str(steps), "--interval", str(interval), "--delay", "0.2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: newest_step(out) >= 9 or proc.poll() is not None, 120, "both hosts to train")
        assert proc.poll() is None and worlds(out) == [2], proc.communicate()
        lost_after = newest_step(out)
        kill_tree(cluster.hosts[1].proc)  # hostB, and every process of its session
        stdout, stderr = finish(proc, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert worlds(out) == [2, 1]
    assert_redone_at_most(out, steps, interval, lost_after)
    assert_each_sample_once(out)
    assert any("world 2 -> 1: " in line and " lost" in line for line in (stdout + stderr).splitlines()), stdout[-3000:]
    assert_no_leftovers(no_leaked_processes, memd, cluster)


@needs_sshd
@pytest.mark.slow
def test_ctrl_c_stops_every_host(cluster, memd, tmp_path, no_leaked_processes):
    ssh_config = cluster()
    out = tmp_path / "out"
    proc = launch(memd, ssh_config, write_hostfile(tmp_path, "hostA\nhostB\n"),
                  str(TRAIN), "--steps", "1000", "--delay", "0.05", "--out", str(out), job="interrupted")
    try:
        def training(rank: int) -> bool:  # its log has "start 0" and a step or two
            log = out / f"rank{rank}.log"
            return log.exists() and len(log.read_text().splitlines()) > 2

        wait_for(lambda: (training(0) and training(1)) or proc.poll() is not None, 90, "both hosts to train")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = finish(proc, 60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 1, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert "stopped by signal SIGINT" in stderr
    assert_no_leftovers(no_leaked_processes, memd, cluster)


@needs_sshd
@pytest.mark.slow
def test_an_unknown_host_key_is_refused(cluster, memd, tmp_path):
    ssh_config = cluster(known=("hostA",))
    proc = launch(memd, ssh_config, write_hostfile(tmp_path, "hostA\nhostB\n"), str(TRAIN), "--out",
                  str(tmp_path / "out"), job="unknown-key")
    stdout, stderr = finish(proc, 60)
    assert proc.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert lines[-2].startswith("dashrun: error: host key of hostB (") and "not in known_hosts" in lines[-2], stderr
    assert "SHA256:" in lines[-2] and lines[-1].startswith("dashrun: hint: ")
    assert stdout == "" and not (tmp_path / "out").exists()  # nothing started, not even on hostA
