"""``dash-memd``: the daemon on the stable VM. Parse, build a config, run, exit.

Every option has an environment twin (``DASH_*``, :mod:`dashrun.env`); a flag
wins over its variable, which wins over the default.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import click

from dashrun import env
from dashrun.env import DEFAULT_PORT
from dashrun.errors import ExitCode, UsageError
from dashrun.memd.config import MemdConfig, default_memory_limit
from dashrun.util.metrics import metrics_access_options, metrics_settings
from dashrun.util.console import log_options, run_click, setup_logging
from dashrun.util.signals import PARENT_GONE, block_stop_signals, wait_for_stop
from dashrun.util.tokens import read_token, write_token
from dashrun.util.units import format_size, parse_address, parse_size
from dashrun.version import __version__
from dashrun.wire.credentials import Credential, write_job_credential
from dashrun.wire.operator import write_key_pair
from dashrun.wire.protocol import valid_job_id
from dashrun.wire.tls import IDENTITY_FILE, fingerprint_of

__all__ = ["PROGRAM", "cli", "config_from_options", "main", "run"]

PROGRAM = "dash-memd"
log = logging.getLogger(PROGRAM)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name=PROGRAM, message="%(prog)s %(version)s")
def cli() -> None:
    """dash-memd holds checkpoints of dashrun jobs in RAM and persists them to disk."""


@cli.command()
@click.option("--listen", envvar=env.LISTEN.name, show_envvar=True, default=f"127.0.0.1:{DEFAULT_PORT}",
              show_default=True, help="HOST:PORT to accept agents and clients on (port 0: any free port).")
@click.option("--data-dir", envvar=env.DATA_DIR.name, show_envvar=True, required=True,
              type=click.Path(file_okay=False), help="Directory of the disk tier.")
@click.option("--memory-limit", envvar=env.MEMORY_LIMIT.name, show_envvar=True, default=None,
              show_default="half of this machine's RAM or of its container's memory limit, whichever is smaller",
              help="Checkpoint bytes held in RAM, e.g. 48GiB (GiB: 2^30 bytes, GB: 10^9).")
@click.option("--token-file", envvar=env.TOKEN_FILE.name, show_envvar=True, required=True,
              type=click.Path(dir_okay=False),
              help="File with the cluster's shared token (create one with 'dash-memd token').")
@click.option("--keep-ram", envvar=env.KEEP_RAM.name, show_envvar=True, default=2, show_default=True, type=int,
              help="Committed checkpoints per job kept in RAM.")
@click.option("--keep-disk", envvar=env.KEEP_DISK.name, show_envvar=True, default=3, show_default=True, type=int,
              help="Committed checkpoints per job kept on disk.")
@click.option("--s3", envvar=env.S3.name, show_envvar=True, default=None, metavar="s3://BUCKET/PREFIX",
              help="Also persist every committed checkpoint to this bucket (credentials and endpoint: the standard "
                   "AWS chain, AWS_ENDPOINT_URL included).")
@click.option("--data-cache", envvar=env.MEMD_DATA_CACHE.name, show_envvar=True, default=None,
              type=click.Path(file_okay=False),
              help="Keep a data set cache here too, filled from the objects the nodes cache, which a node with an "
                   "empty cache reads before the source (docs/data.md).")
@click.option("--data-cache-limit", envvar=env.MEMD_DATA_CACHE_LIMIT.name, show_envvar=True, default=None,
              metavar="SIZE", help="Bytes --data-cache may hold (default: its file system's free space, less a "
                                   "tenth).")
@click.option("--keep-object", envvar=env.KEEP_OBJECT.name, show_envvar=True, default=20, show_default=True,
              type=int, help="Committed checkpoints per job kept in the object store.")
@click.option("--upload-queue", envvar=env.UPLOAD_QUEUE.name, show_envvar=True, default=8, show_default=True,
              type=int, help="Uploads waiting at most; when full, the oldest is dropped.")
@click.option("--max-connections", envvar=env.MAX_CONNECTIONS.name, show_envvar=True, default=256,
              show_default=True, type=int, help="Clients served at once; more are refused as busy.")
@click.option("--max-unauthenticated", envvar=env.MAX_UNAUTHENTICATED.name, show_envvar=True, default=32,
              show_default=True, type=int,
              help="Connections still logging in, at once, apart from --max-connections; a new one beyond "
                   "drops the oldest of them.")
@click.option("--auth-timeout", envvar=env.AUTH_TIMEOUT.name, show_envvar=True, default=10.0, show_default=True,
              type=float, help="Seconds a new connection has to authenticate.")
@click.option("--idle-timeout", envvar=env.IDLE_TIMEOUT.name, show_envvar=True, default=300.0, show_default=True,
              type=float, help="Seconds an authenticated connection may stay silent.")
@click.option("--shutdown-timeout", envvar=env.SHUTDOWN_TIMEOUT.name, show_envvar=True, default=60.0,
              show_default=True, type=float, help="Seconds to finish disk writes on SIGTERM.")
@click.option("--ready-file", envvar=env.READY_FILE.name, show_envvar=True, type=click.Path(dir_okay=False),
              default=None, help="Write HOST:PORT here once listening.")
@click.option("--no-tls", envvar=env.NO_TLS.name, show_envvar=True, is_flag=True,
              help="Plaintext TCP instead of TLS (every agent and command must say --no-tls too): no encryption, "
                   "anyone on the path reads checkpoints, job names and command lines; the token login and each "
                   "record's MAC (Poly1305) still stop them from altering, replaying or injecting bytes, and no "
                   "one without the token logs in. Loopback only, unless --insecure-plaintext. Without it, "
                   "clients are authenticated on the TLS link itself and need no CA.")
@click.option("--insecure-plaintext", envvar=env.INSECURE_PLAINTEXT.name, show_envvar=True, is_flag=True,
              help="Let --no-tls listen beyond loopback (a --listen address other machines reach).")
@click.option("--tls-cert", envvar=env.TLS_CERT.name, show_envvar=True, type=click.Path(dir_okay=False), default=None,
              help="Serve this PEM certificate (chain, leaf first) instead of dash-memd's own self-signed one, which "
                   f"it makes at its first start and keeps in --data-dir ({IDENTITY_FILE}, mode 0600).")
@click.option("--tls-key", envvar=env.TLS_KEY.name, show_envvar=True, type=click.Path(dir_okay=False), default=None,
              help="The unencrypted PEM key of --tls-cert (default: in the --tls-cert file).")
@click.option("--parent-pid", envvar=env.PARENT_PID.name, show_envvar=True, type=int, default=None,
              help="Stop as on SIGTERM (disk writes finished first) when this process is gone: the launcher of a "
                   "private dash-memd.")
@click.option("--weak-token-ok", envvar=env.WEAK_TOKEN_OK.name, show_envvar=True, is_flag=True,
              help="Take a token that is not 64 random hex digits, with a warning.")
@click.option("--metrics-listen", envvar=env.METRICS_LISTEN.name, show_envvar=True, default=None,
              metavar="[HOST:]PORT", help="Serve Prometheus metrics at /metrics on HOST:PORT (HOST left out: "
                                         "loopback; HTTPS with --metrics-tls-cert; docs/metrics.md).")
@metrics_access_options
@log_options
def start(**options) -> None:
    """Run dash-memd in the foreground until SIGTERM or SIGINT."""
    setup_logging(PROGRAM, options.pop("log_level"), options.pop("log_format"))
    if options.pop("weak_token_ok"):
        os.environ[env.WEAK_TOKEN_OK.name] = "1"  # where read_token looks
    sys.exit(run(config_from_options(**options)))


@cli.command()
@click.option("--data-dir", envvar=env.DATA_DIR.name, show_envvar=True, type=click.Path(file_okay=False),
              default=None, help="dash-memd's data dir: the certificate it keeps there.")
@click.option("--tls-cert", envvar=env.TLS_CERT.name, show_envvar=True, type=click.Path(dir_okay=False), default=None,
              help="The operator's certificate dash-memd serves instead (--tls-cert of 'dash-memd start').")
def fingerprint(data_dir, tls_cert) -> None:
    """Print the SHA-256 of dash-memd's TLS certificate, as clients pin it: --tls-fingerprint SHA256:<base64>.

    The same value dash-memd's start-up line shows; clients also accept it as 64 hex digits, with or without
    colons (as 'openssl x509 -noout -fingerprint -sha256' prints it).
    """
    if data_dir is None and tls_cert is None:
        raise UsageError("give --data-dir (dash-memd's own certificate) or --tls-cert (the operator's)",
                         hint="the --data-dir or --tls-cert that dash-memd runs with")
    click.echo(fingerprint_of(cert=Path(tls_cert) if tls_cert else None, data_dir=Path(data_dir) if data_dir else None))


@cli.command()
@click.option("--out", envvar=env.TOKEN_OUT.name, show_envvar=True, required=True, type=click.Path(dir_okay=False),
              help="Where to write the new token (or the job's credential).")
@click.option("--job", envvar=env.TOKEN_JOB.name, show_envvar=True, default=None, metavar="JOB",
              help="Write JOB's credential, made from --token-file's token, instead of a new token: it logs in for "
                   "JOB alone (its checkpoints, rendezvous, store) and cannot launch specs or delete the job.")
@click.option("--token-file", envvar=env.TOKEN_FILE.name, show_envvar=True, default=None,
              type=click.Path(dir_okay=False), help="The cluster's token, to make --job's credential from.")
def token(out, job, token_file) -> None:
    """Create a new random cluster token (or a job's credential), readable by its owner only."""
    if job is None:
        write_token(out)
        click.echo(f"wrote a new token to {out}; give it to dash-memd and the operator (--token-file {out}), and "
                   "each job's nodes only that job's credential (dash-memd token --job JOB)")
        return
    if not valid_job_id(job):
        raise UsageError(f"{job!r} is not a valid job id", hint="1-128 of A-Z a-z 0-9 . _ -, starting alphanumeric")
    if token_file is None:
        raise UsageError("--job needs --token-file: a job's credential is made from the cluster's token")
    credential = Credential.parse(read_token(token_file))
    if not credential.operator:
        raise UsageError(f"{token_file} holds a job's credential, not the cluster's token",
                         hint="give the token dash-memd was started with")
    try:
        write_job_credential(credential.for_job(job), out)
    except FileExistsError:
        raise UsageError(f"{out} exists already", hint="give another --out, or remove the old file first") from None
    click.echo(f"wrote job {job}'s credential to {out}; give it to the job's nodes as --token-file {out}")


@cli.command()
@click.option("--out", envvar=env.KEYS_OUT.name, show_envvar=True, required=True, type=click.Path(dir_okay=False),
              help="Where to write the private key; the public key goes to the same path plus .pub.")
def keys(out) -> None:
    """Create the operator's Ed25519 key pair: launch specs signed with it are all dashrun resume runs."""
    public = write_key_pair(out)
    click.echo(f"wrote the operator's private key to {out} (keep it off the nodes: dashrun --operator-key {out}) "
               f"and its public key to {public} (for every node: dashrun resume --operator-pubkey {public})")


def config_from_options(*, listen: str, data_dir: str, memory_limit: str | None, token_file: str, keep_ram: int,
                        keep_disk: int, s3: str | None, keep_object: int, upload_queue: int, max_connections: int,
                        auth_timeout: float, idle_timeout: float, shutdown_timeout: float,
                        ready_file: str | None, no_tls: bool = False, tls_cert: str | None = None,
                        tls_key: str | None = None, max_unauthenticated: int = 32,
                        parent_pid: int | None = None, insecure_plaintext: bool = False,
                        data_cache: str | None = None, data_cache_limit: str | None = None,
                        metrics_listen: str | None = None, metrics_tls_cert: str | None = None,
                        metrics_tls_key: str | None = None, metrics_token_file: str | None = None) -> MemdConfig:
    """The options of ``dash-memd start`` as a config; raises UsageError."""
    host, port = parse_address(listen, default_port=DEFAULT_PORT, what="--listen")
    metrics = metrics_settings(metrics_listen, metrics_tls_cert, metrics_tls_key, metrics_token_file)
    return MemdConfig(
        host=host, port=port, data_dir=Path(data_dir),
        memory_limit=_memory_limit(memory_limit),
        token=read_token(token_file), keep_ram=keep_ram, keep_disk=keep_disk, s3=s3, keep_object=keep_object,
        upload_queue=upload_queue,
        max_connections=max_connections, max_unauthenticated=max_unauthenticated, auth_timeout=auth_timeout,
        idle_timeout=idle_timeout,
        shutdown_timeout=shutdown_timeout, ready_file=Path(ready_file) if ready_file else None,
        no_tls=no_tls, insecure_plaintext=insecure_plaintext, tls_cert=Path(tls_cert) if tls_cert else None,
        tls_key=Path(tls_key) if tls_key else None,
        parent_pid=parent_pid, data_cache=Path(data_cache) if data_cache else None,
        data_cache_limit=parse_size(data_cache_limit) if data_cache_limit else None, metrics=metrics,
    )


def _memory_limit(value: str | None) -> int:
    """``--memory-limit``, refused above the memory this process may use (the RAM, or its cgroup's limit)."""
    if not value:
        return default_memory_limit()
    limit = parse_size(value)
    usable = 2 * default_memory_limit()
    if limit > usable:
        raise UsageError(f"--memory-limit {value} ({format_size(limit)}) is more than this machine lets dash-memd "
                         f"use ({format_size(usable)}, its RAM or its cgroup's limit)",
                         hint=f"give at most {format_size(usable)}; half of it is the default")
    return limit


def run(config: MemdConfig) -> int:
    """Serve until SIGTERM or SIGINT (or until ``config.parent_pid`` is gone), finish pending disk writes, and
    return the exit code."""
    from dashrun.memd.server import MemdServer

    try:
        config.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --data-dir {config.data_dir}: {e.strerror}") from None
    block_stop_signals()
    server = MemdServer(config)
    server.start()
    log.info(
        "data dir %s, memory limit %s, keep %d in RAM / %d on disk%s per job, max %d connections",
        config.data_dir, format_size(config.memory_limit), config.keep_ram, config.keep_disk,
        f" / {config.keep_object} in {config.s3}" if config.s3 else "", config.max_connections)
    signum = wait_for_stop(config.parent_pid)
    if signum == PARENT_GONE:
        log.warning("the process that started dash-memd (pid %d) is gone: shutting down", config.parent_pid)
    else:
        log.info("%s: shutting down", signal.Signals(signum).name)
    server.stop()
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> None:
    run_click(cli, PROGRAM, argv)
