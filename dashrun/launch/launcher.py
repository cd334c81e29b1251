"""``dashrun [options] [torchrun flags] script.py [args]``: torchrun, plus a node agent.

The command line is torch's own ``torchrun`` parser with dashrun's options
added to it, so every torchrun flag keeps its meaning, spellings and
``PET_*`` twin. The ranks run under torch's own elastic launcher
(``elastic_launch``), after the same pre-processing ``torch.distributed.run``
applies. Around it, dashrun starts this node's dash-agent in its own process
(torch's agent replaces signal handlers in its process) and stops it at the
end, after it has delivered what the ranks handed over.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from dashrun import env
from dashrun.env import DEFAULT_PORT, PreemptionRecord
from dashrun.errors import AuthError, DashError, ExitCode, UnavailableError, UsageError
from dashrun.launch.private_memd import PrivateMemd
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address
from dashrun.wire.messages import JobSpec

log = logging.getLogger(__name__)

#: Seconds the agent gets to start serving its Unix socket.
AGENT_START_TIMEOUT = 30.0
#: How often the launcher checks that its agent is alive, and how often it restarts a dead one.
AGENT_POLL_INTERVAL = 0.5
AGENT_MAX_RESTARTS = 10
#: Seconds to wait for an unreachable dash-memd before giving up at launch.
MEMD_WAIT = 30.0
PREEMPTION_POLL = 0.2
#: Ranks still running this long before a notice's deadline are stopped.
STOP_MARGIN = 5.0


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """dashrun's own options; the torchrun ones stay in torch's namespace."""

    memd: tuple[str, int] | None  # None: a private dash-memd on loopback
    token_file: Path | None
    job_id: str
    fresh: bool = False
    cloud: str = "auto"
    metadata_endpoint: str | None = None
    poll_interval: float | None = None


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, with dashrun's options added (same habits: both spellings, env twins)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "dashrun"
    parser.description = ("Launch a PyTorch training script like torchrun, with its state checkpointed to "
                          "dash-memd and resumed after preemption.")
    parser.epilog = ("commands: dashrun {resume,status,ls,export,gc,rm} --help. "
                     "Exit codes: 0 done, 1 training failed, 2 usage error, 75 preempted (relaunch to resume).")
    group = parser.add_argument_group("dashrun")
    group.add_argument("--memd", default=env.get(env.MEMD), metavar="HOST:PORT",
                       help=f"dash-memd to checkpoint to (env {env.MEMD.name}; default: a private one on "
                            "loopback, with its data under ~/.cache/dashrun).")
    group.add_argument("--token-file", "--token_file", default=env.get(env.TOKEN_FILE), metavar="FILE",
                       help=f"file with the cluster's token, needed with --memd (env {env.TOKEN_FILE.name}).")
    group.add_argument("--job-id", "--job_id", default=env.get(env.JOB_ID), metavar="ID",
                       help=f"the job's stable id: relaunching with the same id resumes (env {env.JOB_ID.name}; "
                            "default: derived from the script's absolute path and its arguments).")
    group.add_argument("--fresh", action="store_true", default=env.get(env.FRESH, "0") == "1",
                       help=f"delete the job's earlier checkpoints and start from step 0 (env {env.FRESH.name}=1).")
    group.add_argument("--cloud", default=env.get(env.CLOUD, "auto"), choices=("auto", "aws", "gcp", "azure", "none"),
                       help=f"where Spot interruption notices come from (env {env.CLOUD.name}; default auto: detect "
                            "quickly, none when no metadata service answers).")
    group.add_argument("--metadata-endpoint", "--metadata_endpoint", default=env.get(env.METADATA_ENDPOINT),
                       metavar="URL", help=f"base URL of the cloud's metadata service (env "
                                           f"{env.METADATA_ENDPOINT.name}; AWS_EC2_METADATA_SERVICE_ENDPOINT and "
                                           "GCE_METADATA_HOST work too).")
    group.add_argument("--poll-interval", "--poll_interval", type=float, default=env.get(env.POLL_INTERVAL),
                       metavar="SECONDS", help=f"seconds between metadata polls (env {env.POLL_INTERVAL.name}; "
                                               "default: each cloud's).")
    group.add_argument("--hostfile", default=env.get(env.HOSTFILE), metavar="FILE",
                       help=f"start dashrun on every host of FILE ('HOST slots=N' per line) over SSH, with "
                            f"--nnodes, --nproc-per-node and a c10d rendezvous on the first host decided for each "
                            f"(env {env.HOSTFILE.name}).")
    group.add_argument("--ssh-config", "--ssh_config", default=env.get(env.SSH_CONFIG), metavar="FILE",
                       help=f"OpenSSH client config for --hostfile: HostName, Port, User, IdentityFile, "
                            f"UserKnownHostsFile (env {env.SSH_CONFIG.name}; default ~/.ssh/config).")
    group.add_argument("--remote-python", "--remote_python", default=env.get(env.REMOTE_PYTHON), metavar="PATH",
                       help=f"Python that runs dashrun on the hosts of --hostfile (env {env.REMOTE_PYTHON.name}; "
                            "default: this one's path).")
    return parser


def derive_job_id(script: str, script_args: list[str]) -> str:
    """A job id stable across relaunches of the same command: ``<script stem>-<hash of path and args>``."""
    identity = "\0".join([os.path.abspath(script), *script_args])
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).lstrip("._-")[:64] or "job"
    return f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    from torch.distributed.run import parse_min_max_nnodes

    from dashrun.wire.protocol import valid_job_id

    job_id = args.job_id or derive_job_id(args.training_script, args.training_script_args)
    if not valid_job_id(job_id):
        raise UsageError(f"--job-id {job_id!r} is not a valid job id",
                         hint="use 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit")
    if args.memd is None:
        if parse_min_max_nnodes(args.nnodes)[1] > 1:
            raise UsageError("a job on several nodes needs a dash-memd they all reach",
                             hint="start one with 'dash-memd start' on a stable VM and pass --memd HOST:PORT")
        return LaunchOptions(memd=None, token_file=None, job_id=job_id, fresh=args.fresh, cloud=args.cloud,
                             metadata_endpoint=args.metadata_endpoint, poll_interval=args.poll_interval)
    if args.token_file is None:
        raise UsageError("--memd needs --token-file", hint="the file with the token dash-memd was started with")
    token_file = Path(args.token_file)
    read_token(token_file)  # fail now, in one line, not later in the agent
    return LaunchOptions(memd=parse_address(args.memd, default_port=DEFAULT_PORT, what="--memd"),
                         token_file=token_file, job_id=job_id, fresh=args.fresh, cloud=args.cloud,
                         metadata_endpoint=args.metadata_endpoint, poll_interval=args.poll_interval)


def apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """The pre-processing ``torch.distributed.run.run()`` applies before ``config_from_args``."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


