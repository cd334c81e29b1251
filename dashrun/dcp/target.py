"""Which job and step a :mod:`dashrun.dcp` Writer or Reader names, and how it reaches dash-memd.

:class:`Target` holds plain values only (the job, dash-memd's address, the
token file, TLS settings, the node's dash-agent socket), found from the
arguments, else from dashrun's environment (``DASH_JOB_ID``, ``DASH_MEMD``,
``DASH_TOKEN_FILE``, ``DASH_NO_TLS``, ``DASH_TLS_CA``, ``DASH_AGENT_SOCKET``),
so that a Writer pickles. :class:`Connected` is what the Writer and the Reader
share: the target, the step, and a connection to dash-memd made on first use
and never pickled (DCP's process-based ``async_save`` pickles the writer).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from dashrun import env
from dashrun.errors import UsageError
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.protocol import MAX_STEP, valid_job_id
from dashrun.wire.tls import TlsSettings

__all__ = ["Connected", "Target", "step_of"]


def step_of(checkpoint_id: Any) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a string or path whose last run of digits is the step
    (``1200``, ``"step-1200"``, ``"/ckpt/step_1200"``)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        step = checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        digits = re.findall(r"\d+", os.fspath(checkpoint_id))
        step = int(digits[-1]) if digits and len(digits[-1]) <= 16 else -1
    else:
        step = -1
    if not 0 <= step <= MAX_STEP:
        raise UsageError(f"checkpoint_id {checkpoint_id!r} names no step of a dashrun checkpoint",
                         hint="pass the step: checkpoint_id=1200, or a name ending in it such as 'step-1200'")
    return step


@dataclasses.dataclass(frozen=True)
class Target:
    """Which job, and how to reach dash-memd: plain values only, so that a Writer pickles."""

    job: str
    memd: tuple[str, int] | None
    token_file: str | None
    tls: TlsSettings
    agent_socket: str | None  # the node's dash-agent (a Writer under dashrun), used unless memd= was given
    generation: int

    @classmethod
    def resolve(cls, who: str, job: str | None, memd: str | tuple[str, int] | None, token_file: Any,
                tls: TlsSettings | None, use_agent: bool) -> Target:
        job = job or env.get(env.JOB_ID)
        if not job:
            raise UsageError(f"dashrun.dcp.{who} needs a job", hint="pass job=..., or run under dashrun "
                             f"({env.JOB_ID.name} names the running job)")
        if not valid_job_id(job):
            raise UsageError(f"{job!r} is not a valid job id")
        agent = env.get(env.AGENT_SOCKET) if use_agent and memd is None else None
        address = memd if memd is not None else env.get(env.MEMD)
        if isinstance(address, str):
            address = parse_address(address, default_port=env.DEFAULT_PORT, what="memd")
        token_file = os.fspath(token_file) if token_file is not None else env.get(env.TOKEN_FILE)
        if agent is None and (address is None or token_file is None):
            raise UsageError(f"dashrun.dcp.{who} does not know how to reach dash-memd",
                             hint=f"pass memd='HOST:PORT' and token_file=..., or set {env.MEMD.name} and "
                                  f"{env.TOKEN_FILE.name}" + (", or run under dashrun" if use_agent else ""))
        if tls is None:
            tls = TlsSettings.from_env()
        generation = env.get(env.GENERATION, "0")
        return cls(job, tuple(address) if address is not None else None, token_file, tls, agent,
                   int(generation) if generation.isdigit() else 0)

    def client(self) -> MemdClient:
        return MemdClient(*self.memd, read_token(self.token_file, warn=False), tls=self.tls)  # the launcher warned


class Connected:
    """What Writer and Reader share: their target, their step, and a live connection made on first use, never
    pickled (DCP's process-based async_save pickles us)."""

    _target: Target
    step: int | None
    _client: MemdClient | None = None
    _owns_client = True

    @property
    def job(self) -> str:
        return self._target.job

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.step is None else f"dashrun:{self.job}/{self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            step_of(checkpoint_id)
        except UsageError:
            return False
        return True

    def _memd(self) -> MemdClient:
        if self._client is None:
            self._client = self._target.client()
            self._owns_client = True
        return self._client

    def close(self) -> None:
        """Close the connection (a later call connects again)."""
        if self._client is not None and self._owns_client:
            self._client.close()
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._UNPICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
