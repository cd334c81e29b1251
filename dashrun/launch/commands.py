"""``dashrun resume|status|ls|export|gc|rm``: the commands beside the launcher.

Each takes ``--memd``/``--token-file`` (env twins ``DASH_MEMD``,
``DASH_TOKEN_FILE``); without ``--memd`` it uses the private dash-memd of
this machine (attaching to it while a dashrun runs, else starting it for the
length of the command). ``--json`` prints machine-readable output. Every
other option has the twin ``DASH_<COMMAND>_<OPTION>`` (``DASH_GC_KEEP``,
``DASH_STATUS_JSON``); ``--help`` shows each. Thin commands: each asks
dash-memd, prints, and lets :mod:`dashrun.util.console` render errors;
``resume`` re-runs the stored command line through
:func:`dashrun.launch.dispatch.launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Iterator

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from dashrun import env
from dashrun.errors import NotFoundError, UsageError
from dashrun.launch import costs, dispatch
from dashrun.launch.holdings_view import holdings_lines
from dashrun.launch.jobstate import job_state, node_states, restarts, steps_per_second
from dashrun.launch.status_view import age, job_notes, jobs_table, print_jobs, server_lines
from dashrun.launch.options import memd_address, require_token_file
from dashrun.launch.private_memd import PrivateMemd, resumed_home
from dashrun.util.console import LOG_FORMATS, LOG_LEVELS, setup_logging
from dashrun.util.tokens import read_token
from dashrun.util.units import format_size
from dashrun.version import __version__
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import MembershipEvent
from dashrun.wire.operator import SeenSpecs, load_public_key
from dashrun.wire.protocol import valid_job_id
from dashrun.wire.tls import TlsSettings, format_fingerprint

__all__ = ["cli", "connect", "memd_options", "tls_settings"]

console = Console()
_NO_TLS, _TLS_CA, _TLS_FINGERPRINT = "dashrun.no_tls", "dashrun.tls_ca", "dashrun.tls_fingerprint"


@contextlib.contextmanager
def connect(memd: str | None, token_file: str | None) -> Iterator[MemdClient]:
    """A client of ``--memd`` (or of the private dash-memd), with the command's TLS options."""
    tls = tls_settings()
    if memd is None:
        with PrivateMemd(attach=True, no_tls=tls.plaintext) as private, \
                MemdClient(*private.address, read_token(private.token_file), tls=tls) as c:
            yield c
        return
    require_token_file(memd, token_file)
    with MemdClient(*memd_address(memd), read_token(token_file), tls=tls) as client:
        yield client


def tls_settings() -> TlsSettings:
    """The running command's ``--no-tls``, ``--tls-ca`` and ``--tls-fingerprint`` (kept aside by
    :func:`memd_options`); UsageError for a malformed fingerprint or options that exclude each other."""
    meta = click.get_current_context().meta
    return TlsSettings.from_options(meta.get(_NO_TLS, False), meta.get(_TLS_CA), meta.get(_TLS_FINGERPRINT))


def _job(job: str) -> str:
    if job == "":  # said, and empty: a usage error, as the launcher's --job-id ""
        raise UsageError("the job id is empty", hint="name the job (dashrun status lists them)")
    if not valid_job_id(job):
        raise UsageError(f"{job!r} is not a valid job id")
    return job


def _job_param(_ctx, param, value: str | None) -> str | None:
    """A JOB argument or ``--job-id``, checked as click parses it: an empty or malformed id is a usage error (exit
    2) before anything is read or reached."""
    if value is None:
        return None
    try:
        return _job(value)
    except UsageError as e:
        raise click.BadParameter(f"{e.message}; {e.hint}" if e.hint else e.message, param=param) from None


def _version_option(command):
    return click.version_option(__version__, "--version", prog_name="dashrun", message="%(prog)s %(version)s",
                                allow_from_autoenv=False)(command)


