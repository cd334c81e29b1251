"""dashrun's command line: torchrun's parser with dashrun's options, and what both launch paths read from it.

The parser is torch's own ``torchrun`` parser (every torchrun flag keeps its
meaning, spellings and ``PET_*`` twin) with dashrun's options added, each
with a ``DASH_*`` twin (:mod:`dashrun.env`). How each option is spelled is
written once, in :data:`NAMES`: the full parser is built from it, and so is
the fan-out's small parser of the options it decides for every host.

The single-node launcher (:mod:`dashrun.launch.launcher`) and the SSH fan-out
(:mod:`dashrun.launch.fanout`) both import this module and never each other;
every value is checked first (:mod:`dashrun.launch.checks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import ssl
import uuid
from pathlib import Path
from typing import NoReturn

from dashrun import env
from dashrun.errors import UsageError
from dashrun.launch.checks import check_values, max_nodes, memd_address, nnodes_range, replicas_of
from dashrun.launch.placement import AUTO, AgentCpus, parse_agent_cpus
from dashrun.util.console import LOG_FORMATS, LOG_LEVELS
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_size
from dashrun.version import __version__
from dashrun.wire.credentials import Credential
from dashrun.wire.domain import MARKETS, FailureDomain, parse_instance_type
from dashrun.wire.operator import load_private_key
from dashrun.wire.protocol import valid_job_id
from dashrun.wire.tls import TlsSettings

__all__ = [
    "NAMES", "LaunchOptions", "OptionName", "apply_torchrun_defaults", "build_parser", "check_values",
    "derive_job_id", "job_id_from_args", "max_nodes", "memd_address", "nnodes_range", "options_from_args",
    "require_script", "require_shared_memd", "require_token_file",
]

MEMD_HINT = "start one with 'dash-memd start' on a stable VM and pass --memd HOST:PORT"
TOKEN_HINT = "the file with the token dash-memd was started with"
#: Seconds a launch waits for an unreachable dash-memd by default (one restarting is back well within it).
MEMD_WAIT = 30.0



@dataclasses.dataclass(frozen=True)
class OptionName:
    """How an option is spelled on the command line: its strings, its dest, and whether it takes a value."""

    dest: str
    strings: tuple[str, ...]
    action: str = "store"  # "store": one value; "store_true": a flag

    def add_to(self, container, **kwargs) -> argparse.Action:
        """Add this option to a parser or an argument group; ``kwargs`` as for ``add_argument``."""
        return container.add_argument(*self.strings, dest=self.dest, action=self.action, **kwargs)


#: Every option the launch paths name, by dest: dashrun's own, and the torchrun ones the fan-out decides for
#: every host (spelled as torch's parser spells them).
NAMES: dict[str, OptionName] = {name.dest: name for name in (
    OptionName("memd", ("--memd",)),
    OptionName("token_file", ("--token-file", "--token_file")),
    OptionName("memd_wait", ("--memd-wait", "--memd_wait")),
    OptionName("job_id", ("--job-id", "--job_id")),
    OptionName("fresh", ("--fresh",), "store_true"),
    OptionName("cloud", ("--cloud",)),
    OptionName("metadata_endpoint", ("--metadata-endpoint", "--metadata_endpoint")),
    OptionName("poll_interval", ("--poll-interval", "--poll_interval")),
    OptionName("failure_domain", ("--failure-domain", "--failure_domain")),
    OptionName("instance_type", ("--instance-type", "--instance_type")),
    OptionName("market", ("--market",)),
    OptionName("replicas", ("--replicas",)),
    OptionName("peer_port", ("--peer-port", "--peer_port")),
    OptionName("peer_memory_limit", ("--peer-memory-limit", "--peer_memory_limit")),
    OptionName("data_cache", ("--data-cache", "--data_cache")),
    OptionName("data_cache_limit", ("--data-cache-limit", "--data_cache_limit")),
    OptionName("hostfile", ("--hostfile",)),
    OptionName("ssh_config", ("--ssh-config", "--ssh_config")),
    OptionName("remote_python", ("--remote-python", "--remote_python")),
    OptionName("no_tls", ("--no-tls", "--no_tls"), "store_true"),
    OptionName("tls_ca", ("--tls-ca", "--tls_ca")),
    OptionName("tls_fingerprint", ("--tls-fingerprint", "--tls_fingerprint")),
    OptionName("agent_cpus", ("--agent-cpus", "--agent_cpus")),
    OptionName("operator_key", ("--operator-key", "--operator_key")),
    OptionName("weak_token_ok", ("--weak-token-ok", "--weak_token_ok"), "store_true"),
    OptionName("log_level", ("--log-level", "--log_level")),
    OptionName("log_format", ("--log-format", "--log_format")),
    # torchrun's
    OptionName("nnodes", ("--nnodes",)),
    OptionName("node_rank", ("--node-rank", "--node_rank")),
    OptionName("nproc_per_node", ("--nproc-per-node", "--nproc_per_node")),
    OptionName("rdzv_backend", ("--rdzv-backend", "--rdzv_backend")),
    OptionName("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint")),
    OptionName("rdzv_id", ("--rdzv-id", "--rdzv_id")),
)}


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
    failure_domain: FailureDomain | None = None  # None: dash-agent reads it from the metadata service
    instance_type: str | None = None  # None: the metadata service's (or --failure-domain's pool)
    market: str | None = None  # spot, on-demand; None: as for instance_type
    tls: TlsSettings = TlsSettings()
    agent_cpus: AgentCpus = AUTO  # where dash-agent runs: auto, none or its CPUs (dashrun.launch.placement)
    operator_key: Path | None = None  # signs the launch spec (dashrun.wire.operator)
    memd_wait: float = MEMD_WAIT  # seconds to wait for an unreachable dash-memd at launch
    replicas: int = 0  # other nodes that keep a copy of this node's snapshot in their agent's memory
    peer_port: int | None = None  # None: dash-agent's default
    peer_memory_limit: str | None = None  # as given (checked): None, dash-agent's default
    data_cache: Path | None = None  # the node's data set cache (dashrun.data); None: DASH_DATA_CACHE or the default
    data_cache_limit: int | None = None  # bytes it may hold; None: DASH_DATA_CACHE_LIMIT or the default

    def data_cache_env(self) -> dict[str, str]:
        """The node's data set cache as dash-agent and the ranks read it (dashrun.data), where given."""
        given = ((env.DATA_CACHE, self.data_cache), (env.DATA_CACHE_LIMIT, self.data_cache_limit))
        return {var.name: str(value) for var, value in given if value is not None}

    def agent_args(self) -> list[str]:
        """The options of dash-agent that come from these, besides those every agent gets."""
        given = [("--metadata-endpoint", self.metadata_endpoint),
                 ("--poll-interval", self.poll_interval and str(self.poll_interval)),
                 ("--failure-domain", self.failure_domain and self.failure_domain.label),
                 ("--instance-type", self.instance_type), ("--market", self.market),
                 ("--replicas", str(self.replicas)),
                 ("--peer-port", None if self.peer_port is None else str(self.peer_port)),
                 ("--peer-memory-limit", self.peer_memory_limit)]
        return [part for option, value in given if value for part in (option, value)]


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, with dashrun's options added (same habits: both spellings, env twins)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "dashrun"
    parser.error = _parser_error
    parser.description = ("Launch a PyTorch training script like torchrun, with its state checkpointed to "
                          "dash-memd and resumed after preemption.")
    parser.epilog = ("commands: dashrun {resume,status,ls,export,gc,rm} --help. "
                     "Exit codes: 0 done, 1 training failed, 2 usage error, 75 preempted (relaunch to resume).")
    # An option, not a command: argparse acts on it as it meets it, before it asks for the script.
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    group = parser.add_argument_group("dashrun")
    NAMES["memd"].add_to(group, default=env.get(env.MEMD), metavar="HOST:PORT",
                         help=f"dash-memd to checkpoint to (env {env.MEMD.name}; default: a private one on "
                              "loopback, with its data under ~/.cache/dashrun).")
    NAMES["token_file"].add_to(group, default=env.get(env.TOKEN_FILE), metavar="FILE",
                               help=f"file with the cluster's token, needed with --memd (env {env.TOKEN_FILE.name}).")
    NAMES["memd_wait"].add_to(group, type=float, default=env.get(env.MEMD_WAIT, MEMD_WAIT), metavar="SECONDS",
                              help=f"how long the launch waits for an unreachable dash-memd, which may be restarting "
                                   f"(env {env.MEMD_WAIT.name}; default {MEMD_WAIT:g}).")
    NAMES["job_id"].add_to(group, default=env.get(env.JOB_ID), metavar="ID",
                           help=f"the job's stable id: relaunching with the same id resumes (env {env.JOB_ID.name}; "
                                "default: derived from the script's absolute path and its arguments).")
    NAMES["fresh"].add_to(group, default=env.get(env.FRESH, "0") == "1",
                          help=f"delete the job's earlier checkpoints and start from step 0 (env {env.FRESH.name}=1).")
    NAMES["cloud"].add_to(group, default=env.get(env.CLOUD, "auto"), choices=("auto", "aws", "gcp", "azure", "none"),
                          help=f"where Spot interruption notices come from (env {env.CLOUD.name}; default auto: "
                               "detect quickly, none when no metadata service answers).")
    NAMES["metadata_endpoint"].add_to(group, default=env.get(env.METADATA_ENDPOINT), metavar="URL",
                                      help=f"base URL of the cloud's metadata service (env "
                                           f"{env.METADATA_ENDPOINT.name}; AWS_EC2_METADATA_SERVICE_ENDPOINT and "
                                           "GCE_METADATA_HOST work too).")
    NAMES["poll_interval"].add_to(group, type=float, default=env.get(env.POLL_INTERVAL), metavar="SECONDS",
                                  help=f"seconds between metadata polls (env {env.POLL_INTERVAL.name}; "
                                       "default: each cloud's).")
    NAMES["failure_domain"].add_to(group, default=env.get(env.FAILURE_DOMAIN), metavar="ZONE[/POOL]",
                                   help=f"this node's failure domain, which replicas of its state are placed away "
                                        f"from (env {env.FAILURE_DOMAIN.name}; default: the zone, instance type and "
                                        "market the metadata service gives, e.g. us-east-1a/g5.12xlarge:spot).")
    NAMES["instance_type"].add_to(group, default=env.get(env.INSTANCE_TYPE), metavar="TYPE",
                                  help=f"this node's instance type, which dashrun report prices its hours by (env "
                                       f"{env.INSTANCE_TYPE.name}; default: the metadata service's, e.g. "
                                       "g5.12xlarge).")
    NAMES["market"].add_to(group, default=env.get(env.MARKET), choices=MARKETS,
                           help=f"whether this node is a Spot VM (env {env.MARKET.name}; default: the metadata "
                                "service says).")
    NAMES["replicas"].add_to(group, type=int, default=env.get(env.REPLICAS), metavar="R",
                             help=f"other nodes that keep a copy of each node's newest snapshot in their dash-agent's "
                                  f"memory, in another zone and pool first (env {env.REPLICAS.name}; default 1 on two "
                                  "nodes or more, 0 on one); a restore reads the node's own copy, then a peer's, "
                                  "then dash-memd's (docs/replicas.md).")
    NAMES["peer_port"].add_to(group, type=int, default=env.get(env.PEER_PORT), metavar="PORT",
                              help=f"TCP port dash-agent serves the job's other agents on (env {env.PEER_PORT.name}; "
                                   f"default {env.DEFAULT_PEER_PORT}; 0: any free port).")
    NAMES["peer_memory_limit"].add_to(group, default=env.get(env.PEER_MEMORY_LIMIT), metavar="SIZE",
                                      help=f"memory dash-agent may give the copies it keeps, like 8GiB (env "
                                           f"{env.PEER_MEMORY_LIMIT.name}; default 8GiB with replicas).")
    NAMES["data_cache"].add_to(group, default=env.get(env.DATA_CACHE), metavar="DIR",
                               help=f"the node's data set cache, shared by every job and rank of the node, which "
                                    f"dashrun.data.CachedFiles reads through (env {env.DATA_CACHE.name}; default "
                                    "~/.cache/dashrun/data; docs/data.md).")
    NAMES["data_cache_limit"].add_to(group, default=env.get(env.DATA_CACHE_LIMIT), metavar="SIZE",
                                     help=f"bytes the data cache may hold, like 500GiB; least recently used objects "
                                          f"are evicted (env {env.DATA_CACHE_LIMIT.name}; default: what it holds "
                                          "plus the free space, less a tenth of the file system).")
    NAMES["hostfile"].add_to(group, default=env.get(env.HOSTFILE), metavar="FILE",
                             help=f"start dashrun on every host of FILE ('HOST slots=N' per line) over SSH, with "
                                  f"--nnodes, --nproc-per-node and a c10d rendezvous on the first host decided for "
                                  f"each (env {env.HOSTFILE.name}).")
    NAMES["ssh_config"].add_to(group, default=env.get(env.SSH_CONFIG), metavar="FILE",
                               help=f"OpenSSH client config for --hostfile: HostName, Port, User, IdentityFile, "
                                    f"UserKnownHostsFile (env {env.SSH_CONFIG.name}; default ~/.ssh/config).")
    NAMES["remote_python"].add_to(group, default=env.get(env.REMOTE_PYTHON), metavar="PATH",
                                  help=f"Python that runs dashrun on the hosts of --hostfile (env "
                                       f"{env.REMOTE_PYTHON.name}; default: this one's path).")
    NAMES["no_tls"].add_to(group, default=env.get(env.NO_TLS, "0") == "1",
                           help=f"plaintext TCP to a dash-memd started with --no-tls, for this launcher, its "
                                f"dash-agent and ranks (env {env.NO_TLS.name}=1): no encryption, anyone on the path "
                                "reads the checkpoints; the token login and each record's MAC still stop them from "
                                "altering or injecting bytes (default: TLS, with dash-memd authenticated on the link "
                                "by the token).")
    NAMES["tls_ca"].add_to(group, default=env.get(env.TLS_CA), metavar="FILE",
                           help=f"also verify dash-memd's TLS certificate chain and host name against these PEM CA "
                                f"certificates (env {env.TLS_CA.name}).")
    NAMES["tls_fingerprint"].add_to(group, default=env.get(env.TLS_FINGERPRINT), metavar="SHA256:...",
                                    help=f"talk only to the dash-memd whose certificate has this SHA-256, as "
                                         f"'dash-memd fingerprint' prints it; any other is refused before the login "
                                         f"(env {env.TLS_FINGERPRINT.name}; default: any that holds the token).")
    NAMES["agent_cpus"].add_to(group, default=env.get(env.AGENT_CPUS, AUTO), metavar="auto|none|LIST",
                               help=f"CPUs for this node's dash-agent, kept from the ranks, which run on the "
                                    f"launcher's other CPUs (env {env.AGENT_CPUS.name}; default auto: one core of "
                                    "those allowed, the highest-numbered, where there are more cores than ranks; "
                                    "none: as the launcher runs; a LIST like 7 or 6-7).")
    NAMES["operator_key"].add_to(group, default=env.get(env.OPERATOR_KEY), metavar="FILE",
                                 help=f"the operator's private key (dash-memd keys): sign the launch spec that "
                                      f"dashrun resume runs on a new node (env {env.OPERATOR_KEY.name}; without it "
                                      "no spec is stored, but for a private dash-memd, whose key is its own).")
    NAMES["weak_token_ok"].add_to(group, default=env.get(env.WEAK_TOKEN_OK, "0") == "1",
                                  help=f"take a token that is not 64 random hex digits, with a warning (env "
                                       f"{env.WEAK_TOKEN_OK.name}=1, which the ranks and dash-agent inherit).")
    NAMES["log_level"].add_to(group, default=env.get(env.LOG_LEVEL, "INFO"), metavar="LEVEL",
                              help=f"{', '.join(LOG_LEVELS)}: of this launcher, its dash-agent and private dash-memd "
                                   f"(env {env.LOG_LEVEL.name}; default INFO).")
    NAMES["log_format"].add_to(group, default=env.get(env.LOG_FORMAT, "text"), metavar="FORMAT",
                               help=f"{' or '.join(LOG_FORMATS)}: json prints one object a line (time, level, logger, "
                                    f"message, job and rank where known), for log shippers (env "
                                    f"{env.LOG_FORMAT.name}; default text).")
    return parser


