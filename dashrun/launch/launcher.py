"""``dashrun [options] [torchrun flags] script.py [args]`` on one node: torchrun, plus a node agent.

The ranks run under torch's own elastic launcher (``elastic_launch``), after
the same pre-processing ``torch.distributed.run`` applies. Around it, dashrun
reaches dash-memd (or starts the private one), records the job's launch spec
there, starts this node's dash-agent in its own process (torch's agent
replaces signal handlers in its process) and stops it at the end, after it
has delivered what the ranks handed over. dash-agent (and the private
dash-memd) and the ranks are started on the CPUs their placement gives
them (:mod:`dashrun.launch.placement`): a process inherits the CPU affinity
of the thread that starts it. An elastic job (``--nnodes MIN:MAX`` with a
shared dash-memd) runs under dashrun's own agent instead
(:mod:`dashrun.launch.elastic`), its rendezvous in dash-memd.

A launcher that dies takes its node with it: each rank starts behind
:mod:`dashrun.launch.deathsig` (killed by the kernel when the launcher dies,
``kill -9`` included), and dash-agent and the private dash-memd watch their
parent (``--parent-pid``), finish what they hold and exit. SIGTERM and SIGINT
are a preemption notice (:class:`~dashrun.launch.preemption.StopSignals`);
the job's disk trouble in dash-memd is a line on the terminal
(:mod:`dashrun.launch.diskwatch`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from dashrun import env
from dashrun.env import PreemptionRecord
from dashrun.errors import AuthError, DashError, ExitCode, RestoreMismatchError, UnavailableError, UsageError
from dashrun.launch.diskwatch import DiskWatch
from dashrun.launch.options import LaunchOptions, apply_torchrun_defaults, options_from_args
from dashrun.launch.placement import Placement, plan
from dashrun.launch.preemption import PreemptionWatcher, StopSignals, report_preempted, torch_signals
from dashrun.launch.private_memd import PrivateMemd
from dashrun.util import daemon
from dashrun.util.cpus import thread_affinity
from dashrun.util.retry import Backoff, countdown, retry
from dashrun.util.scratch import Scratch
from dashrun.util.tokens import read_token
from dashrun.wire.credentials import Credential, write_job_credential
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo, JobSpec, MembershipEvent
from dashrun.wire.operator import load_private_key
from dashrun.wire.tls import format_fingerprint

__all__ = ["AgentProcess", "NodeConfig", "config_from_args", "prepare_job", "run"]

log = logging.getLogger(__name__)

#: Seconds the agent gets to deliver what it holds when stopped.
AGENT_STOP_TIMEOUT = 90.0
#: How often the launcher checks that its agent is alive, and how often it restarts a dead one.
AGENT_POLL_INTERVAL = 0.5
AGENT_MAX_RESTARTS = 10
#: The pause between tries to reach dash-memd at launch (for --memd-wait seconds in all).
MEMD_RETRY_PAUSE = 2.0
#: What each rank's command starts behind (run by path: see the module).
DEATHSIG = Path(__file__).with_name("deathsig.py")


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """A launch on this node: dashrun's options, torch's launch, the command line stored for resume, and
    where dash-agent and the ranks run."""

    options: LaunchOptions
    argv: tuple[str, ...]
    launch_config: Any  # torch.distributed.launcher.api.LaunchConfig
    entrypoint: Any  # the program (a path) or a function, as torch's config_from_args gives it
    entrypoint_args: tuple
    placement: Placement = Placement()
    #: dash-memd serves the rendezvous and the world may change under the job (dashrun.launch.elastic)
    elastic: bool = False


def config_from_args(argv: list[str], args: argparse.Namespace) -> NodeConfig:
    """dashrun's options checked, then torch's own pre-processing and ``config_from_args``."""
    options = options_from_args(args)  # first: a mistake there is one line, without importing torch

    from torch.distributed.run import config_from_args as torch_config_from_args

    from dashrun.launch.rendezvous import use_memd_rendezvous

    elastic = use_memd_rendezvous(args, options)
    apply_torchrun_defaults(args)
    launch_config, entrypoint, entrypoint_args = torch_config_from_args(args)
    placement = plan(options.agent_cpus, launch_config.nproc_per_node,
                     numa_binding=getattr(launch_config, "numa_options", None) is not None)
    return NodeConfig(options=options, argv=tuple(argv), launch_config=launch_config, entrypoint=entrypoint,
                      entrypoint_args=tuple(entrypoint_args), placement=placement, elastic=elastic)


class AgentProcess:
    """This node's dash-agent, supervised: restarted if it dies, stopped (after draining) at the end.

    It runs in its own session so that terminal signals reach only the
    launcher; ranks reconnect to a restarted agent at their next save.
    It runs on ``cpus`` (None: where the launcher runs), restarted too.

    Its socket is made here and handed to each agent started: the ranks
    start at once, as torchrun's would, while the agent is still starting
    (a rank that connects meanwhile waits in the socket's queue, and so
    does one that connects while a dead agent is being restarted).
    """

    def __init__(self, options: LaunchOptions, cpus: frozenset[int] | None = None, prefetch: bool = True):
        self.options = options
        self.cpus = cpus
        self.prefetch = prefetch
        self._dir = Scratch("dashrun-")  # a launcher killed outright leaves it to the next to remove
        self.socket_path = self._dir.path / "agent.sock"
        self._listener: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="dashrun-agent-supervisor", daemon=True)

    def command(self, listen_fd: int) -> list[str]:
        """The dash-agent command line, serving the ranks on the inherited descriptor ``listen_fd``."""
        options, (host, port) = self.options, self.options.memd
        extra = options.agent_args() + ([] if self.prefetch else ["--no-prefetch"])
        return [sys.executable, "-m", "dashrun.agent", "--memd", f"{host}:{port}", "--token-file",
                str(options.token_file), "--socket", str(self.socket_path), "--listen-fd", str(listen_fd),
                "--parent-pid", str(os.getpid()), "--job-id", options.job_id, "--cloud", options.cloud,
                *options.tls.args(), *extra]

    def _start(self) -> None:
        fd = self._listener.fileno()
        with thread_affinity(self.cpus):  # the agent and every thread it starts inherit this thread's CPUs
            self.proc = subprocess.Popen(self.command(fd), pass_fds=(fd,), start_new_session=True)

    def __enter__(self) -> AgentProcess:
        try:
            self._listener = daemon.private_listener(self.socket_path)
            self._start()
        except BaseException:
            self._cleanup()
            raise
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        while not self._stopping.wait(AGENT_POLL_INTERVAL):
            code = self.proc.poll()
            if code is None:
                continue
            if self.restarts >= AGENT_MAX_RESTARTS:
                log.error("dash-agent exited with code %s and was restarted %d times already; checkpoints of "
                          "this node stop here", code, self.restarts)
                self._close_socket()  # ranks waiting in its queue, and any that connect later, are refused now
                return
            self.restarts += 1
            log.warning("dash-agent exited with code %s; restarting it (%d/%d)", code, self.restarts,
                        AGENT_MAX_RESTARTS)
            try:
                self._start()
            except OSError as e:
                log.error("cannot restart dash-agent: %s", e)

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        if self.proc is not None:
            daemon.stop(self.proc, timeout=AGENT_STOP_TIMEOUT)  # SIGTERM: the agent delivers what it holds
        self._cleanup()

    def _close_socket(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        if self._listener is not None:
            self._listener.close()

    def _cleanup(self) -> None:
        self._close_socket()
        self._dir.remove()


def prepare_job(options: LaunchOptions, argv: list[str], rdzv_id: str | None = None) -> CheckpointInfo | None:
    """Before any rank starts: reach dash-memd with our token, apply --fresh, store the launch spec; returns the
    job's newest committed checkpoint then (None: the job starts from step 0).

    An unreachable dash-memd is waited for (--memd-wait: it may be restarting); a
    token it refuses is a configuration error. ``rdzv_id``: the job's
    rendezvous in dash-memd (an elastic job), where --fresh never wipes a job
    that other nodes are running — every node runs the same command, and a
    replacement that joins later must join it, not start it over. What only the
    operator may do (--fresh, the launch spec that ``dashrun resume`` runs)
    needs the cluster's token, and the spec the operator's key (--operator-key).
    """
    from dashrun.launch.rendezvous import running_elsewhere

    token = read_token(options.token_file)
    operator = Credential.parse(token).operator
    if options.fresh and not operator:
        raise UsageError(f"--fresh deletes every checkpoint of {options.job_id}: that needs the cluster's token, "
                         "and --token-file holds the job's credential only",
                         hint=f"run 'dashrun rm {options.job_id}' where the operator's token is, then launch without "
                              "--fresh")
    key = load_private_key(options.operator_key) if options.operator_key is not None and operator else None

    def attempt() -> CheckpointInfo | None:
        with MemdClient(*options.memd, token, timeout=30, tls=options.tls) as client:
            client.ping()
            if options.fresh and rdzv_id is not None and running_elsewhere(client, options.job_id, rdzv_id):
                log.warning("--fresh: job %s is running on other nodes; this node joins it instead of starting it "
                            "over", options.job_id)
            elif options.fresh:
                deleted = client.delete(options.job_id)
                log.info("--fresh: deleted %d earlier checkpoints of %s", len(deleted), options.job_id)
            if key is not None:  # resume runs only specs the operator signed
                spec = JobSpec(tuple(argv), os.getcwd(), socket.gethostname(), time.time())
                client.put_spec(options.job_id, spec.signed(options.job_id, key))
            return client.latest(options.job_id)

    if key is None:
        log.info("job %s: no launch spec stored (%s): dashrun resume cannot relaunch it", options.job_id,
                 "no --operator-key" if operator else "a job's credential cannot store one")
    try:
        deadline = time.monotonic() + options.memd_wait
        return retry(attempt, on=UnavailableError,
                     backoff=Backoff(first=MEMD_RETRY_PAUSE, longest=MEMD_RETRY_PAUSE, jitter=0),
                     deadline=deadline, on_retry=countdown(log.warning, deadline))
    except AuthError:
        raise UsageError(f"dash-memd at {options.memd[0]}:{options.memd[1]} refused this node's token",
                         hint="--token-file must hold the same token as dash-memd's (or a job credential made "
                              "from it)") from None
    except UnavailableError as e:
        raise UnavailableError(str(e), hint="start dash-memd first, or check --memd and the network") from None


@contextlib.contextmanager
def job_scoped(options: LaunchOptions):
    """``options`` with a token file that holds the job's credential only, for everything that runs from here
    on (the rendezvous, dash-agent, the ranks): a rank that code it runs took over reaches its own job and no
    other. Made from the cluster's token into a private file, removed at the end; a job's credential is kept."""
    credential = Credential.parse(read_token(options.token_file, warn=False))
    if not credential.operator:
        credential.for_job(options.job_id)  # UsageError: another job's
        yield options
        return
    folder = Scratch("dashrun-credential-")  # 0700; one a killed launcher left is removed by the next
    try:
        path = write_job_credential(credential.for_job(options.job_id), folder.path / "job-credential")
        yield dataclasses.replace(options, token_file=path)
    finally:
        folder.remove()


def fetch_ahead(nproc_per_node: int) -> bool:
    """Whether dash-agent fetches the job's newest checkpoint as it starts, ahead of the ranks.

    The only rank of a node without a GPU reads its state straight into its tensors when the node holds no
    image of it (see dashrun.rank.restore); a fetch ahead would write it into fresh memory while the rank
    starts, and on a small machine slow that start more than it saves (``scripts/bench_restore.py``).
    """
    if nproc_per_node != 1:
        return True
    import torch

    return torch.cuda.is_available()


def run(config: NodeConfig) -> int:
    """Run the ranks of this node under torch's elastic launcher; returns the exit code."""
    options, placement = config.options, config.placement
    _name_rendezvous_callers_cheaply()
    launch_config = copy.copy(config.launch_config)
    launch_config.signals_to_handle = torch_signals(launch_config.signals_to_handle)  # SIGTERM, SIGINT: ours
    entrypoint, entrypoint_args = _tied_to_launcher(config.entrypoint, config.entrypoint_args)
    private: PrivateMemd | None = None
    agent: AgentProcess | None = None
    stop = StopSignals(float(launch_config.shutdown_timeout),
                       ranks=lambda: _ranks(spare=(agent and agent.proc, private and private.proc)))
    stop.install()  # from here on a stop signal is news, not the end: a run set up meanwhile starts no rank
    try:
        with contextlib.ExitStack() as stack:
            if options.memd is None:
                with thread_affinity(placement.agent):  # it receives dash-agent's stream: off the ranks' cores too
                    private = stack.enter_context(PrivateMemd(attach=False, no_tls=options.tls.plaintext))
                options = dataclasses.replace(options, memd=private.address, token_file=private.token_file,
                                              operator_key=options.operator_key or private.operator_key)
                log.info("job %s: private dash-memd at %s:%d (data in %s)", options.job_id, *options.memd,
                         private.root)
            else:
                log.info("job %s: dash-memd at %s:%d", options.job_id, *options.memd)
            newest = prepare_job(options, list(config.argv), launch_config.run_id if config.elastic else None)
            _say_where_it_starts(options.job_id, newest)
            options = stack.enter_context(job_scoped(options))
            os.environ.update(options.data_cache_env())  # before dash-agent starts: it serves that cache too
            agent = stack.enter_context(AgentProcess(options, placement.agent,
                                                     prefetch=fetch_ahead(launch_config.nproc_per_node)))
            os.environ[env.AGENT_SOCKET.name] = str(agent.socket_path)
            os.environ[env.JOB_ID.name] = options.job_id
            os.environ[env.TERM_GRACE.name] = f"{stop.grace:g}"
            _pass_memd_to_ranks(options)
            stack.enter_context(DiskWatch(options))
            watcher = stack.enter_context(PreemptionWatcher(agent.socket_path.parent / PreemptionRecord.FILE, stop))
            if not config.elastic:  # an elastic job's agent records its nodes' joins (dashrun.launch.elastic)
                _record_launch(options, launch_config, "joined", "started", launch_config.min_nodes)
            code = _launch_ranks(config, launch_config, entrypoint, entrypoint_args, options, agent, watcher, stop)
            if code is None:  # preempted
                if not config.elastic:  # an elastic node that leaves records it itself
                    _record_launch(options, launch_config, "left", "interruption notice", 0)
                return report_preempted(options, watcher)
            _record_launch(options, launch_config, "finished" if code == ExitCode.OK else "failed",
                           "ranks exited 0" if code == ExitCode.OK else f"exit code {code}", launch_config.min_nodes)
            return code
    finally:
        stop.restore()


