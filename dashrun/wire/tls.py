"""TLS on dashrun's TCP links, and the channel binding the login signs.

Every TCP connection to dash-memd is TLS (1.3 where this Python's ``ssl`` has
it) unless both ends were started with ``--no-tls``. dash-memd serves the
operator's certificate (``--tls-cert``, ``--tls-key``), or its own self-signed
one, made at its first start and kept with its key in its data dir
(:data:`IDENTITY_FILE`, mode 0600), so that its identity survives a restart.
A client needs no CA: the login (:mod:`dashrun.wire.auth`) signs, with the
cluster's token, the SHA-256 of the server's certificate as each end sees it
(``tls-server-end-point``, RFC 5929). A relay that terminates TLS shows the
client another certificate than dash-memd's own, so the two ends sign
different bindings and the login fails. That proves the server holds the
token, and anyone with the token could pose as dash-memd; a client that pins
the certificate (``--tls-fingerprint``: its SHA-256, as ``dash-memd
fingerprint`` prints it, see :func:`format_fingerprint`) refuses any other
before its login starts. ``--tls-ca`` makes a client check the certificate's
chain and host name as well. TLS ends with the login: the connection goes on
in sealed records keyed from it (:mod:`dashrun.wire.sealed`). With
``--no-tls`` nothing is secret, but the records after the login are still
signed with keys from it: no byte of them is altered or injected unseen.

The client speaks first in both modes, so dash-memd tells the two apart by the
first byte (a TLS handshake record starts with 0x16, a dashrun frame with
``D``) and refuses a client of the other mode at once, in the client's own
terms: a plaintext client gets an ERROR frame whose ``tls`` is true; a TLS
client, from a dash-memd with ``--no-tls``, a TLS alert that a TLS dash-memd
never sends (``user_canceled``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import functools
import hashlib
import hmac
import os
import re
import socket
import ssl
import time
from pathlib import Path

from dashrun import env
from dashrun.errors import AuthError, ErrorCode, ProtocolError, UnavailableError, UsageError
from dashrun.util.files import fsync_dir, write_new
from dashrun.wire.protocol import MAGIC, Kind, encode_body, encode_header

__all__ = ["BINDING_PLAIN", "IDENTITY_FILE", "ServerTls", "TlsSettings", "accept", "connect", "fingerprint_of",
           "format_fingerprint", "mismatch", "parse_fingerprint", "peer_binding"]

#: The first byte of a TLS handshake record (a ClientHello, a ServerHello).
_HANDSHAKE_RECORD = 0x16
#: What dash-memd with --no-tls answers a TLS client: a fatal user_canceled alert record (OpenSSL never sends
#: one, so a TLS dash-memd never does).
_PLAINTEXT_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 90])
_PLAINTEXT_ALERT_REASON = "TLSV1_ALERT_USER_CANCELLED"
_MINIMUM = ssl.TLSVersion.TLSv1_3 if ssl.HAS_TLSv1_3 else ssl.TLSVersion.TLSv1_2
#: What the login signs in place of a certificate's digest when both ends run with --no-tls.
BINDING_PLAIN = bytes(32)
#: Longest dash-memd reads (and drops) what a refused client of the other mode still sends, so that closing
#: does not reset the connection before the client has read why.
_DRAIN = 1.0
#: How long a self-signed certificate is valid: dash-memd's own is kept for good, a client pins it.
_VALIDITY = datetime.timedelta(days=3650)
#: dash-memd's own certificate and its key (PEM, one file, mode 0600) in its --data-dir: its identity.
IDENTITY_FILE = "tls-identity.pem"
#: What may precede a fingerprint: ``SHA256:`` (as printed here and by OpenSSH), or OpenSSL's
#: ``sha256 Fingerprint=`` (``openssl x509 -noout -fingerprint -sha256``).
_FINGERPRINT_PREFIX = re.compile(r"^(sha-?256( fingerprint)?\s*[:=]\s*)?", re.IGNORECASE)
_FINGERPRINT_HINT = ("give it as 'dash-memd fingerprint' prints it, SHA256:<base64>, or as 64 hex digits "
                     "(with or without colons)")


def format_fingerprint(digest: bytes) -> str:
    """A certificate's SHA-256 as dashrun prints it: ``SHA256:`` and unpadded base64 (as OpenSSH prints keys')."""
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def parse_fingerprint(text: str, option: str = "--tls-fingerprint") -> bytes:
    """The 32 bytes of a SHA-256 fingerprint in any spelling dashrun meets: ``SHA256:<base64>`` (padded or not),
    ``SHA256:<hex>``, or colon-separated hex (dash-memd's banners before this version printed it, as OpenSSL
    does), each with or without its prefix. UsageError for anything else."""
    rest = _FINGERPRINT_PREFIX.sub("", text.strip(), count=1)
    digest = b""
    try:
        if ":" in rest:  # colon-hex: 32 pairs
            pairs = rest.split(":")
            if all(len(pair) == 2 for pair in pairs):
                digest = bytes.fromhex("".join(pairs))
        elif len(rest) == 64:  # base64 of 32 bytes is 43 characters (44 padded): 64 is hex
            digest = bytes.fromhex(rest)
        elif rest:
            digest = base64.b64decode(rest + "=" * (-len(rest) % 4), validate=True)
    except (ValueError, binascii.Error):
        digest = b""
    if len(digest) != hashlib.sha256().digest_size:
        raise UsageError(f"{option} {text!r} is not a SHA-256 fingerprint", hint=_FINGERPRINT_HINT)
    return digest


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    """A client's side of a link to dash-memd: TLS (the default) or plaintext, a CA to verify it with, and the
    certificate it must show."""

    #: ``--no-tls``: speak plaintext (dash-memd must run with --no-tls too)
    plaintext: bool = False
    #: ``--tls-ca``: also verify dash-memd's certificate chain and host name against these CAs
    ca: Path | None = None
    #: ``--tls-fingerprint``: the SHA-256 of the only certificate accepted (checked before the login starts)
    fingerprint: bytes | None = None

    def __post_init__(self) -> None:
        if self.plaintext and self.ca is not None:
            raise UsageError("--tls-ca and --no-tls exclude each other", hint="drop one of them")
        if self.plaintext and self.fingerprint is not None:
            raise UsageError("--tls-fingerprint and --no-tls exclude each other",
                             hint="--no-tls has no certificate to pin: drop one of them")

    @classmethod
    def from_options(cls, no_tls: bool, tls_ca: str | os.PathLike | None,
                     tls_fingerprint: str | None = None) -> TlsSettings:
        """UsageError for a fingerprint that is not one, or options that exclude each other."""
        return cls(plaintext=bool(no_tls), ca=Path(tls_ca).absolute() if tls_ca else None,
                   fingerprint=parse_fingerprint(tls_fingerprint) if tls_fingerprint else None)

    @classmethod
    def from_env(cls) -> TlsSettings:
        """The settings dashrun's launcher hands its ranks (``DASH_NO_TLS``, ``DASH_TLS_CA``,
        ``DASH_TLS_FINGERPRINT``)."""
        return cls.from_options(env.get(env.NO_TLS) == "1", env.get(env.TLS_CA), env.get(env.TLS_FINGERPRINT))

    def args(self) -> list[str]:
        """These settings as command-line options, for a process started with them."""
        return ((["--no-tls"] if self.plaintext else []) + (["--tls-ca", str(self.ca)] if self.ca else [])
                + (["--tls-fingerprint", format_fingerprint(self.fingerprint)] if self.fingerprint else []))


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """dash-memd's side: its TLS context and the binding of its certificate (SHA-256 of the DER)."""

    context: ssl.SSLContext
    binding: bytes
    operator: bool  # the operator's certificate (else a self-signed one)
    kept: Path | None = None  # the file of dash-memd's own certificate (None: the operator's, or an ephemeral one)

    @classmethod
    def load(cls, cert: Path | None = None, key: Path | None = None, data_dir: Path | None = None) -> ServerTls:
        """The operator's certificate (and key, by default in the same file); else dash-memd's own in
        ``data_dir`` (made there if it has none yet); else, with neither, a new ephemeral one."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = _MINIMUM
        if cert is None and data_dir is not None:
            kept = _own_identity(Path(data_dir))
            try:
                context.load_cert_chain(kept)
            except (OSError, ssl.SSLError) as e:
                raise UsageError(f"cannot load dash-memd's certificate {kept}: {_reason(e)}",
                                 hint="restore it from a backup, or remove it for a new identity (every "
                                      "--tls-fingerprint pinned to the old one must change)") from None
            return cls(context, hashlib.sha256(_first_der(kept.read_bytes())).digest(), False, kept)
        if cert is None:
            cert_pem, key_pem = _self_signed()
            # From memory: the key of an ephemeral certificate never touches a disk.
            fd = os.memfd_create("dash-memd-tls", os.MFD_CLOEXEC)
            try:
                os.write(fd, cert_pem + key_pem)
                context.load_cert_chain(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        else:
            try:
                # A key protected by a passphrase fails here, rather than a daemon prompting for one.
                context.load_cert_chain(cert, key, password=lambda: b"")
                cert_pem = Path(cert).read_bytes()
            except (OSError, ssl.SSLError) as e:
                raise UsageError(f"cannot load --tls-cert {cert}" + (f" / --tls-key {key}" if key else "")
                                 + f": {_reason(e)}",
                                 hint="give a PEM certificate (chain, leaf first) and its unencrypted key") from None
        return cls(context, hashlib.sha256(_first_der(cert_pem)).digest(), cert is not None)

    @property
    def fingerprint(self) -> str:
        """What a client pins with ``--tls-fingerprint`` (:func:`format_fingerprint`)."""
        return format_fingerprint(self.binding)


def _own_identity(data_dir: Path) -> Path:
    """dash-memd's own certificate and key in ``data_dir``, made at the first start: written whole to a file of
    its own, fsynced, then linked in under :data:`IDENTITY_FILE` (a link never replaces a file, so of two starts
    racing on one data dir the first one's stays and both serve it). UsageError if it is readable by others."""
    path = data_dir / IDENTITY_FILE
    if not path.exists():
        cert_pem, key_pem = _self_signed()
        tmp = data_dir / f".{IDENTITY_FILE}.{os.getpid()}.tmp"
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)
            write_new(tmp, cert_pem + key_pem, 0o600)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            fsync_dir(data_dir)
        except OSError as e:
            raise UsageError(f"cannot keep dash-memd's TLS key in {data_dir}: {e.strerror or e}",
                             hint="--data-dir must be writable by dash-memd") from None
        finally:
            tmp.unlink(missing_ok=True)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UsageError(f"cannot read dash-memd's TLS key {path}: {e.strerror or e}") from None
    if mode & 0o077:
        raise UsageError(f"dash-memd's TLS key {path} is open to others (mode {mode & 0o777:o})",
                         hint=f"chmod 600 {path}, and pin a new identity if others may have read it")
    return path


