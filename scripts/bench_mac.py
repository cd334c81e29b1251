#!/usr/bin/env python3
"""What signing a ``--no-tls`` link's records costs: the MACs a record could carry, on records of 1 MiB.

The signed records of ``dashrun/wire/sealed.py`` (``SignedRecords``) tag
each record with ChaCha20-Poly1305 over nothing, the record's bytes as its
associated data: Poly1305 under a one-time key per record. This compares it,
on this machine, with the other ways of authenticating a record's bytes that
Python offers without a copy (AES-GCM's GMAC the same way, HMAC-SHA256,
keyed BLAKE2b) and with what the TLS link's sealing costs: AES-128-GCM
encrypting into a buffer, as the sealed records do, beside AES-256-GCM, which
they used before (on cores without VAES it cost about 1.45× AES-128).
Prints GiB/s per way, the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import time

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record-mib", type=int, default=1, help="bytes of one record, in MiB")
    parser.add_argument("--records", type=int, default=256, help="records per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    record = memoryview(bytearray(os.urandom(args.record_mib * MiB)))
    key, nonce = os.urandom(32), bytes(12)
    chacha, gcm, gcm128 = ChaCha20Poly1305(key), AESGCM(key), AESGCM(key[:16])
    sealed = bytearray(len(record) + 16)
    ways = {
        "Poly1305 (ChaCha20-Poly1305, bytes as AAD): signed records": lambda: chacha.encrypt(nonce, b"", record),
        "GMAC (AES-256-GCM, bytes as AAD)": lambda: gcm.encrypt(nonce, b"", record),
        "HMAC-SHA256": lambda: hmac.new(key, record, "sha256").digest(),
        "BLAKE2b, keyed": lambda: hashlib.blake2b(record, key=key, digest_size=16).digest(),
        "AES-128-GCM encrypt_into (sealed records, for comparison)": lambda: gcm128.encrypt_into(nonce, record, b"",
                                                                                                sealed),
        "AES-256-GCM encrypt_into": lambda: gcm.encrypt_into(nonce, record, b"", sealed),
    }
    for name, way in ways.items():
        way()  # warm
        best = float("inf")
        for _ in range(args.rounds):
            started = time.perf_counter()
            for _ in range(args.records):
                way()
            best = min(best, time.perf_counter() - started)
        print(f"{args.records * len(record) / best / (1 << 30):6.2f} GiB/s  {name}")


if __name__ == "__main__":
    main()
