"""``dashrun data stage|status|clear``: the node's data set cache (dashrun.data), ahead of a job and after it.

``stage URL`` lists the source (or takes the stored listing) and caches every
object on this node, with a progress bar; ``status`` tells what this node's
cache holds, per source (``--json`` for machines); ``clear`` removes entries
that no process holds. ``status --job JOB`` asks each node of the job,
through its dash-agent, what its cache holds. Each takes ``--data-cache``/``--data-cache-limit``
(twins ``DASH_DATA_CACHE``, ``DASH_DATA_CACHE_LIMIT``) and, to share listings
with the cluster, ``--memd``/``--token-file``; without ``--memd`` the listing
is this node's alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import sys
from typing import Iterator

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dashrun import env
from dashrun.data.files import CachedFiles, cache_from_env
from dashrun.data.objects import check_summary, summary
from dashrun.data.peers import MemdListings
from dashrun.data.sources import normal_url
from dashrun.launch.commands import connect, memd_options
from dashrun.util.units import format_size

__all__ = ["data"]

console = Console(stderr=True)


def cache_options(command):
    command = click.option("--data-cache-limit", envvar=env.DATA_CACHE_LIMIT.name, show_envvar=True, default=None,
                           metavar="SIZE", help="Bytes the cache may hold, like 500GiB.")(command)
    return click.option("--data-cache", envvar=env.DATA_CACHE.name, show_envvar=True, default=None, metavar="DIR",
                        help="The node's data cache (default ~/.cache/dashrun/data).")(command)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DASH_DATA"})
def data() -> None:
    """The node's data set cache (docs/data.md)."""


@contextlib.contextmanager
def _listings(memd: str | None, token_file: str | None) -> Iterator[MemdListings | None]:
    if memd is None:
        yield None
        return
    with connect(memd, token_file) as client:
        yield MemdListings(lambda: client)


@data.command()
@click.argument("url")
@cache_options
@memd_options
@click.option("--refresh", is_flag=True, show_envvar=True, help="List the source again (notices changed objects).")
@click.option("--verify", is_flag=True, show_envvar=True,
              help="Rehash the source's cached objects first; those that do not match are fetched again.")
@click.option("--workers", type=click.IntRange(1, 256), default=16, show_default=True, show_envvar=True,
              help="Objects fetched at once.")
def stage(url, data_cache, data_cache_limit, memd, token_file, refresh, verify, workers) -> None:
    """Cache every object of URL (s3://bucket/prefix/, a directory, https://host/manifest.json) on this node."""
    with _listings(memd, token_file) as remote:
        with CachedFiles(url, cache_dir=data_cache, limit=data_cache_limit, refresh=refresh, workers=workers,
                         remote=remote, providers=[("dash-memd", remote)] if remote else []) as files:
            if verify:
                bad = files.cache.verify(files.url)
                if bad:
                    console.print(f"{len(bad)} cached objects failed their SHA-256 and are fetched again")
            total = files.listing.nbytes
            columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
            with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
                task = progress.add_task(f"staging {len(files)} objects", total=total)
                futures = {files.prefetch([key])[0]: files.info(key).size for key in files.keys()}
                for future in cf.as_completed(futures):
                    future.result()
                    progress.advance(task, futures[future])
            fetched = sum(files.fetched.values())
    print(f"{files.url}: {len(files)} objects, {format_size(total)} cached in {files.cache.root} "
          f"({fetched} fetched, {len(files) - fetched} already there)")


@data.command()
@click.argument("url", required=False)
@cache_options
@memd_options
@click.option("--job", "job_id", default=None, metavar="JOB",
              help="Ask every node of JOB, through its dash-agent, instead of this node's cache (needs --memd).")
@click.option("--json", "as_json", is_flag=True, show_envvar=True, help="Print JSON.")
def status(url, data_cache, data_cache_limit, memd, token_file, job_id, as_json) -> None:
    """What this node's data cache holds, per source (or of URL alone); with --job, what each node's holds."""
    wanted = normal_url(url) if url else None
    if job_id is not None:
        _job_status(job_id, wanted, memd, token_file, as_json)
        return
    report = summary(cache_from_env(data_cache, data_cache_limit), wanted)
    if as_json:
        click.echo(json.dumps(report, indent=1, sort_keys=True))
        return
    _print_summary(report, "")


def _print_summary(report: dict, indent: str) -> None:
    click.echo(f"{indent}{report['cache']}: {format_size(report['used_bytes'])} of "
               f"{format_size(report['limit_bytes'])}")
    if not report["sources"]:
        click.echo(f"{indent}  no objects cached")
    for held in report["sources"]:
        listed = (f" of {held['listed_objects']} listed ({format_size(held['listed_bytes'])})"
                  if "listed_objects" in held else "")
        click.echo(f"{indent}  {held['url']}: {held['objects']} objects, {format_size(held['bytes'])}{listed}")


def _job_status(job_id: str, url: str | None, memd: str | None, token_file: str | None, as_json: bool) -> None:
    """Each node of ``job_id`` whose agent serves the others (a job with replicas): its cache's summary."""
    from dashrun.errors import DashError, UsageError
    from dashrun.wire.credentials import Credential
    from dashrun.wire.peer_client import PeerClient
    from dashrun.util.tokens import read_token

    if memd is None:
        raise UsageError("--job needs --memd: dash-memd's fleet view names the job's nodes",
                         hint="give --memd HOST:PORT and --token-file FILE")
    with connect(memd, token_file) as client:
        views = [view for view in client.fleet_view(job_id)[2] if view.port]
    credential = Credential.parse(read_token(token_file)).for_job(job_id)
    nodes = []
    for view in views:
        try:
            with PeerClient(view.host, view.port, credential, timeout=30) as peer:
                nodes.append({"node": view.node, **check_summary(peer.data_status(url))})
        except (DashError, OSError) as e:
            nodes.append({"node": view.node, "error": str(e)})
    if as_json:
        click.echo(json.dumps({"job": job_id, "nodes": nodes}, indent=1, sort_keys=True))
        return
    if not nodes:
        click.echo(f"{job_id}: no node's agent serves the others (a job of one node, or --replicas 0)")
    for node in nodes:
        click.echo(f"{node['node']}:")
        if "error" in node:
            click.echo(f"  not answering: {node['error']}")
        else:
            _print_summary(node, "  ")


@data.command()
@click.argument("url", required=False)
@cache_options
@click.option("--yes", is_flag=True, show_envvar=True, help="Do not ask first (on a terminal, clear asks).")
def clear(url, data_cache, data_cache_limit, yes) -> None:
    """Remove this node's cached objects (of URL alone, if given) that no process is reading."""
    cache = cache_from_env(data_cache, data_cache_limit)
    what = normal_url(url) if url else None
    if not yes and sys.stdin.isatty() and not click.confirm(f"remove the cached objects of {what or 'every source'} "
                                                            f"from {cache.root}?"):
        return
    count, nbytes = cache.clear(what)
    print(f"removed {count} objects, {format_size(nbytes)}, from {cache.root}")
