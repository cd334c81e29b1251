"""``dash-agent``: parse, build a config, run until told to stop, exit.

Every option has an environment twin (``DASH_*``, :mod:`dashrun.env`); a flag
wins over its variable, which wins over the default.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from dashrun import env
from dashrun.agent.config import AgentConfig
from dashrun.agent.pollers import CHOICES
from dashrun.agent.service import AgentServer
from dashrun.env import DEFAULT_PORT
from dashrun.errors import ExitCode
from dashrun.util.console import log_options, run_click, setup_logging
from dashrun.util.metrics import metrics_access_options, metrics_settings
from dashrun.util.signals import PARENT_GONE, block_stop_signals, wait_for_stop
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address, parse_size
from dashrun.version import __version__
from dashrun.wire.domain import MARKETS, FailureDomain, parse_instance_type
from dashrun.wire.tls import TlsSettings

__all__ = ["PROGRAM", "cli", "main", "run"]

PROGRAM = "dash-agent"
log = logging.getLogger(PROGRAM)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name=PROGRAM, message="%(prog)s %(version)s")
@click.option("--memd", envvar=env.MEMD.name, show_envvar=True, required=True, help="HOST:PORT of dash-memd.")
@click.option("--token-file", envvar=env.TOKEN_FILE.name, show_envvar=True, required=True,
              type=click.Path(dir_okay=False), help="File holding the cluster's shared token.")
@click.option("--socket", "socket_path", envvar=env.AGENT_SOCKET.name, show_envvar=True, required=True,
              type=click.Path(dir_okay=False), help="Unix socket the node's ranks connect to.")
@click.option("--listen-fd", envvar=env.AGENT_LISTEN_FD.name, show_envvar=True, type=int, default=None,
              help="Serve the ranks on this inherited descriptor: a Unix socket already listening at --socket "
                   "(the launcher makes it, so that ranks may connect while the agent starts).")
@click.option("--parent-pid", envvar=env.PARENT_PID.name, show_envvar=True, type=int, default=None,
              help="Exit (after delivering handed-over shards) when this process is gone.")
@click.option("--memd-timeout", envvar=env.MEMD_TIMEOUT.name, show_envvar=True, default=60.0, show_default=True,
              type=float, help="Seconds a request to dash-memd may stay silent.")
@click.option("--drain-timeout", envvar=env.DRAIN_TIMEOUT.name, show_envvar=True, default=60.0, show_default=True,
              type=float, help="Seconds to deliver handed-over shards when stopping.")
@click.option("--job-id", envvar=env.JOB_ID.name, show_envvar=True, default=None,
              help="The job served (notices are recorded on it).")
@click.option("--cloud", envvar=env.CLOUD.name, show_envvar=True, type=click.Choice(CHOICES), default="auto",
              show_default=True,
              help="Where interruption notices come from (auto: detect quickly, none if no metadata service answers).")
@click.option("--metadata-endpoint", envvar=env.METADATA_ENDPOINT.name, show_envvar=True, default=None,
              help="Base URL of the metadata service (AWS_EC2_METADATA_SERVICE_ENDPOINT and GCE_METADATA_HOST "
                   "are honoured too).")
@click.option("--poll-interval", envvar=env.POLL_INTERVAL.name, show_envvar=True, type=float, default=None,
              help="Seconds between metadata polls (default: each cloud's; GCP waits on a hanging GET).")
@click.option("--failure-domain", envvar=env.FAILURE_DOMAIN.name, show_envvar=True, default=None,
              metavar="ZONE[/POOL]",
              help="This node's failure domain, which replicas of its state are placed away from (default: the zone, "
                   "instance type and market the metadata service gives, e.g. us-east-1a/g5.12xlarge:spot).")
@click.option("--instance-type", envvar=env.INSTANCE_TYPE.name, show_envvar=True, default=None, metavar="TYPE",
              help="This node's instance type, for the job's cost ledger and its pool (default: the metadata "
                   "service's, e.g. g5.12xlarge).")
@click.option("--market", envvar=env.MARKET.name, show_envvar=True, default=None, type=click.Choice(MARKETS),
              help="Whether this node is a Spot VM (default: the metadata service says).")
@click.option("--no-prefetch", envvar=env.NO_PREFETCH.name, show_envvar=True, is_flag=True,
              help="Do not fetch the job's newest checkpoint at start, ahead of its ranks' restore().")
@click.option("--no-tls", envvar=env.NO_TLS.name, show_envvar=True, is_flag=True,
              help="Plaintext TCP to a dash-memd started with --no-tls (default: TLS): no encryption; the token "
                   "login and each record's MAC still hold.")
@click.option("--tls-ca", envvar=env.TLS_CA.name, show_envvar=True, type=click.Path(dir_okay=False), default=None,
              help="Also verify dash-memd's certificate chain and host name against these PEM CA certificates "
                   "(default: the login authenticates dash-memd on the TLS link itself).")
@click.option("--tls-fingerprint", envvar=env.TLS_FINGERPRINT.name, show_envvar=True, default=None,
              metavar="SHA256:...", help="Talk only to the dash-memd whose certificate has this SHA-256 ('dash-memd "
                                         "fingerprint' prints it); refuse any other before the login.")
@click.option("--replicas", envvar=env.REPLICAS.name, show_envvar=True, type=click.IntRange(min=0), default=0,
              show_default=True, help="Other nodes that keep a copy of this node's snapshot in their agent's memory "
                                      "(this agent keeps theirs and its own).")
@click.option("--peer-port", envvar=env.PEER_PORT.name, show_envvar=True, type=click.IntRange(0, 65535),
              default=env.DEFAULT_PEER_PORT, show_default=True,
              help="TCP port for the job's other agents (0: any free port), on the address this node reaches "
                   "dash-memd from; with --replicas only.")
@click.option("--peer-memory-limit", envvar=env.PEER_MEMORY_LIMIT.name, show_envvar=True, default=None,
              metavar="SIZE", help="Memory for shards kept by this agent, like 8GiB (default: 8GiB with --replicas, "
                                   "else 0: none kept).")
@click.option("--node", envvar=env.NODE.name, show_envvar=True, default=None, metavar="NAME",
              help="This node's name among the job's nodes, which dash-memd lists (default: its host name; each "
                   "node's must be its own).")
@click.option("--peer", "peers", envvar=env.PEERS.name, show_envvar=True, multiple=True, metavar="HOST:PORT",
              help="For tests: an agent this node's replicas go to (repeat it), in place of dash-memd's registry.")
@click.option("--metrics-listen", envvar=env.AGENT_METRICS_LISTEN.name, show_envvar=True, default=None,
              metavar="[HOST:]PORT", help="Serve Prometheus metrics at /metrics on HOST:PORT (HOST left out: "
                                         "loopback; HTTPS with --metrics-tls-cert; docs/metrics.md).")
@metrics_access_options
@log_options
def cli(memd, token_file, socket_path, listen_fd, parent_pid, memd_timeout, drain_timeout, job_id, cloud,
        metadata_endpoint, poll_interval, failure_domain, instance_type, market, no_prefetch, no_tls, tls_ca,
        tls_fingerprint, replicas, peer_port, peer_memory_limit, node, peers, metrics_listen, metrics_tls_cert,
        metrics_tls_key, metrics_token_file, log_level, log_format) -> None:
    """Forward the node's checkpoints to dash-memd and its interruption notices to the ranks (started by dashrun)."""
    setup_logging(PROGRAM, log_level, log_format, job=job_id)
    host, port = parse_address(memd, default_port=DEFAULT_PORT, what="--memd")
    config = AgentConfig(memd_host=host, memd_port=port, token=read_token(token_file),
                         socket_path=Path(socket_path), listen_fd=listen_fd, memd_timeout=memd_timeout,
                         drain_timeout=drain_timeout, job=job_id, cloud=cloud, metadata_endpoint=metadata_endpoint,
                         poll_interval=poll_interval, parent_pid=parent_pid,
                         failure_domain=FailureDomain.parse(failure_domain) if failure_domain else None,
                         instance_type=parse_instance_type(instance_type), market=market,
                         tls=TlsSettings.from_options(no_tls, tls_ca, tls_fingerprint), prefetch=not no_prefetch,
                         replicas=replicas, peer_port=peer_port,
                         peer_memory_limit=None if peer_memory_limit is None else parse_size(peer_memory_limit),
                         peers=tuple(_peer(text) for text in peers),
                         metrics=metrics_settings(metrics_listen, metrics_tls_cert, metrics_tls_key,
                                                  metrics_token_file),
                         **({"node": node} if node else {}))
    sys.exit(run(config))


def _peer(text: str) -> tuple[str, str, int]:
    """A ``--peer HOST:PORT``: the peer's node is named by its address."""
    host, port = parse_address(text, default_port=env.DEFAULT_PEER_PORT, what="--peer")
    return f"{host}:{port}", host, port


def run(config: AgentConfig) -> int:
    """Serve until SIGTERM or SIGINT, or until the launcher (``config.parent_pid``) is gone; drain; the exit code."""
    block_stop_signals()
    server = AgentServer(config)
    server.start()
    if wait_for_stop(config.parent_pid) == PARENT_GONE:
        log.warning("launcher (pid %d) is gone; delivering what was handed over, then exiting", config.parent_pid)
    server.stop()
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> None:
    run_click(cli, PROGRAM, argv)