def _parser_error(message: str) -> NoReturn:
    """argparse's own errors (a missing script, ``--max-restarts x``, ``--cloud bogus``) rendered as dashrun's:
    one line and a hint, exit 2, instead of torchrun's usage of some twenty lines before the one that matters."""
    raise UsageError(message, hint="dashrun --help lists every option and its values")


def derive_job_id(script: str, script_args: list[str]) -> str:
    """A job id stable across relaunches of the same command: ``<script stem>-<hash of path and args>``."""
    identity = "\0".join([os.path.abspath(script), *script_args])
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).lstrip("._-")[:64] or "job"
    return f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


# --- checks both launch paths make, each in the order its path makes them -----------------


def job_id_from_args(args: argparse.Namespace) -> str:
    """``--job-id``, or the one derived from the script and its arguments; UsageError if it is not valid."""
    if args.job_id == "":  # said, and empty: not the same as not said
        raise UsageError("--job-id is empty", hint="name the job, or leave --job-id out to derive one")
    job_id = args.job_id or derive_job_id(args.training_script, args.training_script_args)
    if not valid_job_id(job_id):
        raise UsageError(f"--job-id {job_id!r} is not a valid job id",
                         hint="use 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit")
    return job_id


def require_shared_memd(args: argparse.Namespace, count: int, what: str) -> None:
    """A job on ``count`` > 1 nodes (``what``: "nodes", "hosts") needs a --memd they all reach."""
    if args.memd is None and count > 1:
        raise UsageError(f"a job on several {what} needs a dash-memd they all reach", hint=MEMD_HINT)