def fingerprint_of(*, cert: Path | None = None, data_dir: Path | None = None) -> str:
    """What a client pins for the certificate dash-memd serves (:func:`format_fingerprint`): the operator's
    ``cert``, else dash-memd's own in ``data_dir``; read only: UsageError where there is none (yet)."""
    path = Path(cert) if cert is not None else Path(data_dir) / IDENTITY_FILE
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        if cert is not None:
            raise UsageError(f"cannot read --tls-cert {path}: no such file") from None
        raise UsageError(f"no dash-memd identity in {data_dir} yet ({IDENTITY_FILE})",
                         hint="dash-memd makes it at its first start there: start it once (or check --data-dir)") \
            from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    return format_fingerprint(hashlib.sha256(_first_der(pem)).digest())


def _self_signed() -> tuple[bytes, bytes]:
    """A new P-256 key and a certificate for it, signed by itself: (certificate PEM, key PEM)."""
    from cryptography import x509  # only dash-memd makes certificates
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dash-memd")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + _VALIDITY)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _first_der(pem: bytes) -> bytes:
    """The DER of the first certificate in a PEM file: the leaf, the one a TLS server presents."""
    begin, end = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
    start = pem.find(begin)
    stop = pem.find(end, start)
    if start < 0 or stop < 0:
        raise UsageError("no certificate in --tls-cert", hint="give a PEM certificate (chain, leaf first)")
    return ssl.PEM_cert_to_DER_cert(pem[start:stop + len(end)].decode("ascii"))