def _keep_aside(key: str):
    def keep(ctx: click.Context, _param, value):
        ctx.meta[key] = value
    return keep


_LOG_LEVEL, _LOG_FORMAT = "dashrun.log_level", "dashrun.log_format"


def _set_up_logging(key: str):
    def set_up(ctx: click.Context, _param, value):
        ctx.meta[key] = value
        setup_logging("dashrun", ctx.meta.get(_LOG_LEVEL, "INFO"), ctx.meta.get(_LOG_FORMAT, "text"))
    return set_up


def _log_options(command):
    """``--log-level`` and ``--log-format`` (twins DASH_LOG_LEVEL, DASH_LOG_FORMAT), applied as they are parsed:
    a typo is a usage error naming the valid values."""
    command = click.option("--log-format", envvar=env.LOG_FORMAT.name, show_envvar=True, default="text",
                           show_default=True, expose_value=False, callback=_set_up_logging(_LOG_FORMAT),
                           help=f"{' or '.join(LOG_FORMATS)} (json: one object a line, for log shippers).")(command)
    return click.option("--log-level", envvar=env.LOG_LEVEL.name, show_envvar=True, default="INFO",
                        show_default=True, expose_value=False, callback=_set_up_logging(_LOG_LEVEL),
                        help=f"{', '.join(LOG_LEVELS)}.")(command)


def memd_options(command):
    """``--memd``, ``--token-file``, ``--no-tls``, ``--tls-ca``, ``--tls-fingerprint`` (their twins are dashrun's
    own) and ``--version``.

    The TLS options are kept aside in the context for :func:`connect`, rather than passed to every command.
    """
    command = _version_option(command)
    command = _log_options(command)
    command = click.option("--tls-fingerprint", envvar=env.TLS_FINGERPRINT.name, show_envvar=True, default=None,
                           expose_value=False, callback=_keep_aside(_TLS_FINGERPRINT), metavar="SHA256:...",
                           help="Talk only to the dash-memd whose certificate has this SHA-256 ('dash-memd "
                                "fingerprint' prints it); refuse any other before the login.")(command)
    command = click.option("--tls-ca", envvar=env.TLS_CA.name, show_envvar=True, default=None, expose_value=False,
                           callback=_keep_aside(_TLS_CA), type=click.Path(dir_okay=False),
                           help="Also verify dash-memd's TLS certificate chain and host name against these PEM CA "
                                "certificates.")(command)
    command = click.option("--no-tls", envvar=env.NO_TLS.name, show_envvar=True, is_flag=True, expose_value=False,
                           callback=_keep_aside(_NO_TLS),
                           help="Plaintext TCP to a dash-memd started with --no-tls (default: TLS): no encryption; "
                                "the token login and each record's MAC still hold.")(command)
    command = click.option("--token-file", envvar=env.TOKEN_FILE.name, show_envvar=True, default=None,
                           help="File with the cluster's token.")(command)
    return click.option("--memd", envvar=env.MEMD.name, show_envvar=True, default=None,
                        help="HOST:PORT of dash-memd (default: this machine's private one).")(command)


def _print_json(value) -> None:
    click.echo(json.dumps(value, indent=1, sort_keys=True))


# auto_envvar_prefix: an option without a twin of dashrun.env's gets DASH_<COMMAND>_<OPTION>
@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DASH"})
@_version_option
def cli() -> None:
    """Inspect and manage dashrun jobs (launch one with: dashrun [torchrun flags] script.py)."""


