"""Authentication of every link: both sides prove they hold the cluster's token.

Challenge-response with HMAC-SHA256 over both sides' nonces: the token never
crosses the wire, a recorded exchange cannot be replayed (fresh nonces), and
the client learns that the server holds the token too. Until the handshake
is done a peer may send at most ``MAX_BODY_PREAUTH`` bytes of body.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

from dashrun import errors
from dashrun.errors import AuthError, ProtocolError
from dashrun.wire.channel import Channel
from dashrun.wire.protocol import MAX_BODY_PREAUTH, Kind, field_digest, field_nonce

__all__ = ["client_handshake", "server_handshake"]

def _mac(token: bytes, label: bytes, first: str, second: str) -> str:
    return hmac.new(token, label + bytes.fromhex(first) + bytes.fromhex(second), "sha256").hexdigest()


def server_handshake(ch: Channel, token: bytes, server_name: str) -> None:
    """Run the server side; raises AuthError (after telling the client) if it lacks the token."""
    server_nonce = secrets.token_hex(32)
    ch.send(Kind.HELLO, {"server": server_name, "nonce": server_nonce})
    frame = ch.recv(max_body=MAX_BODY_PREAUTH)
    if frame.kind != Kind.AUTH:
        raise ProtocolError("expected AUTH")
    client_nonce = field_nonce(frame.body, "nonce")
    mac = field_digest(frame.body, "mac")
    if not hmac.compare_digest(mac, _mac(token, b"dash-client", server_nonce, client_nonce)):
        err = AuthError("authentication failed: the client does not hold this cluster's token")
        ch.send_error(err)
        raise err
    ch.send(Kind.WELCOME, {"mac": _mac(token, b"dash-server", client_nonce, server_nonce)})


def client_handshake(ch: Channel, token: bytes) -> dict[str, Any]:
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    if hello.kind == Kind.ERROR:
        raise errors.from_code(str(hello.body.get("code", "")), str(hello.body.get("message", "")))
    if hello.kind != Kind.HELLO:
        raise ProtocolError("expected HELLO from the server")
    server_nonce = field_nonce(hello.body, "nonce")
    client_nonce = secrets.token_hex(32)
    ch.send(Kind.AUTH, {"nonce": client_nonce, "mac": _mac(token, b"dash-client", server_nonce, client_nonce)})
    reply = ch.expect_reply()
    if reply.kind != Kind.WELCOME or not hmac.compare_digest(
            field_digest(reply.body, "mac"), _mac(token, b"dash-server", client_nonce, server_nonce)):
        raise AuthError("the server does not hold this cluster's token", hint="check --token-file on both sides")
    return hello.body
