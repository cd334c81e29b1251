"""Every launch option's value checked before anything starts, torchrun's and dashrun's, on both launch paths.

A bad value is a UsageError: one line and exit 2, never torch's traceback
half-way into a launch. What only a node can tell (its devices, its CA
file) is :func:`dashrun.launch.options.options_from_args`'s to check.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import urllib.parse
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from dashrun.env import DEFAULT_PORT
from dashrun.errors import UsageError
from dashrun.launch.placement import parse_agent_cpus
from dashrun.util.units import format_size, parse_address, parse_size
from dashrun.wire.domain import MARKETS, FailureDomain, parse_instance_type
from dashrun.wire.tls import TlsSettings

__all__ = ["check_values", "max_nodes", "memd_address", "nnodes_range"]

#: What ``--nproc-per-node`` may name instead of a number: torch counts that kind of device (or the CPUs) itself.
_NPROC_KINDS = ("auto", "cpu", "gpu", "xpu")
#: ``--rdzv-conf`` keys that torch's rendezvous backends (and dashrun's) read as whole numbers, all counts or
#: seconds >= 1, and the ones they read as booleans (spelled as torch's ``RendezvousParameters.get_as_bool`` reads
#: them). Other keys are a backend's own, passed on unread.
_RDZV_COUNTS = frozenset({"join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "timeout",
                          "read_timeout", "keep_alive_interval", "keep_alive_max_attempt"})
_RDZV_FLAGS = frozenset({"is_host"})
_BOOLEANS = frozenset({"1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"})
#: Rendezvous backends torch's registry has without plugins, and dashrun's own (``dashrun.launch.rendezvous``
#: imports this module, so its name is spelled here).
_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2", "dashrun")


def memd_address(value: str) -> tuple[str, int]:
    return parse_address(value, default_port=DEFAULT_PORT, what="--memd")


def nnodes_range(value: str) -> tuple[int, int]:
    """``--nnodes`` (``N`` or ``MIN:MAX``, read as torch reads it) as (MIN, MAX); UsageError unless
    1 <= MIN <= MAX (torch's launcher stops on an assertion there)."""
    parts = value.split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        low = high = 0
    if len(parts) > 2 or not 1 <= low <= high:
        raise UsageError(f"--nnodes {value!r} is not N or MIN:MAX with 1 <= MIN <= MAX",
                         hint="the number of nodes, e.g. 2, or an elastic job's range, e.g. 2:4")
    return low, high


def max_nodes(args: argparse.Namespace) -> int:
    """The most nodes ``--nnodes`` (``N`` or ``MIN:MAX``) allows."""
    return nnodes_range(args.nnodes)[1]



def replicas_of(args: argparse.Namespace) -> int:
    """``--replicas``, or its default (1 on two nodes or more, 0 on one), checked: R copies need R other nodes."""
    others = max_nodes(args) - 1
    if args.replicas is None:
        return min(1, others)
    _whole(args.replicas, "--replicas", "the number of other nodes that keep a copy of each node's snapshot", 0)
    if args.replicas > others:
        raise UsageError(f"--replicas {args.replicas} needs {args.replicas} other nodes to hold each node's copies, "
                         f"and --nnodes {args.nnodes} gives a node {others} other{'' if others == 1 else 's'} at most",
                         hint=f"give --replicas 0 to {others}" if others else "give --replicas 0 on one node")
    return args.replicas


def _bad(option: str, value, why: str, hint: str) -> NoReturn:
    raise UsageError(f"{option} {value!r} {why}", hint=hint)


def _whole(value: int | None, option: str, hint: str, low: int, high: int | None = None) -> None:
    if value is not None and not (low <= value and (high is None or value <= high)):
        _bad(option, value, f"is not a whole number {f'>= {low}' if high is None else f'from {low} to {high}'}", hint)


def _seconds(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        _bad(option, value, "is not a number of seconds >= 0", hint=f"give {option} seconds, e.g. 5 or 0.5")


def _nproc_per_node(value: str) -> None:
    import torch

    # A device plugin loaded with torch (its PrivateUse1 backend, e.g. Ascend's torch.npu) names its own kind, and
    # torch's launcher counts its devices as it counts GPUs.
    if value in _NPROC_KINDS or (value == torch._C._get_privateuse1_backend_name() and hasattr(torch, value)):
        return
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        _bad("--nproc-per-node", value, f"is not a number of ranks >= 1, nor one of {', '.join(_NPROC_KINDS)}",
             hint="the ranks to start on each node, e.g. 2, or gpu for one per GPU")


def _rdzv_conf(value: str) -> None:
    """``KEY=VALUE,...``, split as torch's ``_parse_rendezvous_config`` splits it (a private helper: not called),
    with the values torch's backends read as numbers or booleans checked as they will read them."""
    if not value.strip():
        return
    hint = "write it as KEY=VALUE,KEY=VALUE, e.g. join_timeout=900,read_timeout=60"
    for item in value.split(","):
        key, _, setting = (part.strip() for part in item.partition("="))
        if not key or not setting:
            raise UsageError(f"--rdzv-conf {value!r}: {item.strip()!r} is not KEY=VALUE", hint=hint)
        if key in _RDZV_COUNTS and not (setting.isdigit() and int(setting) >= 1):
            raise UsageError(f"--rdzv-conf {value!r}: {key} is {setting!r}, not a whole number >= 1", hint=hint)
        if key in _RDZV_FLAGS and setting.lower() not in _BOOLEANS:
            raise UsageError(f"--rdzv-conf {value!r}: {key} is {setting!r}, not a boolean", hint=f"{key}=1 or {key}=0")


def _endpoint(option: str, value: str, hint: str) -> None:
    """``HOST[:PORT]`` as torch's rendezvous reads it (host a name or an address, port 0-65535)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        parse_rendezvous_endpoint(value, default_port=0)
    except ValueError:
        _bad(option, value, "is not a host name or address (with :PORT, a port 0-65535)", hint=hint)


def _std(option: str, value: str) -> None:
    from torch.distributed.elastic.multiprocessing import Std

    try:
        Std.from_str(value)
    except ValueError:
        _bad(option, value, "is not a stream mask", hint="0 none, 1 stdout, 2 stderr, 3 both; for some local "
                                                         "ranks only, RANK:MASK,... e.g. 0:3,1:2")


def _local_ranks_filter(value: str) -> None:
    if value and not all(rank.strip().isdigit() for rank in value.split(",")):
        _bad("--local-ranks-filter", value, "is not a list of local ranks", hint="a comma-separated list, e.g. 0,1")


def _log_dir(value: str | None) -> None:
    """A directory (or os.devnull: no logs), or one that can be made: torch makes it while it builds the launch."""
    if not value or value == os.devnull:
        return
    path = Path(value).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        _bad("--log-dir", value, "is not a directory", hint="give a directory for the ranks' log files")
    if existing != path and not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        _bad("--log-dir", value, f"cannot be made in {existing}", hint="give a directory for the ranks' log files")


def _signals(value: str) -> None:
    # torch's launcher looks each name up in the signal module and only warns (with a traceback) at one it cannot
    # handle; SIGKILL and SIGSTOP cannot be handled at all, and would stop it with OSError.
    for name in value.split(","):
        if name.strip() not in signal.Signals.__members__ or name.strip() in ("SIGKILL", "SIGSTOP"):
            raise UsageError(f"--signals-to-handle {value!r}: {name.strip()!r} is not a signal this launcher can "
                             "handle", hint="a comma-separated list of signal names, e.g. SIGTERM,SIGINT,SIGUSR1")


def _event_log_handler(value: str) -> None:
    from torch.distributed.elastic.events.handlers import get_logging_handler

    try:
        get_logging_handler(value)
    except KeyError:
        _bad("--event-log-handler", value, "is not an event handler of torch's", hint="null, console or "
             "dynamic_rendezvous")


def _logs_specs(value: str | None) -> None:
    if value is not None and not metadata.entry_points(group="torchrun.logs_specs", name=value):
        _bad("--logs-specs", value, "names no installed torchrun.logs_specs entry point",
             hint="drop it for torch's own log files, or install the package that provides it")


def _rdzv_backend(value: str) -> None:
    if value not in _RDZV_BACKENDS and not metadata.entry_points(group="torchrun.handlers", name=value):
        _bad("--rdzv-backend", value, "is not a rendezvous backend", hint=f"one of {', '.join(_RDZV_BACKENDS)}, "
             "or one a torchrun.handlers plugin installs")


def _metadata_endpoint(value: str | None) -> None:
    """A base URL, http or https (``HOST[:PORT]`` means http), as dash-agent's pollers read it."""
    if not value:
        return
    url = urllib.parse.urlsplit(value.strip() if "://" in value else f"http://{value.strip()}")
    try:
        usable = url.scheme in ("http", "https") and bool(url.hostname) and (url.port is None or url.port >= 0)
    except ValueError:  # a port that is not a number from 0 to 65535
        usable = False
    if not usable:
        _bad("--metadata-endpoint", value, "is not an http(s) URL",
             hint="the metadata service's base URL, e.g. http://169.254.169.254")


def check_values(args: argparse.Namespace) -> None:
    """Every option's value, torchrun's and dashrun's, checked before anything starts (by both launch paths,
    first): a bad one is a UsageError, one line and exit 2, never torch's traceback half-way into a launch.

    What only this node can tell (its devices, its CA file) is :func:`options_from_args`'s to check.
    """
    nnodes_range(args.nnodes)
    _nproc_per_node(args.nproc_per_node)
    _rdzv_backend(args.rdzv_backend)
    if args.rdzv_endpoint:
        _endpoint("--rdzv-endpoint", args.rdzv_endpoint, hint="write it as HOST:PORT, e.g. 10.0.0.5:29400")
    _rdzv_conf(args.rdzv_conf)
    _whole(args.max_restarts, "--max-restarts", "how often the ranks start again after a failure: 0 or more", 0)
    _seconds(args.monitor_interval, "--monitor-interval")
    _event_log_handler(args.event_log_handler)
    if args.module and args.no_python:
        raise UsageError("-m and --no-python exclude each other: -m runs a module with python",
                         hint="drop one of them")
    _log_dir(args.log_dir)
    _std("--redirects", args.redirects)
    _std("--tee", args.tee)
    _local_ranks_filter(args.local_ranks_filter)
    _whole(args.node_rank, "--node-rank", "this node's number in a static rendezvous, from 0", 0)
    if args.rdzv_backend == "static" and not args.standalone and args.node_rank >= max_nodes(args):
        _bad("--node-rank", args.node_rank, f"is not below the number of nodes ({max_nodes(args)})",
             hint="number the nodes 0 to N-1 for a static rendezvous")
    _endpoint("--master-addr", args.master_addr, hint="the host name or address of node 0, e.g. 10.0.0.5")
    _whole(args.master_port, "--master-port", "the TCP port of node 0's store, e.g. 29500", 0, 65535)
    _logs_specs(args.logs_specs)
    _signals(args.signals_to_handle)
    _whole(args.shutdown_timeout, "--shutdown-timeout", "seconds the ranks get to stop before SIGKILL, e.g. 30", 0)
    # dashrun's (--job-id, --hostfile and --token-file are checked where they are read)
    if args.memd is not None:
        memd_address(args.memd)
    _metadata_endpoint(args.metadata_endpoint)
    _seconds(args.poll_interval, "--poll-interval")
    if args.failure_domain:
        FailureDomain.parse(args.failure_domain)
    parse_instance_type(args.instance_type)
    if args.market is not None and args.market not in MARKETS:  # its env twin's value; argparse checks the option's
        _bad("--market", args.market, f"is not one of {', '.join(MARKETS)}", "spot for a Spot VM, on-demand else")
    replicas_of(args)
    _whole(args.peer_port, "--peer-port", "a TCP port, e.g. 7071 (0: any free one)", 0, 65535)
    if args.peer_memory_limit is not None:
        try:
            limit = parse_size(args.peer_memory_limit)
        except UsageError as e:
            raise UsageError(f"--peer-memory-limit: {e.message}", hint=e.hint) from None
        import psutil

        ram = psutil.virtual_memory().total
        if limit > ram:
            raise UsageError(f"--peer-memory-limit {args.peer_memory_limit} is more than this node's "
                             f"{format_size(ram)} of RAM", hint="give dash-agent's copies a part of the node's RAM")
    _seconds(args.memd_wait, "--memd-wait")
    parse_agent_cpus(args.agent_cpus)
    TlsSettings.from_options(args.no_tls, args.tls_ca, args.tls_fingerprint)

