"""The peer link's client: send a replica to another agent of the job, read a byte range of one back.

dash-agent sends its node's replicas with it and fills a node's restore
image from other agents' copies; the only rank of a node reads the
replicated state of a checkpoint its own agent does not hold straight from
the agents that do (:func:`peers_from_env`, :mod:`dashrun.rank.direct`).

One connection (TLS, the login with the job's credential, sealed records:
:mod:`dashrun.agent.peers.server`), requests one at a time, reconnecting on
the next request after the connection broke. The link is always TLS, also
where the link to dash-memd runs with ``--no-tls``: nothing there asks for
plaintext between nodes.

What a reader gets is checked before it is used: every byte received is
checked against the frame's CRC-32C trailer, which the holder takes from the
shard's marks (the CRC-32C of the bytes as they arrived there, checked
against the header's crc then: :mod:`dashrun.wire.blocks`), not from the bytes
it sends; a whole shard's CRC-32C must moreover be the one asked for. So a
byte changed in transit or in the holder's memory raises ChecksumError here.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from dashrun import env
from dashrun.errors import ChecksumError, DashError, ProtocolError
from dashrun.wire.channel import Channel
from dashrun.wire.credentials import Credential
from dashrun.wire.link import Link
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import MAX_BYTES, Kind
from dashrun.wire.tls import TlsSettings
from dashrun.util.tokens import read_token

__all__ = ["PeerClient", "peers_from_env"]

log = logging.getLogger(__name__)


class PeerClient(Link):
    """A client of the agent at ``host:port``, logged in with ``credential`` (a job's)."""

    what = "the peer dash-agent"
    #: a checksum failure mid-frame leaves the link out of step too: a fresh one next time
    drop_on = (*Link.drop_on, ChecksumError)

    def __init__(self, host: str, port: int, credential: Credential, *, tls: TlsSettings = TlsSettings(),
                 timeout: float = 60.0, connect_timeout: float = 5.0):
        if credential.job is None:
            raise ValueError("the peer link needs a job's credential")
        # never plaintext: see the module's text
        super().__init__(host, port, credential.file_bytes().strip(), timeout=timeout,
                         connect_timeout=connect_timeout, tls=TlsSettings() if tls.plaintext else tls)
        self.credential = credential

    def ping(self) -> None:
        self._request(lambda ch: ch.call(Kind.PING))

    def put_replica(self, header: ShardHeader, owner: str, views: Sequence[memoryview | bytes],
                    committed: int | None = None) -> int:
        """Send a whole shard of ``owner`` (``header.crc`` set: the holder checks the bytes against it), and the
        newest step of the job ``owner`` knows ``committed``; returns the CRC-32C the holder verified.
        NoSpaceError if it cannot hold it."""
        def run(ch: Channel) -> int:
            body = {"shard": header.to_body(), "owner": owner, "committed": committed}
            ch.call(Kind.REPLICA_PUT, body)  # room, or NoSpaceError before a byte is sent
            reply = ch.call(Kind.REPLICA_PUT, {}, data=views)
            if reply.body.get("crc") != header.crc:
                raise ProtocolError("the holder answered a replica with another checksum")
            return header.crc
        return self._request(run)

    def data_status(self, url: str | None = None) -> dict:
        """What the node's data cache holds, per source, as its agent answers it (unchecked: see
        :func:`dashrun.data.objects.check_summary`)."""
        return self._request(lambda ch: ch.call(Kind.DATA_STATUS, {"url": url}).body)

    def get_into(self, job: str, step: int, rank: int, crc: int, offset: int, views: Sequence[memoryview]) -> None:
        """Bytes ``[offset, offset + len(views))`` of the held shard ``(job, step, rank)`` of CRC-32C ``crc``
        into ``views``, checked (see the module's text); NotFoundError if the peer does not hold it."""
        length = sum(len(v) for v in views)

        def run(ch: Channel) -> None:
            ch.send(Kind.REPLICA_GET, {"job": job, "step": step, "rank": rank, "crc": crc, "offset": offset,
                                       "length": length})
            reply = ch.expect_reply(max_data=min(length, MAX_BYTES))
            nbytes = reply.body.get("nbytes")
            if reply.data_len != length or type(nbytes) is not int or offset + length > nbytes:
                raise ProtocolError(f"the peer answered {reply.data_len} bytes for {length} asked")
            got = ch.recv_data_into(reply, views)
            if offset == 0 and length == nbytes and got != crc:
                raise ChecksumError(f"{job} step {step}, rank {rank}'s shard from {self.address} is not the one "
                                    f"asked for (CRC-32C {got:#010x}, not {crc:#010x})")
        self._request(run)


def peers_from_env(job: str) -> Callable[[tuple[str, str, int]], PeerClient] | None:
    """New clients of a peer (node, host, port) of ``job``, logged in with the job's credential as the
    launcher hands it to the ranks (``DASH_TOKEN_FILE``); None where it does not, or it cannot be read."""
    token_file = env.get(env.TOKEN_FILE)
    if not token_file:
        return None
    try:
        credential = Credential.parse(read_token(token_file, warn=False)).for_job(job)
    except (DashError, OSError, ValueError) as e:
        log.warning("dashrun: cannot log in to the job's peers with %s=%s (%s)", env.TOKEN_FILE.name, token_file, e)
        return None
    return lambda peer: PeerClient(peer[1], peer[2], credential)