class AgentProcess:
    """This node's dash-agent, supervised: restarted if it dies, stopped (after draining) at the end.

    It runs in its own session so that terminal signals reach only the
    launcher; ranks reconnect to a restarted agent at their next save.
    """

    def __init__(self, options: LaunchOptions):
        self.options = options
        self._dir = Path(tempfile.mkdtemp(prefix="dashrun-"))
        self.socket_path = self._dir / "agent.sock"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="dashrun-agent-supervisor", daemon=True)

    def _start(self) -> None:
        options = self.options
        host, port = options.memd
        extra = (["--metadata-endpoint", options.metadata_endpoint] if options.metadata_endpoint else []) + (
            ["--poll-interval", str(options.poll_interval)] if options.poll_interval else [])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dashrun.agent", "--memd", f"{host}:{port}", "--token-file", str(options.token_file),
             "--socket", str(self.socket_path), "--parent-pid", str(os.getpid()), "--job-id", options.job_id,
             "--cloud", options.cloud, *extra],
            start_new_session=True)
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        while not self._accepting():
            if self.proc.poll() is not None:
                raise UnavailableError(f"dash-agent exited with code {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise UnavailableError(f"dash-agent did not start serving within {AGENT_START_TIMEOUT:.0f}s")
            time.sleep(0.05)

    def __enter__(self) -> AgentProcess:
        try:
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
                return
            self.restarts += 1
            log.warning("dash-agent exited with code %s; restarting it (%d/%d)", code, self.restarts,
                        AGENT_MAX_RESTARTS)
            try:
                self._start()
            except UnavailableError as e:
                log.error("cannot restart dash-agent: %s", e)

    def _accepting(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.socket_path))
                return True
            except OSError:
                return False

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the agent delivers what it holds, then exits
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def prepare_job(options: LaunchOptions, argv: list[str]) -> None:
    """Before any rank starts: reach dash-memd with our token, apply --fresh, store the launch spec.

    An unreachable dash-memd is waited for a little (it may be restarting); a
    token it refuses is a configuration error.
    """
    from dashrun.wire.memd_client import MemdClient

    deadline = time.monotonic() + MEMD_WAIT
    token = read_token(options.token_file)
    while True:
        try:
            with MemdClient(*options.memd, token, timeout=30) as client:
                client.ping()
                if options.fresh:
                    deleted = client.delete(options.job_id)
                    log.info("--fresh: deleted %d earlier checkpoints of %s", len(deleted), options.job_id)
                client.put_spec(options.job_id, JobSpec(tuple(argv), os.getcwd(), socket.gethostname(),
                                                        time.time()))
            return
        except AuthError:
            raise UsageError(f"dash-memd at {options.memd[0]}:{options.memd[1]} refused this node's token",
                             hint="--token-file must hold the same token as dash-memd's") from None
        except UnavailableError as e:
            if time.monotonic() > deadline:
                raise UnavailableError(str(e), hint="start dash-memd first, or check --memd and the network")
            log.warning("%s; retrying", e)
            time.sleep(2.0)