def require_token_file(memd: str | None, token_file: str | None, where: str = "") -> None:
    """--memd needs --token-file; ``where`` ends the hint (where the file must be)."""
    if memd is not None and token_file is None:
        raise UsageError("--memd needs --token-file", hint=TOKEN_HINT + where)


def require_script(args: argparse.Namespace) -> None:
    """The training script exists here: a missing one stops the launch in one line, before dash-memd, dash-agent
    and the ranks start (each rank would fail alone, its one line lost among the launcher's). With ``-m`` it names
    a module, which the ranks find on their own path; with ``--no-python``, a program (a path, or on PATH)."""
    script = args.training_script
    if args.module:
        return
    if args.no_python:
        if shutil.which(script) is None:
            raise UsageError(f"program {script} not found, or not executable", hint="give its path, or put it on PATH")
        return
    if not os.path.exists(script):
        raise UsageError(f"training script {script} not found (in {os.getcwd()})",
                         hint="give its path, or -m for a module, as to torchrun")



def _require_devices(nproc_per_node: str) -> None:
    """``--nproc-per-node gpu`` (or xpu) needs such a device on this node: torch's launcher would stop on a
    ValueError after dash-memd and dash-agent had started."""
    import torch

    module = {"gpu": "cuda", "xpu": "xpu"}.get(nproc_per_node)
    if module is not None and not getattr(torch, module).is_available():
        raise UsageError(f"--nproc-per-node {nproc_per_node}: this node has no {module.upper()} device",
                         hint="give the number of ranks to start, or auto (one per device, else per CPU)")