def peer_binding(sock) -> bytes:
    """What the login signs on a client's connection: SHA-256 of the certificate the server showed it."""
    getpeercert = getattr(sock, "getpeercert", None)
    if getpeercert is None:
        return BINDING_PLAIN
    der = getpeercert(binary_form=True)
    if not der:
        raise AuthError("dash-memd showed no TLS certificate")
    return hashlib.sha256(der).digest()


def mismatch(address: str, server_tls: bool) -> UsageError:
    """The one-line error of a client whose ``--no-tls`` differs from dash-memd's."""
    if server_tls:
        return UsageError(f"dash-memd at {address} speaks TLS; this side was started with --no-tls",
                          hint="drop --no-tls (and DASH_NO_TLS) here, or start dash-memd with --no-tls too")
    return UsageError(f"dash-memd at {address} runs with --no-tls; give --no-tls here too",
                      hint="or restart dash-memd without --no-tls, so that the link is encrypted")


def _reason(e: OSError) -> str:
    return getattr(e, "reason", None) or e.strerror or str(e) or type(e).__name__


# --- the client's end --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _client_context(ca: Path | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = _MINIMUM
    if ca is None:
        # No CA to check against: the login authenticates the certificate instead (see peer_binding).
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"cannot load --tls-ca {ca}: {_reason(e)}", hint="give a file of PEM CA certificates") \
            from None
    return context


