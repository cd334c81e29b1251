"""``dashrun --hostfile FILE ...``: start dashrun on every host of a hostfile, over SSH.

The way DeepSpeed's and MPI's launchers do it: one SSH session per host runs
``dashrun`` there with the same command line, plus what makes the hosts one
job: ``--nnodes N --nproc-per-node <slots>`` and a c10d rendezvous whose
store the first host serves. Each host's output comes back line by line,
prefixed with its name. The first host that fails stops the others and its
exit code is the job's; Ctrl-C (SIGINT/SIGTERM) stops them all.

SSH is paramiko's, configured the way ``ssh`` is: the user's OpenSSH config
(:mod:`dashrun.launch.hostfile` reads it) and known hosts. A host whose key
is not already known is refused, never trusted on first use.

What the fan-out decides for every host (``--nnodes``, the rendezvous,
dashrun's ``--memd``, ``--job-id``, ...) is taken out of the user's command
line by a parser of those options alone, spelled as the full parser spells
them (:data:`dashrun.launch.options.NAMES`): what it does not recognise is
what each host gets as it was typed.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import queue
import shlex
import signal
import sys
import threading
import time
from typing import NoReturn

from dashrun import env
from dashrun.errors import DashError, ExitCode, UnavailableError, UsageError
from dashrun.launch.hostfile import Host, SshTarget, read_hostfile, ssh_targets
from dashrun.launch.options import (NAMES, check_values, job_id_from_args, nnodes_range, require_shared_memd,
                                    require_token_file)
from dashrun.util.signals import STOP_SIGNALS, next_stop_signal

__all__ = ["DECIDED", "HostsConfig", "Session", "config_from_args", "remote_command", "run"]

log = logging.getLogger(__name__)

#: Port of the c10d rendezvous on the first host when neither --rdzv-endpoint nor --master-port names one
#: (torch's own default for c10d).
DEFAULT_RDZV_PORT = 29400
#: Seconds a host gets to stop after Ctrl-C was sent to it, before its session is closed: a bit more than
#: torch's default --shutdown-timeout (30 s), so its ranks are stopped by its own launcher.
STOP_GRACE = 40.0
#: Seconds to wait for the readers of closed sessions to report.
CLOSE_WAIT = 10.0

#: Options the fan-out decides for every host (by dest); removed from the user's command line before it is sent.
#: ``--no-tls`` (or DASH_NO_TLS here) goes to every host as the option itself, and is logged: plaintext to
#: dash-memd from other machines is said on each host's command line, never carried along unseen in a variable.
DECIDED = frozenset({"hostfile", "ssh_config", "remote_python", "memd", "token_file", "job_id", "fresh",
                     "operator_key", "nnodes", "node_rank", "nproc_per_node", "rdzv_backend", "rdzv_endpoint",
                     "rdzv_id", "no_tls"})
#: Variables that travel to every host as they are set here (torchrun's PET_* twins travel too).
_FORWARDED = (env.CRASH_AT, env.TLS_CA, env.TLS_FINGERPRINT)


# --- the command each host runs ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostsConfig:
    """A launch on several hosts: who runs what. ``commands[i]`` is the shell command for ``hosts[i]``."""

    hosts: tuple[Host, ...]
    targets: tuple[SshTarget, ...]
    commands: tuple[str, ...]
    job_id: str
    rdzv_endpoint: str
    #: ``--nnodes MIN:MAX`` with a shared dash-memd: dash-memd serves the rendezvous, a host that leaves is a
    #: shrink (its dashrun exits 75, or is lost), not a failure that stops the others
    elastic: bool = False


class _DecidedOptions(argparse.ArgumentParser):
    """A parser of the options decided for every host; a line it cannot read is a usage error, not an exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"cannot take the options decided for every host out of the command line: {message}",
                         hint="give each option its value, and spell options in full")