def _load_ca(ca: Path) -> None:
    """``--tls-ca`` loads as the links to dash-memd will load it (dashrun.wire.tls): now, before a private
    dash-memd starts."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"cannot load --tls-ca {ca}: {getattr(e, 'reason', None) or e.strerror or e}",
                         hint="give a file of PEM CA certificates") from None


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """dashrun's options of a launch on this node, checked (with every other option's value); the token file,
    the operator's key and the CA certificates are read now, to fail in one line."""
    check_values(args)
    if args.weak_token_ok:  # read where the token is: here, in dash-agent and in the ranks
        os.environ[env.WEAK_TOKEN_OK.name] = "1"
    operator_key = None
    if args.operator_key:
        load_private_key(args.operator_key)  # its errors name it as it was typed
        operator_key = Path(args.operator_key).absolute()
    _require_devices(args.nproc_per_node)
    require_script(args)
    job_id = job_id_from_args(args)
    tls = TlsSettings.from_options(args.no_tls, args.tls_ca, args.tls_fingerprint)
    if tls.ca is not None:
        _load_ca(tls.ca)
    agent_cpus = parse_agent_cpus(args.agent_cpus)
    common = dict(job_id=job_id, fresh=args.fresh, cloud=args.cloud, metadata_endpoint=args.metadata_endpoint,
                  poll_interval=args.poll_interval, tls=tls, agent_cpus=agent_cpus, operator_key=operator_key,
                  memd_wait=args.memd_wait, replicas=replicas_of(args), peer_port=args.peer_port,
                  peer_memory_limit=args.peer_memory_limit,
                  data_cache=Path(args.data_cache).expanduser().absolute() if args.data_cache else None,
                  data_cache_limit=_data_cache_limit(args.data_cache_limit),
                  failure_domain=FailureDomain.parse(args.failure_domain) if args.failure_domain else None,
                  instance_type=parse_instance_type(args.instance_type), market=args.market)
    if args.memd is None:
        require_shared_memd(args, max_nodes(args), "nodes")
        return LaunchOptions(memd=None, token_file=None, **common)
    require_token_file(args.memd, args.token_file)
    token_file = Path(args.token_file)
    Credential.parse(read_token(token_file)).for_job(job_id)  # fail now, in one line, not later in the agent
    return LaunchOptions(memd=memd_address(args.memd), token_file=token_file, **common)


def _data_cache_limit(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        limit = parse_size(text)
    except UsageError as e:
        raise UsageError(f"--data-cache-limit: {e.message}", hint=e.hint) from None
    if limit <= 0:
        raise UsageError(f"--data-cache-limit {text} must be more than nothing", hint="give it like 500GiB")
    return limit


def apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """The pre-processing ``torch.distributed.run.run()`` applies before ``config_from_args``."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if max_nodes(args) == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