def connect(host: str, port: int, settings: TlsSettings, *, timeout: float, connect_timeout: float = 5.0,
            what: str = "dash-memd"):
    """A TCP connection to dash-memd (or another server, as ``what`` names it), ready for the login: TLS unless
    ``settings.plaintext``.

    ``timeout`` bounds each wait on the connection from here on (the TLS
    handshake as a whole). A dash-memd of the other mode, unreachable or
    refusing raises the one-line error to show.
    """
    address = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as e:
        raise UnavailableError(f"cannot reach {what} at {address}: {e.strerror or e}",
                               hint="is dash-memd running there, and is --memd right?" if what == "dash-memd"
                               else f"is {what} running there?") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.settimeout(timeout)
        return sock if settings.plaintext else _client_tls(sock, settings, host, address, timeout)
    except BaseException:
        sock.close()
        raise


def _client_tls(sock: socket.socket, settings: TlsSettings, host: str, address: str, timeout: float):
    tls = _client_context(settings.ca).wrap_socket(sock, do_handshake_on_connect=False,
                                                   server_hostname=host if settings.ca else None)
    try:
        tls.do_handshake()
        if settings.fingerprint is not None:
            _check_pinned(tls, settings.fingerprint, address)
    except BaseException as e:
        tls.close()
        if isinstance(e, UsageError):
            raise
        if isinstance(e, ssl.SSLCertVerificationError):
            raise UsageError(f"the TLS certificate of dash-memd at {address} does not verify against --tls-ca "
                             f"{settings.ca}: {e.verify_message}",
                             hint="give the CA that signed dash-memd's --tls-cert (it must name the --memd host)") \
                from None
        if isinstance(e, ssl.SSLError) and e.reason == _PLAINTEXT_ALERT_REASON:
            raise mismatch(address, server_tls=False) from None
        if isinstance(e, socket.timeout):
            raise UnavailableError(f"dash-memd at {address} did not complete the TLS handshake (timed out)") \
                from None
        if isinstance(e, OSError):
            raise UnavailableError(f"TLS handshake with dash-memd at {address} failed: {_reason(e)}",
                                   hint="is it dash-memd there, and without --no-tls?") from None
        raise
    return tls


