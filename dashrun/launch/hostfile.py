"""The hosts of ``dashrun --hostfile``: the hostfile, and where each host is as ``ssh`` would see it.

A hostfile is DeepSpeed's and MPI's: ``HOST [slots=N]`` per line. Each host
is then resolved through the user's OpenSSH client config (HostName, Port,
User, IdentityFile, IdentitiesOnly, UserKnownHostsFile, GlobalKnownHostsFile,
ConnectTimeout) the way ``ssh HOST`` resolves it; hosts reached through a
ProxyJump or ProxyCommand are refused.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
from pathlib import Path

from dashrun.errors import UsageError

__all__ = ["CONNECT_TIMEOUT", "HOSTFILE_HINT", "Host", "SshTarget", "parse_hostfile", "read_hostfile", "ssh_targets"]

CONNECT_TIMEOUT = 15.0
HOSTFILE_HINT = "each line is 'HOST [slots=N]'; '#' starts a comment"


# --- the hostfile --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Host:
    """One line of the hostfile: an SSH host (an alias of the ssh config, or a name) and its ranks."""

    name: str
    slots: int = 1


def parse_hostfile(text: str, source: str = "hostfile") -> tuple[Host, ...]:
    """DeepSpeed/MPI hostfile: ``HOST [slots=N]`` per line; ``#`` comments and blank lines are skipped.

    A host without ``slots=`` gets 1, as in MPI.
    """
    hosts: dict[str, tuple[int, Host]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{lineno}"
        name, options = fields[0], fields[1:]
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", name):
            raise UsageError(f"{where}: {name!r} is not a host name", hint=HOSTFILE_HINT)
        slots = 1
        for option in options:
            key, sep, value = option.partition("=")
            if key != "slots" or not sep:
                raise UsageError(f"{where}: unknown field {option!r} after host {name!r}", hint=HOSTFILE_HINT)
            if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
                raise UsageError(f"{where}: slots={value} for host {name!r} is not a whole number >= 1",
                                 hint="slots is the number of ranks (usually GPUs) to start on that host")
            slots = int(value)
        if name in hosts:
            raise UsageError(f"{where}: host {name!r} is listed twice (first on line {hosts[name][0]})",
                             hint="list each host once and give it all its ranks with slots=N")
        hosts[name] = (lineno, Host(name, slots))
    if not hosts:
        raise UsageError(f"{source} lists no hosts", hint=HOSTFILE_HINT)
    return tuple(host for _, host in hosts.values())


def read_hostfile(path: str | os.PathLike) -> tuple[Host, ...]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read hostfile {path}: {getattr(e, 'strerror', None) or e}",
                         hint="--hostfile names a file with one 'HOST slots=N' per line") from None
    return parse_hostfile(text, str(path))


# --- where each host is, as ssh would see it ----------------------------------------


@dataclasses.dataclass(frozen=True)
class SshTarget:
    """How to reach one host, resolved from the ssh config like ``ssh HOST`` resolves it."""

    alias: str
    hostname: str
    port: int = 22
    user: str = ""
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()
    connect_timeout: float = CONNECT_TIMEOUT


def _known_hosts_files(option: dict, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    # As in ssh: the option replaces the default list; "none" means no file.
    value = option.get(key)
    if value is None:
        return default
    paths = value if isinstance(value, list) else value.split()
    return tuple(os.path.expanduser(p) for p in paths if p.lower() != "none")


def ssh_targets(hosts: tuple[Host, ...], ssh_config: str | None) -> tuple[SshTarget, ...]:
    """Resolve every host through the user's OpenSSH config (``~/.ssh/config`` unless ``ssh_config`` names one)."""
    import paramiko

    explicit = ssh_config is not None
    path = Path(os.path.expanduser(ssh_config or "~/.ssh/config"))
    config = paramiko.SSHConfig()
    if explicit or path.exists():
        try:
            config = paramiko.SSHConfig.from_path(str(path))
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read ssh config {path}: {getattr(e, 'strerror', None) or e}",
                             hint="--ssh-config names an OpenSSH client config file") from None
        except (paramiko.ssh_exception.ConfigParseError, ValueError) as e:
            raise UsageError(f"ssh config {path} is not valid: {e}", hint="check it with 'ssh -G HOST -F FILE'") \
                from None
    targets = []
    for host in hosts:
        option = config.lookup(host.name)
        for unsupported in ("proxyjump", "proxycommand"):
            if option.get(unsupported, "none").lower() != "none":
                raise UsageError(f"ssh config {path} reaches {host.name} through {unsupported}, which dashrun "
                                 "does not support", hint="give each host an address dashrun can connect to directly")
        try:
            port = int(option.get("port", 22))
            timeout = float(option.get("connecttimeout", CONNECT_TIMEOUT))
        except ValueError as e:
            raise UsageError(f"ssh config {path}: bad value for {host.name}: {e}", hint="Port and ConnectTimeout "
                             "are numbers") from None
        targets.append(SshTarget(
            alias=host.name,
            hostname=option.get("hostname", host.name),
            port=port,
            user=option.get("user") or getpass.getuser(),
            identity_files=tuple(os.path.expanduser(p) for p in option.get("identityfile", [])),
            identities_only=option.get("identitiesonly", "no").lower() == "yes",
            known_hosts_files=(
                _known_hosts_files(option, "globalknownhostsfile",
                                   ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"))
                + _known_hosts_files(option, "userknownhostsfile",
                                     (os.path.expanduser("~/.ssh/known_hosts"),
                                      os.path.expanduser("~/.ssh/known_hosts2")))),
            connect_timeout=timeout,
        ))
    return tuple(targets)