def _launch_ranks(config: NodeConfig, launch_config, entrypoint, entrypoint_args, options: LaunchOptions,
                  agent: AgentProcess, watcher: PreemptionWatcher, stop: StopSignals) -> int | None:
    """The ranks, run under torch's launcher (or dashrun's elastic agent) until they end; returns the exit code,
    or None when a notice or a stop signal ended them (preempted)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from dashrun.launch import elastic

    placement = config.placement
    try:
        if stop.signal is None:
            stop.launching = True
            # torch's agent starts (and restarts) the ranks from this thread: they inherit its CPUs.
            with thread_affinity(placement.ranks):
                if config.elastic:
                    elastic.launch(launch_config, entrypoint, entrypoint_args, options, str(agent.socket_path),
                                   preempted=lambda: watcher.record() is not None or stop.signal is not None)
                else:
                    elastic_launch(launch_config, entrypoint)(*entrypoint_args)
    except ChildFailedError as e:
        if watcher.record() is None and stop.signal is None:
            return _report_child_failure(e)
    except SignalException as e:
        if watcher.record() is None and stop.signal is None:
            print(f"dashrun: stopped by signal {e.sigval.name}", file=sys.stderr)
            return int(ExitCode.FAILED)
    finally:
        stop.launching = False
    if watcher.record() is not None or stop.signal is not None:
        return None
    return int(ExitCode.OK)


def _record_launch(options: LaunchOptions, launch_config, change: str, why: str, world: int) -> None:
    """Add this launch's start or end to the job's membership history in dash-memd (what ``dashrun status``
    reads its state from); a dash-memd that cannot be reached now costs the record alone, with a warning. The
    node is named as torch's rendezvous names it (--local-addr, else the host's name), as the elastic agent's
    events name it."""
    node = (launch_config.local_addr or socket.getfqdn())[:255] or "node"
    try:
        with MemdClient(*options.memd, read_token(options.token_file, warn=False), timeout=10,
                        tls=options.tls) as client:
            newest = client.latest(options.job_id)
            client.record_membership(options.job_id, MembershipEvent(
                time.time(), node, change, why, world, 0, newest.step if newest is not None else None, None))
    except DashError as e:
        log.warning("could not record in dash-memd that job %s %s: %s", options.job_id, change, e)


def _ranks(spare) -> set[int]:
    """The pids of this node's ranks: the launcher's children (torch starts them as such) but its daemons."""
    try:
        children = {child.pid for child in psutil.Process().children()}
    except psutil.Error:
        return set()
    return children - {proc.pid for proc in spare if proc}


def _tied_to_launcher(entrypoint: Any, args: tuple) -> tuple[Any, tuple]:
    """The ranks' command, started behind :mod:`dashrun.launch.deathsig` on Linux: a rank dies with its launcher.
    A function (torchrun's ``--run-path``) runs in a process torch's multiprocessing starts: left as it is."""
    if not isinstance(entrypoint, str) or not sys.platform.startswith("linux"):
        return entrypoint, args
    return sys.executable, ("-S", str(DEATHSIG), str(os.getpid()), entrypoint, *args)


def _say_where_it_starts(job_id: str, newest: CheckpointInfo | None) -> None:
    """One line before the ranks start: the checkpoint the job resumes from and its age, or that it has none.

    A derived job id is the script's path and arguments, not its contents: an edited script relaunched the same
    way resumes the earlier run, and this line says so before the first line of any rank.
    """
    line = (f"starting {job_id} from step 0 (no checkpoint of it yet)" if newest is None
            else f"resuming {job_id} from step {newest.step} (saved {_ago(newest.committed_at)})")
    if env.get(env.LOG_FORMAT) == "json":  # a log shipper's stream: one object a line, this one too
        log.info("%s", line)
    else:
        print(f"dashrun: {line}", file=sys.stderr)


def _ago(timestamp: float) -> str:
    """How long ago ``timestamp`` (epoch seconds, dash-memd's clock) was, as a person says it: ``17 min ago``."""
    seconds = max(0, int(time.time() - timestamp))  # another host's clock may run ahead of this one's
    for size, unit in ((86400, "day"), (3600, "h"), (60, "min")):
        if seconds >= size:
            count = seconds // size
            return f"{count} {unit}{'s' if unit == 'day' and count > 1 else ''} ago"
    return f"{seconds} s ago"


def _pass_memd_to_ranks(options: LaunchOptions) -> None:
    """dash-memd (the private one too), the token file and the TLS settings in the environment the ranks
    inherit, under the names their options read, so that code in a rank reaches dash-memd as dashrun does
    (``dashrun.dcp.Reader()`` with no arguments)."""
    host, port = options.memd
    os.environ[env.MEMD.name] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    os.environ[env.TOKEN_FILE.name] = os.path.abspath(options.token_file)
    fingerprint = options.tls.fingerprint
    for var, value in ((env.NO_TLS, "1" if options.tls.plaintext else None),
                       (env.TLS_CA, str(options.tls.ca) if options.tls.ca is not None else None),
                       (env.TLS_FINGERPRINT, format_fingerprint(fingerprint) if fingerprint is not None else None)):
        if value is None:
            os.environ.pop(var.name, None)
        else:
            os.environ[var.name] = value


def _name_rendezvous_callers_cheaply() -> None:
    """torch's dynamic rendezvous names the caller of each of its steps, for its event log, with
    ``inspect.stack()``, which reads the source file of every frame on the stack: about 0.1-0.2 s a call,
    1.5-1.7 s of every launch on a small machine (torchrun's too). The frame itself has the same name."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # frame 0 is this function's, as inspect.stack()[0] is
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = get_method_name


def _first_failure(err):
    """torch's first failure (the earliest timestamp, in whole seconds), except that a rank that died without a
    word (a signal, a hard exit: no error file, so its time is when the launcher saw it) within a second of a
    rank that raised is taken as first: a rank that vanishes makes its peers' collectives fail, not the other
    way round."""
    rank, failure = err.get_first_failure()
    if _said_why(failure):
        silent = sorted((f.timestamp, r) for r, f in err.failures.items()
                        if not _said_why(f) and f.timestamp <= failure.timestamp + 1)
        if silent:
            rank = silent[0][1]
            failure = err.failures[rank]
    return rank, failure


def _said_why(failure) -> bool:
    return os.path.isfile(failure.error_file)


def _reason(failure) -> str:
    """What a failed rank's error file says (``"ValueError: bad batch"``), or torch's placeholder without one."""
    reason = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    return (reason or "").strip()


def _report_child_failure(err) -> int:
    """Root cause first, as torchrun does: the first rank that failed and why; returns the exit code.

    A checkpoint that does not fit the script (the rank's :class:`RestoreMismatchError`, by its name in the
    error file) ends the run with the rank's one line, which names the job and what to pass instead, exit code 2:
    every rank fails alike, and nothing about the others adds to it.
    """
    rank, failure = _first_failure(err)
    mismatch = f"{RestoreMismatchError.__name__}: "
    if _said_why(failure) and _reason(failure).startswith(mismatch):
        print(f"dashrun: error: {_reason(failure).removeprefix(mismatch)}", file=sys.stderr)
        return int(RestoreMismatchError.exit_code)
    reason = _reason(failure).splitlines()
    # A rank that exited with a code but left no error file (sys.exit, a Python that could not start the
    # script) gets torch's pointer to its docs as the message: its own output says more.
    detail = reason[-1] if reason and (_said_why(failure) or failure.exitcode < 0) else "see its output above"
    print(f"dashrun: error: rank {rank} failed first (exit code {failure.exitcode}): {detail}", file=sys.stderr)
    others = sorted(r for r in err.failures if r != rank)
    if others:
        print(f"dashrun: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed after it",
              file=sys.stderr)
    return int(ExitCode.FAILED)