def _membership_line(event: MembershipEvent, world_before: int | None) -> str:
    """One event of a job's membership history, as ``dashrun status JOB`` prints it."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time))
    parts = [when, event.node, event.change]
    if event.why:
        parts.append(f"({event.why})")
    changed = world_before is not None and world_before != event.world  # the first nodes all join one world
    parts.append(f"world {world_before} -> {event.world}" if changed else f"world {event.world}")
    at = []
    if event.step is not None:
        at.append(f"at step {event.step}")
    if event.steps_lost is not None:
        at.append(f"{event.steps_lost} step{'' if event.steps_lost == 1 else 's'} lost")
    if at:
        parts.append(", ".join(at))
    return "  " + "  ".join(parts)


def _with_state(entry: dict, events: list[MembershipEvent], live: int | None) -> dict:
    """``entry`` (a job's summary in LIST) with its ``state``, ``restarts`` and ``steps_per_second``, from its
    membership history and its live members in dash-memd (:mod:`dashrun.launch.jobstate`)."""
    return {**entry, "state": job_state(events, live).value, "restarts": restarts(events),
            "steps_per_second": steps_per_second(entry.get("checkpoints", []))}


def _job_status(client: MemdClient, listing: dict, job: str, as_json: bool, wide: bool) -> None:
    """``dashrun status JOB``: the job's line of the table, then its membership history."""
    entry = next((j for j in listing.get("jobs", []) if j["job"] == job), None)
    events, live, held = client.fleet_view(job)
    generation = client.generation(job)
    if entry is None and not events and not generation:
        raise NotFoundError(f"dash-memd knows no job {job!r}", hint="see the jobs with: dashrun status")
    entry = {**_with_state(entry or {"job": job, "checkpoints": []}, events, live), "node_states": node_states(events)}
    if as_json:
        _print_json({**entry, "generation": generation, "membership": [event.to_body() for event in events],
                     "holdings": [dataclasses.asdict(node) for node in held]})
        return
    print_jobs(console, [entry], wide)
    if not entry.get("newest"):
        click.echo(f"{job}: no checkpoints")
    for line in holdings_lines(job, entry, held):
        click.echo(line)
    if not events:
        click.echo(f"{job}: no membership changes recorded")
        return
    click.echo(f"{job}: membership history (world generation {generation}):")
    before = None
    for event in events:
        click.echo(_membership_line(event, before))
        before = event.world


@cli.command()
@click.argument("job", required=False, callback=_job_param)
@memd_options
@click.option("--json", is_flag=True, show_envvar=True, help="Print JSON.")
@click.option("--wide", is_flag=True, show_envvar=True, help="Show every column in full, however wide the table.")
@click.option("--watch", is_flag=True, show_envvar=True,
              help="A live view of every job, asked for again every --interval seconds, until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, show_envvar=True,
              help="Seconds between the refreshes of --watch.")
@click.option("--count", type=click.IntRange(min=0), default=0, show_envvar=True,
              help="With --watch: stop after this many refreshes (0, the default: until Ctrl-C).")
def status(job, memd, token_file, json, wide, watch, interval, count) -> None:  # noqa: A002 (twin DASH_STATUS_JSON)
    """Jobs held by dash-memd: state, newest committed step, where it is, how big, how old, restarts, speed.

    A job's state is running, finished, failed, preempted or idle (see dashrun.launch.jobstate). With JOB: that
    job, and its membership history (nodes that joined, left or died, the world size, and how launches ended).
    With --watch: the jobs' view, refreshed in place (pending writes, commit latency, nodes and their state).
    """
    if watch:
        if job is not None or json:
            raise UsageError("--watch shows every job, as a table", hint="leave out JOB and --json")
        _watch(memd, token_file, interval, count)
        return
    with connect(memd, token_file) as client:
        listing = client.list(_job(job) if job is not None else None)
        if job is not None:
            _job_status(client, listing, job, json, wide)
            return
        _add_states(client, listing)
    if json:
        _print_json(listing)
        return
    for line in server_lines(client.address, listing):
        console.print(line, highlight=False)
    print_jobs(console, listing.get("jobs", []), wide)
    if listing.get("jobs_left"):
        console.print(f"... and {listing['jobs_left']} more jobs, not shown (dashrun status JOB shows one)",
                      highlight=False)


def _add_states(client: MemdClient, listing: dict) -> None:
    """Each listed job with its state, restarts, speed and nodes' states, from its membership in dash-memd."""
    # one MEMBERSHIP request per job listed: the state is the client's reading of the facts dash-memd keeps
    jobs = []
    for entry in listing.get("jobs", []):
        events, live = client.membership_view(entry["job"])
        jobs.append({**_with_state(entry, events, live), "node_states": node_states(events)})
    listing["jobs"] = jobs


def _watch(memd: str | None, token_file: str | None, interval: float, count: int) -> None:
    """``status --watch``: the view of every job, asked for again every ``interval`` s, drawn in place (rich
    Live) until Ctrl-C or ``count`` refreshes; the last one stays on the screen."""
    from rich.console import Group
    from rich.live import Live

    shown = 0
    with connect(memd, token_file) as client, Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                listing = client.list()
                _add_states(client, listing)
                shown += 1
                heading = (f"[bold]dashrun status --watch[/]: {time.strftime('%H:%M:%S')}, refresh {shown}"
                           + (f" of {count}" if count else f", every {interval:g}s (Ctrl-C to stop)"))
                parts = [heading, *server_lines(client.address, listing), jobs_table(listing.get("jobs", []))]
                parts += job_notes(listing.get("jobs", []))
                if listing.get("jobs_left"):
                    parts.append(f"... and {listing['jobs_left']} more jobs, not shown")
                live.update(Group(*parts), refresh=True)
                if count and shown >= count:
                    return
                time.sleep(interval)  # the pace of the view, not a wait for anything
        except KeyboardInterrupt:  # Ctrl-C ends the view, not with a traceback
            return


@cli.command(name="ls")
@click.argument("job", required=False, callback=_job_param)
@memd_options
@click.option("--json", is_flag=True, show_envvar=True, help="Print JSON.")
def ls(job, memd, token_file, json) -> None:  # noqa: A002
    """The committed checkpoints of JOB; without JOB, the jobs, each with its checkpoints and newest step."""
    with connect(memd, token_file) as client:
        listing = client.list(_job(job) if job is not None else None)
    if job is None:
        jobs = [{"job": j["job"], "checkpoints": len(j.get("checkpoints", [])) + j.get("checkpoints_more", 0),
                 "newest_step": j["newest"]["step"] if j.get("newest") else None} for j in listing.get("jobs", [])]
        if json:
            _print_json({"jobs": jobs, "jobs_left": listing.get("jobs_left", 0)})
            return
        table = Table()
        table.add_column("job", no_wrap=True)
        table.add_column("checkpoints")
        table.add_column("newest step")
        for j in jobs:
            table.add_row(j["job"], str(j["checkpoints"]), "-" if j["newest_step"] is None else str(j["newest_step"]))
        console.print(table)
        if listing.get("jobs_left"):
            console.print(f"... and {listing['jobs_left']} more jobs, not shown", highlight=False)
        return
    entry = next((j for j in listing.get("jobs", []) if j["job"] == job), None)
    if entry is None:
        raise NotFoundError(f"dash-memd knows no job {job!r}", hint="see the jobs with: dashrun status")
    if json:
        _print_json(entry)
        return
    table = Table("step", "state", "in", "ranks", "size", "committed")
    for checkpoint in entry["checkpoints"]:
        table.add_row(str(checkpoint["step"]), checkpoint["state"], ", ".join(checkpoint["tiers"]),
                      str(checkpoint["world"]), format_size(checkpoint["nbytes"]), age(checkpoint["committed_at"]))
    console.print(table)


@cli.command()
@click.argument("job", callback=_job_param)
@click.argument("out", type=click.Path())
@click.option("--step", type=int, default=None, show_envvar=True, help="Which committed step (default: the newest).")
@click.option("--format", type=click.Choice(["torch", "dcp"]), default="torch", show_default=True,
              show_envvar=True,
              help="torch: one file for torch.load; dcp: a directory for torch.distributed.checkpoint.load.")
@memd_options
def export(job, out, step, format, memd, token_file) -> None:  # noqa: A002 (twin DASH_EXPORT_FORMAT)
    """Write a committed checkpoint of JOB to OUT in a standard format."""
    from dashrun.launch import export as exporter

    with connect(memd, token_file) as client, Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            console=console, transient=True) as progress:
        task = progress.add_task(f"fetching {job}", total=None)
        info, state = exporter.fetch_state(client, _job(job), step,
                                           lambda done, total: progress.update(task, completed=done, total=total))
    exporter.write(state, format, Path(out))
    console.print(f"exported {job} step {info.step} ({format_size(info.nbytes)}, {info.world} ranks) to {out}")


