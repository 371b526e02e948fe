"""TLS on the gateway's one port: https and wss side by side, from a PEM certificate chain and its key.

`--tls-cert FILE --tls-key FILE` (or GATEWAY_TLS_CERT / GATEWAY_TLS_KEY). The context is Python's
server defaults (no compression, the server's cipher order, forward secrecy, OpenSSL's secure cipher
list) with TLS 1.2 as the floor, and offers only HTTP/1.1 over ALPN, the protocol a WebSocket upgrade
needs. The files are read once, at start: a renewed certificate takes a restart (behind an ingress, the
proxy holds the public certificate and this is not needed).
"""

from __future__ import annotations

import os
import ssl

MIN_VERSION = ssl.TLSVersion.TLSv1_2


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server's SSLContext; ValueError naming the file when it cannot be read or the pair does not match."""
    for path in (cert_file, key_file):
        if not os.path.isfile(path):
            raise ValueError(f"TLS file {path!r} does not exist")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = MIN_VERSION
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as e:
        # Never the key's contents: only which files and OpenSSL's reason.
        reason = getattr(e, "reason", None) or e.strerror or type(e).__name__
        raise ValueError(f"cannot use --tls-cert {cert_file!r} with --tls-key {key_file!r}: {reason}") from None
    return ctx