def _check_pinned(tls: ssl.SSLSocket, pinned: bytes, address: str) -> None:
    """UsageError unless the server showed the pinned certificate: raised before a byte of the login is sent, so
    a server that holds the token but is not the pinned one learns nothing of the client (not even a login)."""
    der = tls.getpeercert(binary_form=True)
    shown = hashlib.sha256(der).digest() if der else b""
    if not hmac.compare_digest(shown, pinned):
        raise UsageError(f"dash-memd at {address} is not the pinned one: it shows certificate "
                         f"{format_fingerprint(shown) if der else '(none)'}, --tls-fingerprint is "
                         f"{format_fingerprint(pinned)}",
                         hint="if its identity changed on purpose, pin what 'dash-memd fingerprint' prints on its "
                              "host; else something on the path poses as it")


# --- dash-memd's end ----------------------------------------------------------------------------------


def accept(sock: socket.socket, server: ServerTls | None, deadline: float) -> tuple[socket.socket, bytes]:
    """A new client's connection ready for the login, and the binding dash-memd signs on it.

    ``server`` is None with ``--no-tls``. Everything happens before the
    monotonic ``deadline`` (the TLS handshake as a whole). A client of the other
    mode is told so (an ERROR frame, or the TLS alert) and refused with
    UsageError (the line to log); a failed or timed-out handshake raises
    UnavailableError, bytes that are neither TLS nor a frame ProtocolError.
    """
    first = _peek_first(sock, deadline)
    client_tls = first[0] == _HANDSHAKE_RECORD
    if server is None:
        if client_tls:
            _refuse(sock, deadline, _PLAINTEXT_ALERT)
            raise UsageError("the client speaks TLS; this dash-memd runs with --no-tls")
        return sock, BINDING_PLAIN
    if first == MAGIC[:1]:
        body = encode_body({"code": ErrorCode.BAD_REQUEST.value, "tls": True,
                            "message": "this dash-memd speaks TLS; the client runs with --no-tls"})
        _refuse(sock, deadline, encode_header(Kind.ERROR, body) + body)
        raise UsageError("the client runs with --no-tls; this dash-memd speaks TLS")
    if not client_tls:
        raise ProtocolError("not a dashrun client: neither TLS nor a dashrun frame")
    tls = None
    try:
        tls = server.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        tls.settimeout(max(deadline - time.monotonic(), 1e-3))
        tls.do_handshake()
    except socket.timeout:
        (tls or sock).close()
        raise UnavailableError("TLS handshake timed out") from None
    except OSError as e:
        (tls or sock).close()
        raise UnavailableError(f"TLS handshake failed: {_reason(e)}") from None
    return tls, server.binding


def _peek_first(sock: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise UnavailableError("peer timed out")
    sock.settimeout(left)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except socket.timeout:
        raise UnavailableError("peer timed out") from None
    except OSError as e:
        raise UnavailableError(f"connection lost: {e.strerror or e}") from None
    if not first:
        raise UnavailableError("connection closed by peer")
    return first


def _refuse(sock: socket.socket, deadline: float, answer: bytes) -> None:
    """Tell a client of the other mode, in its terms, then read what it still sends until it closes."""
    try:
        sock.settimeout(_DRAIN)
        sock.sendall(answer)
        sock.shutdown(socket.SHUT_WR)
        end = min(deadline, time.monotonic() + _DRAIN)
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                break
    except OSError:
        pass