@cli.command()
@click.argument("job", callback=_job_param)
@click.option("--keep", type=click.IntRange(min=1), required=True, show_envvar=True,
              help="Keep the newest N checkpoints.")
@memd_options
def gc(job, keep, memd, token_file) -> None:
    """Delete all but the newest KEEP checkpoints of JOB."""
    with connect(memd, token_file) as client:
        deleted = client.delete(_job(job), keep)
    console.print(f"deleted {len(deleted)} checkpoints of {job}" + (f" (steps {', '.join(map(str, deleted))})"
                                                                    if deleted else ""))


@cli.command()
@click.argument("job", callback=_job_param)
@click.option("--yes", is_flag=True, show_envvar=True, help="Do not ask first (on a terminal, rm asks).")
@click.option("--force-live", is_flag=True, show_envvar=True,
              help="Delete JOB even while nodes of it are alive (they heartbeat in its rendezvous): they lose every "
                   "checkpoint and their rendezvous.")
@memd_options
def rm(job, yes, force_live, memd, token_file) -> None:
    """Delete JOB: every checkpoint, its launch spec and its rendezvous. Refused while nodes of it are alive."""
    with connect(memd, token_file) as client:
        if not _known(client, _job(job)):
            raise NotFoundError(f"dash-memd knows no job {job!r}: nothing to remove",
                                hint="see the jobs with: dashrun ls")
        if not yes and sys.stdin.isatty() and not click.confirm(f"delete every checkpoint of {job}?"):
            raise SystemExit(1)
        deleted = client.delete(job, 0, force_live=force_live)
    console.print(f"removed {job} ({len(deleted)} checkpoints)")