def _without(options: list[str], parser: argparse.ArgumentParser, dests: frozenset[str]) -> list[str]:
    """``options`` (the launcher's part of a command line) with every option whose dest is in ``dests`` removed.

    argparse itself decides: a parser of those options alone, spelled as in
    ``parser`` and abbreviated as ``parser`` allows, returns everything else
    as it was typed. An abbreviation that ``parser`` accepted is unique there,
    so it names the same option here.
    """
    decided = _DecidedOptions(prog="dashrun", add_help=False, allow_abbrev=parser.allow_abbrev)
    for dest in sorted(dests):
        NAMES[dest].add_to(decided)
    return decided.parse_known_args(options)[1]


def _split_command_line(argv: list[str], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``argv`` as (launcher options, [script, *script args]); argparse's REMAINDER makes the script args the tail."""
    at = len(argv) - len(args.training_script_args) - 1
    if at < 0 or argv[at] != args.training_script:
        raise UsageError("cannot find the training script in the command line",
                         hint="put dashrun's and torchrun's options before the script")
    return argv[:at], argv[at:]


def _endpoint(args: argparse.Namespace, first: SshTarget) -> str:
    if args.rdzv_endpoint:
        return args.rdzv_endpoint
    host = f"[{first.hostname}]" if ":" in first.hostname else first.hostname
    return f"{host}:{args.master_port or DEFAULT_RDZV_PORT}"


def remote_command(*, cwd: str, python: str, environment: dict[str, str], argv: list[str]) -> str:
    """One shell command line: ``cd CWD && exec env K=V... PYTHON -m dashrun ARGV``, every word quoted.

    ``exec`` makes dashrun the session's leader, so it is what the terminal's
    Ctrl-C and hang-up reach.
    """
    assignments = [f"{k}={v}" for k, v in environment.items()]
    words = ["env", *assignments, python, "-m", "dashrun", *argv]
    return f"cd {shlex.quote(cwd)} && exec " + " ".join(shlex.quote(w) for w in words)


def config_from_args(argv: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser) -> HostsConfig:
    """Everything the hosts need, decided here once: the job id, the rendezvous, each host's command."""
    check_values(args)  # here, not on every host
    hosts = read_hostfile(args.hostfile)
    if args.standalone:
        raise UsageError("--standalone runs on one node; it cannot be combined with --hostfile",
                         hint="drop --standalone: the hostfile's first host hosts the rendezvous")
    if args.local_addr:
        raise UsageError("--local-addr names one node; with --hostfile each host's is its address in the ssh config",
                         hint="drop --local-addr (and PET_LOCAL_ADDR), or set HostName in the ssh config")
    if args.rdzv_backend not in ("static", "c10d"):
        raise UsageError(f"--hostfile starts a c10d rendezvous; --rdzv-backend {args.rdzv_backend} is not supported "
                         "with it", hint="drop --rdzv-backend")
    require_shared_memd(args, len(hosts), "hosts")
    require_token_file(args.memd, args.token_file, " (at the same path on every host)")
    job_id = job_id_from_args(args)

    targets = ssh_targets(hosts, args.ssh_config)
    elastic = _elastic(args)
    endpoint = f"{args.memd} (dash-memd)" if elastic else _endpoint(args, targets[0])
    typed, script = _split_command_line(argv, args)
    options = _without(typed, parser, DECIDED)
    rdzv_id = job_id if args.rdzv_id in (None, "", "none") else args.rdzv_id
    # The first host serves the rendezvous store at the endpoint chosen for it. Said outright: torch would
    # guess it from the endpoint's address, and hosts that share an address (or a NAT) would race for it.
    own_store = not args.rdzv_endpoint and not args.rdzv_conf
    # What differs between the hosts travels in the environment, so that the command line each dashrun stores
    # for 'dashrun resume' is the same on every host. Always set, whatever the remote login environment holds:
    # an empty DASH_HOSTFILE stops a host from fanning out again; DASH_FRESH is 1 on the first host only, whose
    # dashrun deletes the old checkpoints before it joins the rendezvous (so before any rank restores).
    base = {env.HOSTFILE.name: "", env.SSH_CONFIG.name: "", env.JOB_ID.name: job_id}
    if args.memd is not None:
        base[env.MEMD.name] = args.memd
        base[env.TOKEN_FILE.name] = os.path.abspath(args.token_file)
    for var in _FORWARDED:
        if env.get(var) is not None:
            base[var.name] = os.environ[var.name]
    base.update({k: v for k, v in os.environ.items() if k.startswith("PET_")})
    python = args.remote_python or sys.executable
    plaintext = ["--no-tls"] if args.no_tls else []
    if args.no_tls:
        log.warning("--no-tls%s: each host is given --no-tls, and its checkpoints cross to dash-memd unencrypted "
                    "(the token login and each record's MAC still hold): %s",
                    "" if {"--no-tls", "--no_tls"} & set(typed) else f" (from {env.NO_TLS.name})",
                    ", ".join(host.name for host in hosts))
    commands = []
    for index, (host, target) in enumerate(zip(hosts, targets)):
        # No --node-rank: the c10d rendezvous numbers the hosts itself (torch ignores it, with a warning).
        decided = (["--nnodes", args.nnodes, "--nproc-per-node", str(host.slots), "--rdzv-id", rdzv_id] if elastic
                   else ["--nnodes", str(len(hosts)), "--nproc-per-node", str(host.slots),
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id])
        # torchrun's env twins: the address the peers reach this host at is the one SSH reaches it at
        environment = {**base, "PET_LOCAL_ADDR": target.hostname,
                       env.FRESH.name: "1" if args.fresh and index == 0 else "0"}
        if own_store and not elastic:
            environment["PET_RDZV_CONF"] = f"is_host={int(index == 0)}"
        commands.append(remote_command(cwd=os.getcwd(), python=python, environment=environment,
                                       argv=[*options, *decided, *plaintext, *script]))
    return HostsConfig(hosts=hosts, targets=targets, commands=tuple(commands), job_id=job_id, rdzv_endpoint=endpoint,
                       elastic=elastic)


def _elastic(args: argparse.Namespace) -> bool:
    """``--nnodes MIN:MAX`` (MIN < MAX) with --memd and no --rdzv-endpoint: each host runs the same elastic
    command, the rendezvous in dash-memd (as a boot script on each Spot node would)."""
    low, high = nnodes_range(args.nnodes)
    return args.memd is not None and not args.rdzv_endpoint and low < high


# --- SSH sessions --------------------------------------------------------------------


def _fingerprint(key) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def _connect(target: SshTarget):
    """An authenticated paramiko client for ``target``; a host key not in known_hosts is refused."""
    import paramiko

    class RefuseUnknown(paramiko.RejectPolicy):
        def missing_host_key(self, client, hostname, key):
            raise UsageError(
                f"host key of {target.alias} ({hostname}) is not in known_hosts: {key.get_name()} "
                f"{_fingerprint(key)}",
                hint=f"check that fingerprint, then record the key with 'ssh -p {target.port} "
                     f"{target.user}@{target.hostname}' once (or add it to known_hosts)")

    client = paramiko.SSHClient()
    for path in target.known_hosts_files:
        if os.path.isfile(path):
            try:
                client.load_system_host_keys(path)  # "system" keys: trusted, never written back
            except (OSError, paramiko.SSHException) as e:
                log.warning("cannot read known hosts file %s: %s", path, e)
    client.set_missing_host_key_policy(RefuseUnknown())
    where = f"{target.alias} ({target.user}@{target.hostname}:{target.port})"
    try:
        client.connect(target.hostname, port=target.port, username=target.user,
                       key_filename=list(target.identity_files) or None,
                       look_for_keys=not target.identities_only, allow_agent=not target.identities_only,
                       timeout=target.connect_timeout, banner_timeout=target.connect_timeout,
                       auth_timeout=target.connect_timeout)
    except DashError:
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        raise UsageError(f"host key of {where} does NOT match known_hosts ({_fingerprint(e.key)}): the host was "
                         "reinstalled, or someone is in between", hint=f"if you trust the new key, remove the old "
                         f"one with 'ssh-keygen -R {e.hostname}'") from None
    except paramiko.AuthenticationException:
        client.close()
        raise UsageError(f"{where} refused every key offered", hint="check User and IdentityFile for this host in "
                         "the ssh config, or the keys in ssh-agent") from None
    except (OSError, paramiko.SSHException) as e:
        client.close()
        raise UnavailableError(f"cannot reach {where}: {e}", hint="check that the host is up and sshd listens "
                               "there, and HostName/Port in the ssh config") from None
    return client


class Session:
    """One host's remote dashrun: its SSH session, and a thread that streams its output, prefixed."""

    def __init__(self, index: int, host: Host, client, results: queue.Queue, out_lock: threading.Lock):
        self.index, self.host, self.client = index, host, client
        self._results, self._out_lock = results, out_lock
        self.channel = None
        self._reader = threading.Thread(target=self._pump, name=f"dashrun-host-{host.name}", daemon=True)

    def start(self, command: str) -> None:
        import paramiko

        try:
            transport = self.client.get_transport()
            transport.set_keepalive(15)  # quiet stretches of training must not let a firewall drop the session
            self.channel = transport.open_session()
            # A terminal on the far side: closing the session hangs it up, which stops the remote dashrun
            # (SIGHUP) even though it never reads its input; Ctrl-C typed into it stops it gracefully.
            self.channel.get_pty(term="dumb", width=200)
            self.channel.exec_command(command)
        except (OSError, paramiko.SSHException) as e:
            raise UnavailableError(f"cannot start dashrun on {self.host.name}: {e}",
                                   hint="check that the host's sshd allows sessions with a terminal") from None
        self._reader.start()

    def _pump(self) -> None:
        pending = b""
        try:
            while data := self.channel.recv(65536):
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    self._emit(line)
        except Exception as e:  # the transport died: report it as the host's end
            log.warning("%s: connection lost: %s", self.host.name, e)
        if pending:
            self._emit(pending)
        # -1 when the session ended without an exit status (the connection dropped, or a signal killed it)
        self._results.put((self.index, self.channel.recv_exit_status()))

    def _emit(self, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r")  # a terminal ends lines with \r\n
        with self._out_lock:
            try:
                sys.stdout.write(f"[{self.host.name}] {text}\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # our stdout is gone (a closed pipe): keep draining the host, or it blocks writing

    def interrupt(self) -> None:
        """Ctrl-C on the remote terminal: SIGINT to the remote dashrun, which stops its ranks and its agent."""
        try:
            self.channel.send(b"\x03")
        except Exception as e:  # already closed: nothing left to stop
            log.debug("%s: cannot send Ctrl-C: %s", self.host.name, e)

    def close(self) -> None:
        """Hang up: the remote terminal goes away and takes what still runs on it (SIGHUP)."""
        if self.channel is not None:
            self.channel.close()
        self.client.close()


def _connect_all(config: HostsConfig, results: queue.Queue, out_lock: threading.Lock) -> list[Session]:
    """Connect to every host before starting anything: a host that cannot be reached starts nothing."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(config.targets))) as pool:
        futures = [pool.submit(_connect, target) for target in config.targets]
        concurrent.futures.wait(futures)
    clients = [f.result() if f.exception() is None else None for f in futures]
    failed = next((f.exception() for f in futures if f.exception() is not None), None)
    if failed is not None:
        for client in clients:
            if client is not None:
                client.close()
        raise failed
    return [Session(i, host, client, results, out_lock)
            for i, (host, client) in enumerate(zip(config.hosts, clients))]


def _exit_code(code: int) -> int:
    return int(ExitCode.FAILED) if code < 0 else code


def _describe(code: int) -> str:
    return f"exit code {code}" if code >= 0 else "no exit status: killed by a signal, or the connection was lost"


def run(config: HostsConfig) -> int:
    """Start the job on every host, stream their output, stop them all on the first failure or on Ctrl-C.

    Returns 0 when every host's dashrun exited 0, else the exit code of the
    host that failed first (1 when stopped by a signal).
    """
    # Stop signals are taken by the loop below (never by a handler in the middle of an SSH thread's work);
    # blocked before any thread starts, so every thread inherits the mask.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # paramiko logs every connection and login at INFO: noise next to the hosts' output; failures are ours to tell
    logging.getLogger("paramiko").setLevel(logging.WARNING)
    results: queue.Queue = queue.Queue()
    sessions: list[Session] = []
    try:
        sessions = _connect_all(config, results, threading.Lock())
        if (signum := next_stop_signal(0)) is not None:
            log.error("stopped by signal %s before the hosts started", signal.Signals(signum).name)
            return int(ExitCode.FAILED)
        log.info("job %s on %d hosts (%s), %d ranks; rendezvous at %s", config.job_id, len(sessions),
                 ", ".join(f"{h.name}x{h.slots}" for h in config.hosts), sum(h.slots for h in config.hosts),
                 config.rdzv_endpoint)
        for session, command in zip(sessions, config.commands):
            log.debug("%s: %s", session.host.name, command)
            session.start(command)
        return _supervise(sessions, results, elastic=config.elastic)
    finally:
        for session in sessions:
            session.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _supervise(sessions: list[Session], results: queue.Queue, elastic: bool = False) -> int:
    codes: dict[int, int] = {}
    first_failure: int | None = None
    stopped_by: int | None = None
    stop_deadline: float | None = None
    closed = False

    def stop(why: str) -> float:
        running = [s for s in sessions if s.index not in codes]
        if running:
            log.warning("%s: stopping %s", why, ", ".join(s.host.name for s in running))
        for s in running:
            s.interrupt()
        return time.monotonic() + STOP_GRACE

    def close_running() -> float:
        for s in sessions:
            if s.index not in codes:
                s.close()
        return time.monotonic() + CLOSE_WAIT

    while len(codes) < len(sessions):
        signum = next_stop_signal(0.05)
        if signum is not None:
            if stop_deadline is None:
                stopped_by = signum
                stop_deadline = stop(f"{signal.Signals(signum).name} (again to close the sessions now)")
            elif not closed:
                closed, stop_deadline = True, close_running()
        while True:
            try:
                index, code = results.get_nowait()
            except queue.Empty:
                break
            codes[index] = code
            if elastic and code in (ExitCode.PREEMPTED, -1) and stopped_by is None:
                log.warning("%s left the job (%s): the others go on without it", sessions[index].host.name,
                            _describe(code))
                continue
            if code != 0 and first_failure is None and stopped_by is None:
                first_failure = index
                if stop_deadline is None:
                    stop_deadline = stop(f"{sessions[index].host.name} failed ({_describe(code)})")
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            if closed:
                log.error("no exit status from %s; giving up on them",
                          ", ".join(s.host.name for s in sessions if s.index not in codes))
                break
            closed, stop_deadline = True, close_running()

    if first_failure is not None:
        host, code = sessions[first_failure].host.name, codes[first_failure]
        # root cause first, as torchrun does
        log.error("host %s failed first (%s)", host, _describe(code))
        others = [s.host.name for s in sessions if s.index != first_failure and codes.get(s.index, -1) != 0]
        if others:
            log.error("stopped after it: %s", ", ".join(others))
        return _exit_code(code)
    if stopped_by is not None:
        log.error("stopped by signal %s", signal.Signals(stopped_by).name)
        return int(ExitCode.FAILED)
    if elastic and 0 not in codes.values():  # every host left: the job waits for a relaunch, as after a notice
        return int(ExitCode.PREEMPTED)
    return int(ExitCode.OK)