def launch(argv: list[str], overrides: dict | None = None) -> int:
    """Run the command line ``argv`` (torchrun flags, dashrun options, script, args); returns the exit code.

    ``overrides`` replace parsed options (``dashrun resume`` points a stored
    command line at this node's dash-memd).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (overrides or {}).items():
        setattr(args, name, value)
    if args.hostfile:
        from dashrun.launch import fanout as hosts

        return hosts.run(hosts.config_from_args(argv, args, parser))
    options = options_from_args(args)
    apply_torchrun_defaults(args)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    config, cmd, cmd_args = config_from_args(args)
    with contextlib.ExitStack() as stack:
        if options.memd is None:
            private = stack.enter_context(PrivateMemd(attach=False))
            options = dataclasses.replace(options, memd=private.address, token_file=private.token_file)
            log.info("job %s: private dash-memd at %s:%d (data in %s)", options.job_id, *options.memd, private.root)
        else:
            log.info("job %s: dash-memd at %s:%d", options.job_id, *options.memd)
        prepare_job(options, argv)
        agent = stack.enter_context(AgentProcess(options))
        os.environ[env.AGENT_SOCKET.name] = str(agent.socket_path)
        os.environ[env.JOB_ID.name] = options.job_id
        watcher = stack.enter_context(PreemptionWatcher(agent.socket_path.parent / PreemptionRecord.FILE))
        try:
            elastic_launch(config, cmd)(*cmd_args)
        except ChildFailedError as e:
            if watcher.record() is None:
                _report_child_failure(e)
                return int(ExitCode.FAILED)
        except SignalException as e:
            if watcher.record() is None:
                print(f"dashrun: stopped by signal {e.sigval.name}", file=sys.stderr)
                return int(ExitCode.FAILED)
        if watcher.record() is not None:
            return _preempted(options, watcher)
    return int(ExitCode.OK)


class PreemptionWatcher:
    """Watches for the agent's record that this node must stop; stops ranks that run past the deadline.

    The ranks stop by themselves after their emergency checkpoint. Ranks that
    never call save() again (a long evaluation, a hang) are stopped shortly
    before the notice's deadline — through torch's own shutdown, which sends
    them SIGTERM and SIGKILL after ``--shutdown-timeout`` — so that the node
    goes away with its processes ended, not cut off.
    """

    def __init__(self, path: Path):
        self.path = path
        self.stopped_ranks = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dashrun-preemption", daemon=True)

    def __enter__(self) -> PreemptionWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def record(self) -> PreemptionRecord | None:
        try:
            return PreemptionRecord.from_json(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _watch(self) -> None:
        while not self._done.wait(PREEMPTION_POLL):
            record = self.record()
            deadline = record.deadline if record is not None else None
            if deadline is not None and time.time() >= deadline - STOP_MARGIN:
                log.error("the ranks have not finished their emergency checkpoint and the notice's deadline is "
                          "%.0fs away: stopping them now", deadline - time.time())
                self.stopped_ranks = True
                os.kill(os.getpid(), signal.SIGTERM)  # torch's elastic agent stops the workers
                return


def _preempted(options: LaunchOptions, watcher: PreemptionWatcher) -> int:
    """Exit 75, saying why and where the job stands."""
    from dashrun.wire.memd_client import MemdClient

    record = watcher.record()
    why = (f"{record.cloud} {record.kind} notice" if record is not None and record.reason == record.NOTICE else
           "an interruption notice on another node of the job")
    try:
        with MemdClient(*options.memd, read_token(options.token_file), timeout=10) as client:
            newest = client.latest(options.job_id)
        where = f"step {newest.step} is safe in dash-memd" if newest else "no checkpoint of this job is committed yet"
    except DashError as e:
        where = f"dash-memd could not be asked where the job stands ({e})"
    if watcher.stopped_ranks:
        print("dashrun: error: the ranks were stopped before the notice's deadline without an emergency "
              "checkpoint; the newest committed one is used on resume", file=sys.stderr)
    print(f"dashrun: preempted by {why}: {where}; run the same command (or dashrun resume --job-id "
          f"{options.job_id}) to continue", file=sys.stderr)
    return int(ExitCode.PREEMPTED)


def _report_child_failure(err) -> None:
    """Root cause first, as torchrun does: the first rank that failed and why."""
    rank, failure = err.get_first_failure()
    reason = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    reason = (reason or "").strip().splitlines()
    detail = reason[-1] if reason else "see its output above"
    print(f"dashrun: error: rank {rank} failed first (exit code {failure.exitcode}): {detail}", file=sys.stderr)
    others = sorted(r for r in err.failures if r != rank)
    if others:
        print(f"dashrun: ranks {', '.join(map(str, others))} failed after it", file=sys.stderr)
