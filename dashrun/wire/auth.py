"""The login on every link: both sides prove they hold the cluster's token, on this very connection.

Challenge-response with HMAC-SHA256, the client speaking first::

    client -> HELLO   {nonce: Nc}
    server -> HELLO   {server, nonce: Ns}
    client -> AUTH    {mac: HMAC(token, "dash-client" | B | Ns | Nc)}
    server -> WELCOME {mac: HMAC(token, "dash-server" | B | Nc | Ns)}   (or ERROR unauthorized)

``B`` is the channel binding (:mod:`dashrun.wire.tls`): SHA-256 of dash-memd's
TLS certificate as each side sees it (32 zero bytes when both run with
``--no-tls``). The token never crosses the wire, a recorded exchange cannot be
replayed (fresh nonces), the client learns that the server holds the token
too, and a relay that terminates TLS on both sides makes the two sides sign
different certificates, so it cannot log in. Until the login is done a peer
may send at most ``MAX_BODY_PREAUTH`` bytes of body.

Both ends then go on in records keyed from the token and the two nonces
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
from dashrun.wire.protocol import MAX_BODY_PREAUTH, Kind, field_digest, field_nonce
from dashrun.wire.sealed import after_login
from dashrun.wire.tls import mismatch, peer_binding

__all__ = ["client_handshake", "server_handshake"]

_AUTH_HINT = ("check --token-file on both sides; if they hold the same token, something on the path between them "
              "intercepts TLS")


def _mac(token: bytes, label: bytes, binding: bytes, first: str, second: str) -> str:
    return hmac.new(token, label + binding + bytes.fromhex(first) + bytes.fromhex(second), "sha256").hexdigest()


def server_handshake(ch: Channel, token: bytes, server_name: str, binding: bytes,
                     admit: Callable[[], None] | None = None) -> None:
    """Run the server side; raises AuthError (after telling the client) if it lacks the token.

    ``binding``: the SHA-256 of this server's own certificate (``tls.BINDING_PLAIN`` without TLS).
    ``admit``: called once the client proved it holds the token, before it is welcomed; what it raises
    (BusyError) is the client's answer in place of WELCOME, for the caller to send.
    """
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    if hello.kind != Kind.HELLO:
        raise ProtocolError("expected HELLO")
    client_nonce = field_nonce(hello.body, "nonce")
    server_nonce = secrets.token_hex(32)
    ch.send(Kind.HELLO, {"server": server_name, "nonce": server_nonce})
    frame = ch.recv(max_body=MAX_BODY_PREAUTH)
    if frame.kind != Kind.AUTH:
        raise ProtocolError("expected AUTH")
    mac = field_digest(frame.body, "mac")
    if not hmac.compare_digest(mac, _mac(token, b"dash-client", binding, server_nonce, client_nonce)):
        err = AuthError("authentication failed: the client does not hold this cluster's token")
        ch.send_error(err)
        raise err
    if admit is not None:
        admit()
    ch.send(Kind.WELCOME, {"mac": _mac(token, b"dash-server", binding, client_nonce, server_nonce)})
    _seal(ch, token, binding, client_nonce, server_nonce, client=False)


def client_handshake(ch: Channel, token: bytes, address: str | None = None) -> dict[str, Any]:
    """Run the client side on a connection from :func:`dashrun.wire.tls.connect`; returns the server's HELLO.

    ``address`` (HOST:PORT) names the server in errors.
    """
    binding = peer_binding(ch.sock)
    client_nonce = secrets.token_hex(32)
    ch.send(Kind.HELLO, {"nonce": client_nonce})
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    if hello.kind == Kind.ERROR:
        if hello.body.get("tls") is True:  # we spoke plaintext to a dash-memd that speaks TLS
            raise mismatch(address or _peer(ch), server_tls=True)
        raise errors.from_code(str(hello.body.get("code", "")), str(hello.body.get("message", "")))
    if hello.kind != Kind.HELLO:
        raise ProtocolError("expected HELLO from the server")
    server_nonce = field_nonce(hello.body, "nonce")
    ch.send(Kind.AUTH, {"mac": _mac(token, b"dash-client", binding, server_nonce, client_nonce)})
    try:
        reply = ch.expect_reply()
    except AuthError as e:
        raise AuthError(e.message, hint=_AUTH_HINT) from None
    if reply.kind != Kind.WELCOME or not hmac.compare_digest(
            field_digest(reply.body, "mac"), _mac(token, b"dash-server", binding, client_nonce, server_nonce)):
        raise AuthError("the server does not hold this cluster's token", hint=_AUTH_HINT)
    _seal(ch, token, binding, client_nonce, server_nonce, client=True)
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
