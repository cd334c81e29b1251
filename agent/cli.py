"""``dash-agent``: parse, build a config, run until told to stop, exit."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from dashrun import env
from dashrun.agent.pollers import CHOICES
from dashrun.agent.service import AgentConfig, AgentServer
from dashrun.env import DEFAULT_PORT
from dashrun.errors import ExitCode
from dashrun.util.console import run_click, setup_logging
from dashrun.util.signals import block_stop_signals, next_stop_signal
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address

PROGRAM = "dash-agent"
log = logging.getLogger(PROGRAM)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--memd", envvar=env.MEMD.name, required=True, help="HOST:PORT of dash-memd.")
@click.option("--token-file", envvar=env.TOKEN_FILE.name, required=True, type=click.Path(dir_okay=False))
@click.option("--socket", "socket_path", envvar=env.AGENT_SOCKET.name, required=True,
              type=click.Path(dir_okay=False), help="Unix socket the node's ranks connect to.")
@click.option("--parent-pid", type=int, default=None,
              help="Exit (after delivering handed-over shards) when this process is gone.")
@click.option("--memd-timeout", default=60.0, show_default=True, type=float)
@click.option("--drain-timeout", default=60.0, show_default=True, type=float,
              help="Seconds to deliver handed-over shards when stopping.")
@click.option("--job-id", envvar=env.JOB_ID.name, default=None, help="The job served (notices are recorded on it).")
@click.option("--cloud", envvar=env.CLOUD.name, type=click.Choice(CHOICES), default="auto", show_default=True,
              help="Where interruption notices come from (auto: detect quickly, none if no metadata service answers).")
@click.option("--metadata-endpoint", envvar=env.METADATA_ENDPOINT.name, default=None,
              help="Base URL of the metadata service (AWS_EC2_METADATA_SERVICE_ENDPOINT and GCE_METADATA_HOST "
                   "are honoured too).")
@click.option("--poll-interval", envvar=env.POLL_INTERVAL.name, type=float, default=None,
              help="Seconds between metadata polls (default: each cloud's; GCP waits on a hanging GET).")
@click.option("--log-level", default="INFO", show_default=True)
def cli(memd, token_file, socket_path, parent_pid, memd_timeout, drain_timeout, job_id, cloud, metadata_endpoint,
        poll_interval, log_level) -> None:
    """Forward the node's checkpoints to dash-memd and its interruption notices to the ranks (started by dashrun)."""
    setup_logging(PROGRAM, log_level)
    host, port = parse_address(memd, default_port=DEFAULT_PORT, what="--memd")
    config = AgentConfig(memd_host=host, memd_port=port, token=read_token(token_file),
                         socket_path=Path(socket_path), memd_timeout=memd_timeout, drain_timeout=drain_timeout,
                         job=job_id, cloud=cloud, metadata_endpoint=metadata_endpoint, poll_interval=poll_interval)
    sys.exit(run(config, parent_pid))


def run(config: AgentConfig, parent_pid: int | None = None) -> int:
    block_stop_signals()
    server = AgentServer(config)
    server.start()
    while next_stop_signal(timeout=1.0) is None:
        if parent_pid is not None and os.getppid() != parent_pid:
            log.warning("launcher (pid %d) is gone; delivering what was handed over, then exiting", parent_pid)
            break
    server.stop()
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> None:
    run_click(cli, PROGRAM, argv)