def _known(client: MemdClient, job: str) -> bool:
    """Whether dash-memd holds anything of ``job``: a checkpoint, a launch spec, a membership record, a
    rendezvous."""
    if any(j["job"] == job for j in client.list(job).get("jobs", [])):
        return True
    events, live = client.membership_view(job)
    return bool(events) or live is not None or bool(client.generation(job)) or client.get_spec(job) is not None


def _shell_word(arg: str) -> str:
    """``arg`` as a shell would need it; anything unprintable shown escaped, never sent to the terminal raw."""
    return shlex.quote(arg) if arg.isprintable() else "$" + repr(arg).replace("\\'", "'")


def _command_line(argv) -> str:
    return " ".join(_shell_word(a) for a in ("dashrun", *argv))


def _print_plan(job_id: str, spec, overrides: dict) -> None:
    """What ``resume`` would run: where, the stored command line, what replaces its options, the environment."""
    click.echo(f"job {job_id}: launch spec stored from {_shell_word(spec.host)} {age(spec.created)}, "
               "signed by the operator")
    click.echo(f"would run in {_shell_word(spec.cwd)}:")
    click.echo(f"  {_command_line(spec.argv)}")
    click.echo("with these options set by resume: "
               + ", ".join(f"{name}={_shell_word(str(value))}" for name, value in overrides.items()))
    ours = [f"  {var.name}={_shell_word(os.environ[var.name])}" for var in env.ALL if var.name in os.environ]
    click.echo("environment: this shell's, in which dashrun reads" + (":" if ours else " none of its variables"))
    for line in ours:
        click.echo(line)


