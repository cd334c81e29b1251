"""The login on every link: both sides prove they hold the key of a credential, on this very connection.

Challenge-response with HMAC-SHA256, the client speaking first::

    client -> HELLO   {nonce: Nc, job: J}            (J only with a job's credential)
    server -> HELLO   {server, id: I, nonce: Ns}
    client -> AUTH    {mac: HMAC(K, "dash-client" | B | I | J | Ns | Nc)}
    server -> WELCOME {mac: HMAC(K, "dash-server" | B | I | J | Nc | Ns)}   (or ERROR unauthorized)

``K`` is the cluster's token, or with ``J`` that job's key, which dash-memd
derives from the token (:mod:`dashrun.wire.credentials`): a connection logged
in with a job's credential is bound to that job, and dash-memd refuses it
everything of any other (:mod:`dashrun.memd.scope`). A server that holds only
one job's credential (a dash-agent on the peer link) names the key of a login's
job through a function of its own, which refuses every other job and the
cluster's token. ``I`` is dash-memd's id,
kept in its data dir, so the login names the daemon it is with. ``B`` is the
channel binding (:mod:`dashrun.wire.tls`): SHA-256 of dash-memd's TLS
certificate as each side sees it (32 zero bytes when both run with
``--no-tls``). The key never crosses the wire, a recorded exchange cannot be
replayed (fresh nonces), the client learns that the server holds the key too,
and a relay that terminates TLS on both sides makes the two sides sign
different certificates, so it cannot log in. Until the login is done a peer
may send at most ``MAX_BODY_PREAUTH`` bytes of body.

Both ends then go on in records keyed from the key and the two nonces
(:mod:`dashrun.wire.sealed`): over TLS they close TLS and seal each record;
with ``--no-tls`` each record is signed, so that what follows the login cannot
be altered or injected on the path either.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Callable

from dashrun import errors
from dashrun.errors import AuthError, ProtocolError
from dashrun.wire.channel import Channel
from dashrun.wire.credentials import Credential, job_key
from dashrun.wire.protocol import MAX_BODY_PREAUTH, Kind, field_digest, field_job, field_nonce, field_str
from dashrun.wire.sealed import after_login
from dashrun.wire.tls import mismatch, peer_binding

__all__ = ["KeyFor", "client_handshake", "one_job", "server_handshake"]

_AUTH_HINT = ("check --token-file on both sides; if they hold the same token, something on the path between them "
              "intercepts TLS")


#: Longest id a dash-memd may name itself by in its HELLO.
MAX_SERVER_ID = 64


def _context(binding: bytes, server_id: str, job: str | None) -> bytes:
    """What both MACs sign besides the nonces: the certificate, the daemon and the job (ids never hold NUL)."""
    return binding + b"\x00" + server_id.encode() + b"\x00" + (job or "").encode()


def _mac(key: bytes, label: bytes, context: bytes, first: str, second: str) -> str:
    return hmac.new(key, label + context + bytes.fromhex(first) + bytes.fromhex(second), "sha256").hexdigest()


#: The key a login for a job (None: with the cluster's token) must prove it holds; AuthError if the server admits
#: no login for it.
KeyFor = Callable[[str | None], bytes]


def _from_token(token: bytes) -> KeyFor:
    """dash-memd's keys: the token itself, or any job's key derived from it."""
    return lambda job: token if job is None else job_key(token, job)


def one_job(credential: Credential) -> KeyFor:
    """The keys of a server that holds one job's ``credential`` alone: that job's; any other login is refused."""
    def key_for(job: str | None) -> bytes:
        if job is None or job != credential.job:
            raise AuthError("this server admits logins with its own job's credential only")
        return credential.key
    return key_for


def server_handshake(ch: Channel, token: bytes | KeyFor, server_name: str, binding: bytes,
                     admit: Callable[[], None] | None = None, server_id: str = "") -> str | None:
    """Run the server side; returns the job the connection is bound to (None: the cluster's token logged in).
    Raises AuthError (after telling the client) if it lacks the key it claims, or if ``token`` admits no login
    for its job.

    ``token``: the cluster's token (every job's key is derived from it), or a :data:`KeyFor` function.
    ``binding``: the SHA-256 of this server's own certificate (``tls.BINDING_PLAIN`` without TLS).
    ``admit``: called once the client proved it holds the key, before it is welcomed; what it raises
    (BusyError) is the client's answer in place of WELCOME, for the caller to send.
    ``server_id``: this dash-memd's lasting id, which the login names.
    """
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    if hello.kind != Kind.HELLO:
        raise ProtocolError("expected HELLO")
    client_nonce = field_nonce(hello.body, "nonce")
    job = field_job(hello.body) if hello.body.get("job") is not None else None
    key_for = _from_token(token) if isinstance(token, bytes) else token
    try:
        key = key_for(job)
    except AuthError as refused:  # refused at once: no exchange can succeed
        ch.send_error(refused)
        raise
    context = _context(binding, server_id, job)
    server_nonce = secrets.token_hex(32)
    ch.send(Kind.HELLO, {"server": server_name, "id": server_id, "nonce": server_nonce})
    frame = ch.recv(max_body=MAX_BODY_PREAUTH)
    if frame.kind != Kind.AUTH:
        raise ProtocolError("expected AUTH")
    mac = field_digest(frame.body, "mac")
    if not hmac.compare_digest(mac, _mac(key, b"dash-client", context, server_nonce, client_nonce)):
        held = "this cluster's token" if job is None else f"the credential of job {job} under this cluster's token"
        err = AuthError(f"authentication failed: the client does not hold {held}")
        ch.send_error(err)
        raise err
    if admit is not None:
        admit()
    ch.send(Kind.WELCOME, {"mac": _mac(key, b"dash-server", context, client_nonce, server_nonce)})
    _seal(ch, key, binding, client_nonce, server_nonce, client=False)
    return job


def client_handshake(ch: Channel, token: bytes, address: str | None = None) -> dict[str, Any]:
    """Run the client side on a connection from :func:`dashrun.wire.tls.connect`; returns the server's HELLO.

    ``token``: what the token file holds, the cluster's token or a job's credential
    (:class:`dashrun.wire.credentials.Credential`). ``address`` (HOST:PORT) names the server in errors.
    """
    credential = Credential.parse(token)
    binding = peer_binding(ch.sock)
    client_nonce = secrets.token_hex(32)
    ch.send(Kind.HELLO, {"nonce": client_nonce, **({} if credential.job is None else {"job": credential.job})})
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    if hello.kind == Kind.ERROR:
        if hello.body.get("tls") is True:  # we spoke plaintext to a dash-memd that speaks TLS
            raise mismatch(address or _peer(ch), server_tls=True)
        raise errors.from_code(str(hello.body.get("code", "")), str(hello.body.get("message", "")))
    if hello.kind != Kind.HELLO:
        raise ProtocolError("expected HELLO from the server")
    server_nonce = field_nonce(hello.body, "nonce")
    server_id = field_str(hello.body, "id", MAX_SERVER_ID) if hello.body.get("id") is not None else ""
    context = _context(binding, server_id, credential.job)
    key = credential.key
    ch.send(Kind.AUTH, {"mac": _mac(key, b"dash-client", context, server_nonce, client_nonce)})
    try:
        reply = ch.expect_reply()
    except AuthError as e:
        raise AuthError(e.message, hint=_AUTH_HINT) from None
    if reply.kind != Kind.WELCOME or not hmac.compare_digest(
            field_digest(reply.body, "mac"), _mac(key, b"dash-server", context, client_nonce, server_nonce)):
        raise AuthError("the server does not hold this cluster's token", hint=_AUTH_HINT)
    _seal(ch, key, binding, client_nonce, server_nonce, client=True)
    return hello.body


def _seal(ch: Channel, token: bytes, binding: bytes, client_nonce: str, server_nonce: str, *, client: bool) -> None:
    """A login goes on in records keyed from it (:mod:`dashrun.wire.sealed`): sealed over TLS, signed without."""
    ch.seal(after_login(ch.sock, token, binding, client_nonce, server_nonce, client=client))


def _peer(ch: Channel) -> str:
    try:
        host, port = ch.sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"
