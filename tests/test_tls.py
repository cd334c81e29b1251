"""Encryption and trust on the link to dash-memd, with real processes, real sockets and a man in the middle.

The man in the middle is :class:`Relay`, a TCP relay on loopback that forwards
every byte between a client and dash-memd: passively (keeping a copy of what
it saw), flipping one byte, or actively terminating TLS on both sides with a
certificate of its own. Certificates an operator would bring are made here
with ``cryptography``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import wait_for

from dashrun.errors import AuthError, UnavailableError, UsageError
from dashrun.util.tokens import write_token
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import ShardHeader
from dashrun.wire.tls import IDENTITY_FILE, ServerTls, TlsSettings, format_fingerprint, parse_fingerprint

TRAIN = Path(__file__).resolve().parent / "bin" / "train.py"
IO_TIMEOUT = 10.0
PLAIN = TlsSettings(plaintext=True)
LAYOUT = "ab" * 32


def shard(job: str, payload: bytes) -> ShardHeader:
    """A one-rank checkpoint whose bytes are ``payload``."""
    return ShardHeader(job, 1, 0, 1, len(payload), 0, len(payload), 0, 0, LAYOUT)


def client(memd, host_port: tuple[str, int] | None = None, **kwargs) -> MemdClient:
    host, port = host_port or (memd.host, memd.port)
    return MemdClient(host, port, memd.token, timeout=IO_TIMEOUT, **kwargs)


def store_and_read_back(c: MemdClient, job: str, payload: bytes) -> None:
    assert c.put_shard(shard(job, payload), [payload])["committed"]
    info = c.latest(job)
    assert info is not None and info.step == 1
    back = bytearray(len(payload))
    c.get_shard_into(job, 1, 0, [memoryview(back)])
    assert back == payload


def memory_used(memd) -> int:
    with memd.client(timeout=IO_TIMEOUT) as c:
        return c.list()["memory"]["used"]


class Relay:
    """A man in the middle on loopback: each connection to it is relayed to ``target``, every byte forwarded.

    ``front(sock)`` and ``back(sock)`` may wrap the client's and dash-memd's ends (an active relay terminates TLS
    there). ``flip_at`` flips a bit of the client's byte at that offset on its way. What the relay read from each
    side is kept in ``to_memd`` and ``to_client``.
    """

    def __init__(self, target: tuple[str, int], *, front=None, back=None, flip_at: int | None = None):
        self.target, self.front, self.back, self.flip_at = target, front, back, flip_at
        self.to_memd, self.to_client = bytearray(), bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        except OSError:
            pass
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=IO_TIMEOUT)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._relay, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _relay(self, near: socket.socket) -> None:
        far = None
        try:
            near.settimeout(IO_TIMEOUT)
            near = self.front(near) if self.front else near
            far = socket.create_connection(self.target, timeout=IO_TIMEOUT)
            far = self.back(far) if self.back else far
            self._shuttle(near, far)
        except OSError:
            pass
        finally:
            for sock in (near, far):
                if sock is not None:
                    sock.close()

    def _shuttle(self, near, far) -> None:
        """Both directions on one thread (an SSL socket must not be read and written by two at once)."""
        flows = {near: (far, self.to_memd), far: (near, self.to_client)}
        while not self._stop.is_set():
            ready = [s for s in flows if isinstance(s, ssl.SSLSocket) and s.pending()]
            ready = ready or select.select(list(flows), [], [], 0.1)[0]
            for src in ready:
                dst, seen = flows[src]
                src.settimeout(0.1)  # readable may mean a TLS record that carries no data (a session ticket)
                try:
                    data = src.recv(1 << 16)
                except (socket.timeout, ssl.SSLWantReadError):
                    continue
                if not data:
                    return
                if seen is self.to_memd and self.flip_at is not None and \
                        len(seen) <= self.flip_at < len(seen) + len(data):
                    data = bytearray(data)
                    data[self.flip_at - len(seen)] ^= 0x20
                seen += data
                dst.settimeout(IO_TIMEOUT)
                dst.sendall(data)


# --- certificates an operator would bring --------------------------------------------------------------


def make_ca(tmp_path: Path, name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = tmp_path / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def make_server_cert(tmp_path: Path, ca) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by ``ca``: (certificate file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "memd.test")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "memd-cert.pem", tmp_path / "memd-key.pem"
    pem = serialization.Encoding.PEM
    cert_path.write_bytes(cert.public_bytes(pem) + ca_cert.public_bytes(pem))  # the chain, leaf first
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def dashrun_status(memd, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file",
                           str(memd.token_file), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


# --- tests ------------------------------------------------------------------------------------------------------


def test_a_passive_observer_sees_no_plaintext(memd_factory):
    """Everything between a client and dash-memd, both ways, holds neither the checkpoint, the job id nor the token;
    the same relay in front of a dash-memd with --no-tls sees all three (so it does record what crosses)."""
    marker = f"checkpoint-marker-{uuid.uuid4().hex}".encode()
    payload = marker * (256 * 1024 // len(marker))
    job = f"secret-job-{uuid.uuid4().hex[:12]}"
    for flag in ((), ("--no-tls",)):
        memd = memd_factory("--memory-limit", "64MiB", *flag)
        with Relay((memd.host, memd.port)) as relay, client(memd, relay.address, tls=TlsSettings(bool(flag))) as c:
            store_and_read_back(c, job, payload)
            c.close()
            seen = bytes(relay.to_memd) + bytes(relay.to_client)
        assert len(relay.to_memd) > len(payload) and len(relay.to_client) > len(payload)
        visible = [what for what in (marker, job.encode(), memd.token) if what in seen]
        if flag:
            assert len(visible) == 2, "the relay did not see plaintext where there is some"  # not the token, ever
        else:
            assert visible == [], f"{visible} crossed the wire in the clear"


def test_without_the_token_or_through_a_relay_that_terminates_tls_no_one_logs_in(memd, tmp_path):
    """A client without the token is refused. So is one with it, through a relay that holds a certificate of its own
    toward the client and is a TLS client of dash-memd: it forwards every byte of the login, yet the login fails,
    as each side signed the certificate it saw, and they differ."""
    with MemdClient(memd.host, memd.port, write_token(tmp_path / "intruder"), timeout=IO_TIMEOUT) as c:
        with pytest.raises(AuthError):
            c.ping()
    own = ServerTls.load()  # the relay's self-signed certificate
    to_memd = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    to_memd.check_hostname, to_memd.verify_mode = False, ssl.CERT_NONE
    front = lambda sock: own.context.wrap_socket(sock, server_side=True)  # noqa: E731
    back = lambda sock: to_memd.wrap_socket(sock)  # noqa: E731
    with Relay((memd.host, memd.port), front=front, back=back) as relay:
        with client(memd, relay.address) as c:
            with pytest.raises(AuthError) as refused:
                c.ping()
        assert "intercepts TLS" in refused.value.hint
        assert relay.connections == 1
        assert relay.to_memd.count(b"DASH") >= 2 and relay.to_client.count(b"DASH") >= 2  # HELLOs and AUTH, relayed
    wait_for(lambda: memd.log().count("refused: wrong token") == 2, 10, "dash-memd to log the refused logins")
    with client(memd) as c:  # and the same client straight to dash-memd logs in
        assert c.ping()["pid"] == memd.proc.pid


def test_a_tampered_byte_of_ciphertext_kills_the_connection(memd):
    """A bit flipped inside the shard's bytes on the wire: dash-memd drops the connection at that record (not just
    the shard, as a checksum mismatch would), and nothing of the shard is kept."""
    payload = os.urandom(1 << 20)
    base = memory_used(memd)
    with Relay((memd.host, memd.port), flip_at=512 << 10) as relay, client(memd, relay.address) as c:
        with pytest.raises(UnavailableError):
            c.put_shard(shard("tampered", payload), [payload])
        assert len(relay.to_memd) > 512 << 10
    wait_for(lambda: memory_used(memd) == base, 10, "the refused shard's memory to be released")
    with client(memd) as c:
        assert c.latest("tampered") is None
        assert "tampered" not in {job["job"] for job in c.list()["jobs"]}
        assert c.list()["tag_failures"] == 1  # counted, told apart from a link that merely failed
    assert re.search(r"WARNING .*a record failed authentication", memd.log()), memd.log()[-2000:]
    result = dashrun_status(memd)
    assert result.returncode == 0 and "1 records failed authentication" in result.stdout, result.stderr


def test_the_auth_timeout_bounds_the_tls_handshake_too(memd_factory):
    """A ClientHello trickled a byte at a time: each byte comes long before any per-read timeout, yet dash-memd
    closes the connection once --auth-timeout has passed since it was accepted."""
    auth_timeout = 1.0
    memd = memd_factory("--memory-limit", "64MiB", "--auth-timeout", str(auth_timeout))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).wrap_bio(incoming, outgoing, server_hostname="memd").do_handshake()
    client_hello = outgoing.read()
    assert len(client_hello) > 100
    with socket.create_connection((memd.host, memd.port), timeout=IO_TIMEOUT) as sock:
        # Never the last byte (the handshake never completes), one byte each auth_timeout / 5: the trickle lasts
        # far longer than the auth timeout, and each byte comes well within any idle timeout. Only the login's
        # own deadline ends it before the bytes run out.
        assert (len(client_hello) - 1) * auth_timeout / 5 > 10 * auth_timeout
        started, closed_after, sent = time.monotonic(), None, 0
        for byte in client_hello[:-1]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - started
                break
            sent += 1
            if select.select([sock], [], [], auth_timeout / 5)[0]:  # readable: dash-memd gave up on it
                closed_after = time.monotonic() - started
                break
    assert closed_after is not None and sent < len(client_hello) - 1, "dash-memd waited out the whole trickle"
    assert closed_after >= auth_timeout * 0.9, closed_after  # at its deadline, not before


@pytest.mark.parametrize("server_plain", [False, True], ids=["plaintext-client", "tls-client"])
def test_one_end_in_plaintext_fails_at_once_naming_the_flag(memd_factory, server_plain):
    memd = memd_factory("--memory-limit", "64MiB", *(["--no-tls"] if server_plain else []))  # auth timeout 10 s
    # Refused at once, with the flag named: not by dash-memd's auth timeout (10 s), which would end it in an
    # UnavailableError of a closed connection, not this UsageError.
    with client(memd, tls=TlsSettings(plaintext=not server_plain)) as c:
        with pytest.raises(UsageError) as refused:
            c.ping()
    if server_plain:
        assert str(refused.value).startswith(f"dash-memd at {memd.address} runs with --no-tls; give --no-tls here too")
        logged = "refused: the client speaks TLS; this dash-memd runs with --no-tls"
    else:
        assert str(refused.value).startswith(f"dash-memd at {memd.address} speaks TLS; this side was started with "
                                             "--no-tls")
        logged = "refused: the client runs with --no-tls; this dash-memd speaks TLS"
    wait_for(lambda: logged in memd.log(), 10, "dash-memd to log the refusal")
    assert memd.log().count("refused:") == 1

    # The command line: one line and its hint, exit code 2, no traceback.
    result = dashrun_status(memd, *([] if server_plain else ["--no-tls"]))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("dashrun: error: dash-memd at") and "--no-tls" in lines[0], lines
    assert lines[1].startswith("dashrun: hint:"), lines


@pytest.mark.slow
def test_no_tls_on_both_ends_works(memd_factory, tmp_path):
    """dash-memd, a client, a command (through DASH_NO_TLS) and a launch (the launcher, the dash-agent it starts
    and a rank), all with --no-tls."""
    memd = memd_factory("--memory-limit", "64MiB", "--no-tls")
    with client(memd, tls=PLAIN) as c:
        store_and_read_back(c, "plain", os.urandom(4096))
    result = dashrun_status(memd, env={"DASH_NO_TLS": "1"})
    assert result.returncode == 0 and "plain" in result.stdout, result.stderr
    launch = [sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(memd.token_file),
              "--no-tls", "--job-id", "plain-launch", "--nproc-per-node", "1", str(TRAIN), "--steps", "5",
              "--interval", "5", "--out", str(tmp_path / "out")]
    result = subprocess.run(launch, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with client(memd, tls=PLAIN) as c:
        assert c.latest("plain-launch").step == 4  # saved by the rank, through the agent, in plaintext


def test_the_fan_out_passes_the_tls_options_to_every_host(tmp_path, monkeypatch, caplog):
    from dashrun.launch import fanout
    from dashrun.launch.options import build_parser

    (tmp_path / "hostfile").write_text("hostA slots=1\nhostB slots=1\n")
    (tmp_path / "ssh_config").write_text("Host hostA\n  HostName 10.1.1.1\nHost hostB\n  HostName 10.1.1.2\n")
    monkeypatch.chdir(tmp_path)
    pin = format_fingerprint(bytes(range(32)))
    for env, typed, expected in (({"DASH_NO_TLS": "1"}, [], ("--no-tls",)),
                                 ({}, ["--no-tls"], ("--no-tls",)),
                                 ({}, ["--tls-ca", "ca.pem"], ("--tls-ca", "ca.pem")),
                                 ({}, ["--tls-fingerprint", pin], ("--tls-fingerprint", pin)),
                                 ({"DASH_TLS_FINGERPRINT": pin}, [], (f"DASH_TLS_FINGERPRINT={pin}",))):
        for name in ("DASH_NO_TLS", "DASH_TLS_CA", "DASH_TLS_FINGERPRINT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        argv = ["--hostfile", "hostfile", "--ssh-config", "ssh_config", "--memd", "stable:7070", "--token-file",
                "tok", *typed, "train.py"]
        parser = build_parser()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dashrun.launch.fanout"):
            config = fanout.config_from_args(argv, parser.parse_args(argv), parser)
        for command in config.commands:
            words = command.split()
            assert all(word in words for word in expected), command
            # --no-tls is said on each host's command line, once, never carried along unseen in its environment
            assert "DASH_NO_TLS=1" not in words and words.count("--no-tls") == (expected == ("--no-tls",)), command
        plaintext = [r.getMessage() for r in caplog.records if "--no-tls" in r.getMessage()]
        if expected == ("--no-tls",):  # and the launcher says so, naming the hosts (and the variable it came from)
            assert len(plaintext) == 1 and "hostA, hostB" in plaintext[0] and "unencrypted" in plaintext[0]
            assert ("(from DASH_NO_TLS)" in plaintext[0]) == bool(env), plaintext
        else:
            assert plaintext == []


def test_an_operator_certificate_and_tls_ca(memd_factory, tmp_path):
    ca = make_ca(tmp_path, "operator-ca")
    cert, key = make_server_cert(tmp_path, ca)
    memd = memd_factory("--memory-limit", "64MiB", "--tls-cert", str(cert), "--tls-key", str(key))
    wait_for(lambda: "TLS with the operator's certificate" in memd.log(), 10, "dash-memd to say which certificate")
    with client(memd) as c:  # no CA: the login binds the certificate
        store_and_read_back(c, "operator", os.urandom(4096))
    with client(memd, tls=TlsSettings(ca=ca[2])) as c:  # the right CA
        assert c.ping()["pid"] == memd.proc.pid
    _, _, wrong = make_ca(tmp_path, "another-ca")
    with client(memd, tls=TlsSettings(ca=wrong)) as c:
        with pytest.raises(UsageError, match="does not verify against --tls-ca"):
            c.ping()
    # A dash-memd with its ephemeral certificate does not verify against the operator's CA either.
    ephemeral = memd_factory("--memory-limit", "64MiB")
    with client(ephemeral, tls=TlsSettings(ca=ca[2])) as c:
        with pytest.raises(UsageError, match="does not verify against --tls-ca"):
            c.ping()


# --- dash-memd's identity: kept, printed, pinned -------------------------------------------------------------


def banner_fingerprints(memd) -> list[str]:
    return re.findall(r"fingerprint (SHA256:[A-Za-z0-9+/]{43}) ", memd.log())


def memd_fingerprint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun.memd", "fingerprint", *args], capture_output=True,
                          text=True, timeout=60)


def test_dash_memd_keeps_its_identity_across_a_restart_and_prints_it(memd_factory):
    """Its own certificate is made at the first start and kept in --data-dir (0600): the same fingerprint after a
    restart, the one 'dash-memd fingerprint' prints and the banner shows, and a pinned client logs in to both."""
    memd = memd_factory("--memory-limit", "64MiB")
    kept = memd.data_dir / IDENTITY_FILE
    assert kept.stat().st_mode & 0o777 == 0o600
    assert b"PRIVATE KEY" in kept.read_bytes()
    wait_for(lambda: banner_fingerprints(memd), 10, "the banner to name the fingerprint")
    first = banner_fingerprints(memd)[0]
    printed = memd_fingerprint("--data-dir", str(memd.data_dir))
    assert printed.returncode == 0 and printed.stdout.strip() == first, printed.stderr
    pinned = TlsSettings(fingerprint=parse_fingerprint(first))
    with client(memd, tls=pinned) as c:
        assert c.ping()["pid"] == memd.proc.pid
    memd.stop()
    memd.start()
    wait_for(lambda: len(banner_fingerprints(memd)) == 2, 10, "the restarted dash-memd's banner")
    assert banner_fingerprints(memd) == [first, first]
    with client(memd, tls=pinned) as c:
        assert c.ping()["pid"] == memd.proc.pid
    result = dashrun_status(memd, "--tls-fingerprint", first)
    assert result.returncode == 0, result.stderr


def test_a_fingerprint_reads_in_every_spelling_and_a_malformed_one_is_refused(tmp_path):
    digest = os.urandom(32)
    colon_hex = ":".join(f"{b:02X}" for b in digest)  # what the banner printed before, and OpenSSL prints
    for spelling in (format_fingerprint(digest), format_fingerprint(digest) + "=", "sha256:" + digest.hex(),
                     digest.hex().upper(), colon_hex, "SHA256:" + colon_hex.lower(), f"sha256 Fingerprint={colon_hex}"):
        assert parse_fingerprint(spelling) == digest, spelling
    for bad in ("SHA256:", "SHA256:abc", "SHA256:" + digest.hex()[:-2], colon_hex[:-3], "MD5:" + digest.hex(),
                "SHA256:" + format_fingerprint(digest)[7:-1] + "*"):
        with pytest.raises(UsageError, match="is not a SHA-256 fingerprint"):
            parse_fingerprint(bad)
    with pytest.raises(UsageError, match="--tls-fingerprint and --no-tls exclude each other"):
        TlsSettings.from_options(True, None, format_fingerprint(digest))
    # what the launcher hands its dash-agent (options) and its ranks (the environment) reads back as it was
    pinned = TlsSettings(fingerprint=digest)
    assert pinned.args() == ["--tls-fingerprint", format_fingerprint(digest)]
    assert TlsSettings.from_options(False, None, pinned.args()[1]) == pinned
    agent_help = subprocess.run([sys.executable, "-m", "dashrun.agent", "--help"], capture_output=True, text=True,
                                timeout=60)
    assert "--tls-fingerprint" in agent_help.stdout and "DASH_TLS_FINGERPRINT" in agent_help.stdout
    missing = memd_fingerprint("--data-dir", str(tmp_path / "never-started"))
    assert missing.returncode == 2 and "no dash-memd identity in" in missing.stderr, missing.stderr
    assert not (tmp_path / "never-started").exists()  # printing never makes one


def tls_record_types(stream: bytes) -> list[int]:
    """The content types of the TLS records in ``stream`` (a client's side of a connection)."""
    types, at = [], 0
    while at + 5 <= len(stream):
        types.append(stream[at])
        at += 5 + int.from_bytes(stream[at + 3:at + 5], "big")
    return types


def test_a_pinned_client_refuses_another_dash_memd_with_the_same_token(memd_factory):
    """A second dash-memd with the cluster's token could pose as the first to any client; one pinned to the first
    refuses it once the TLS handshake shows its certificate, naming both fingerprints, and sends nothing more:
    no login starts (the relay sees the client's Finished and no record after it, the second logs no refusal)."""
    first = memd_factory("--memory-limit", "64MiB")
    other = memd_factory("--memory-limit", "64MiB")  # the same token file
    wait_for(lambda: banner_fingerprints(first) and banner_fingerprints(other), 10, "both banners")
    pin, theirs = banner_fingerprints(first)[0], banner_fingerprints(other)[0]
    assert pin != theirs
    pinned = TlsSettings(fingerprint=parse_fingerprint(pin))
    with Relay((other.host, other.port)) as relay:
        with client(other, relay.address, tls=pinned) as c:
            with pytest.raises(UsageError) as refused:
                c.ping()
        wait_for(lambda: relay.connections == 1 and not relay._threads[1].is_alive(), 10, "the client to hang up")
    message = str(refused.value)
    assert "is not the pinned one" in message and pin in message and theirs in message and "\n" not in message
    assert tls_record_types(bytes(relay.to_memd)).count(0x17) == 1, "the client sent more than its Finished"
    with Relay((other.host, other.port)) as control:  # the same relay sees a login as records after the Finished
        with client(other, control.address) as c:
            c.ping()
        assert tls_record_types(bytes(control.to_memd)).count(0x17) > 1
    assert "refused" not in other.log()
    with client(first, tls=pinned) as c:  # and the pinned one is served
        assert c.ping()["pid"] == first.proc.pid
    # The command line: one line and its hint, exit code 2; the environment twin pins as the option does.
    result = dashrun_status(other, env={"DASH_TLS_FINGERPRINT": pin})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2 and pin in lines[0] and theirs in lines[0], result.stderr
    assert "refused" not in other.log()


# --- --no-tls says what it gives up ---------------------------------------------------------------------------


def test_no_tls_beyond_loopback_is_refused_unless_insecure_plaintext(memd_factory, tmp_path, token_file):
    """dash-memd --no-tls on 0.0.0.0 (every interface) stops before it binds anything: one line, exit 2, the hint
    naming --insecure-plaintext; on loopback it starts and its banner says what --no-tls gives up."""
    from click.testing import CliRunner

    from dashrun.launch.options import build_parser
    from dashrun.memd.cli import cli as memd_cli
    from dashrun.memd.config import MemdConfig, loopback

    ready = tmp_path / "ready"
    result = subprocess.run([sys.executable, "-m", "dashrun.memd", "start", "--listen", "0.0.0.0:0", "--no-tls",
                             "--data-dir", str(tmp_path / "data"), "--token-file", str(token_file), "--ready-file",
                             str(ready)], capture_output=True, text=True, timeout=20)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert "--no-tls on --listen 0.0.0.0, beyond loopback" in lines[0] and "--insecure-plaintext" in lines[1], lines
    assert not ready.exists()
    assert [loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "0.0.0.0", "::", "",
                                  "10.1.2.3")] == [True] * 5 + [False] * 4
    base = dict(port=0, data_dir=tmp_path / "data", memory_limit=1 << 20, token=b"t" * 32, no_tls=True)
    assert MemdConfig(host="0.0.0.0", insecure_plaintext=True, **base).insecure_plaintext  # asked for by name
    with pytest.raises(UsageError, match="--insecure-plaintext goes with --no-tls only"):
        MemdConfig(host="127.0.0.1", **{**base, "no_tls": False, "insecure_plaintext": True})
    plain = memd_factory("--memory-limit", "64MiB", "--no-tls")
    wait_for(lambda: "listening on" in plain.log(), 10, "the banner")
    assert "no encryption" in plain.log() and "the token login and each record's MAC still hold" in plain.log()
    for help_text in (CliRunner().invoke(memd_cli, ["start", "--help"], terminal_width=1000).output,
                      build_parser().format_help()):
        assert "no encryption" in " ".join(help_text.split()), help_text