@cli.command()
@click.argument("job", required=False, callback=_job_param)
@click.option("--job-id", envvar=env.JOB_ID.name, show_envvar=True, default=None, callback=_job_param,
              help="The job to resume (or give it as JOB).")
@click.option("--dry-run", is_flag=True, show_envvar=True,
              help="Check the stored spec and print what would run; run nothing.")
@click.option("--operator-pubkey", envvar=env.OPERATOR_PUBKEY.name, show_envvar=True, default=None,
              type=click.Path(dir_okay=False),
              help="The operator's public key (the .pub of dash-memd keys): only a spec it signed runs. Needed "
                   "with --memd; the private dash-memd's is its own.")
@memd_options
def resume(job, job_id, dry_run, operator_pubkey, memd, token_file) -> None:
    """Relaunch JOB on this node as it was launched, from its newest committed checkpoint.

    What a replacement Spot VM runs at boot: dash-memd keeps each job's command
    line and working directory, signed with the operator's key when the job was
    launched (dashrun --operator-key); a spec whose signature does not check
    out, or that is older than one this node ran already, is never run.
    """
    if job is not None and job_id is not None and job != job_id:
        raise UsageError(f"JOB {job} and --job-id {job_id} name two jobs", hint="give one of them")
    job_id = job or job_id
    if job_id is None:
        raise UsageError("resume needs the job", hint="dashrun resume JOB (or --job-id JOB)")
    if memd is not None and operator_pubkey is None:
        raise UsageError("resume needs --operator-pubkey with --memd: it runs only what the operator signed",
                         hint=f"copy the .pub file of dash-memd keys to this node and give its path (or "
                              f"{env.OPERATOR_PUBKEY.name})")
    public = load_public_key(operator_pubkey if memd is not None
                             else PrivateMemd(attach=True).operator_pubkey)
    with connect(memd, token_file) as client:
        spec = client.get_spec(_job(job_id))
    if spec is None:
        raise NotFoundError(f"dash-memd has no launch spec of job {job_id!r}",
                            hint="a job is resumable once dashrun --operator-key has launched it against this "
                                 "dash-memd")
    # Write access to where dash-memd keeps specs (its disk, the bucket), or any credential dash-memd takes, must
    # not be enough to run a command here; nor an older spec the operator has since replaced.
    spec.verify(job_id, public)
    SeenSpecs(resumed_home()).check(job_id, spec.created, remember=not dry_run)
    tls = tls_settings()
    # A --failure-domain (--instance-type, --market) in the stored command line names the node that launched the
    # job, not this one.
    overrides = {"job_id": job_id, "fresh": False, "operator_key": None, "failure_domain": env.get(env.FAILURE_DOMAIN),
                 "instance_type": env.get(env.INSTANCE_TYPE), "market": env.get(env.MARKET),
                 "no_tls": tls.plaintext, "tls_ca": tls.ca,
                 "tls_fingerprint": format_fingerprint(tls.fingerprint) if tls.fingerprint else None}
    if memd is not None:
        overrides.update(memd=memd, token_file=token_file)
    if dry_run:
        _print_plan(job_id, spec, overrides)
        return
    try:
        os.chdir(spec.cwd)
    except OSError as e:
        raise UsageError(f"cannot enter the job's working directory {spec.cwd}: {e.strerror}",
                         hint="the new node needs the same files (image, volume) as the one that launched it") from None
    console.print(escape(f"resuming {job_id} in {_shell_word(spec.cwd)}: {_command_line(spec.argv)}"))
    raise SystemExit(dispatch.launch(list(spec.argv), overrides))



# The cost commands (sim, report) live in their own module, with this module's dash-memd options and link.
for _command in costs.commands(memd_options, connect, _job_param):
    cli.add_command(_command)
