"""A local certificate authority and a server certificate it signs, for https/wss on this machine.

    python -m tools.tls_cert --out .cache/tls --host localhost --host 127.0.0.1

What `make run ARGS="--tls"` and the TLS tests use; nothing here is ever committed. Made with the
`openssl` command (the `cryptography` package is not a dependency of this project):

- `ca.pem`: the authority to trust (once, in the browser or the system store; `NODE_EXTRA_CA_CERTS` for
  Node, `SSL_CERT_FILE` or `--cacert` for Python and curl). Its key is deleted as soon as it has signed,
  so trusting it lets nobody mint other certificates;
- `cert.pem` (the server's certificate, then the CA's) and `key.pem`: `--tls-cert` and `--tls-key`.

Browsers refuse a self-signed leaf marked as a CA, and a self-signed leaf is not a CA they accept to
trust, hence the two. EC P-256 keys, SHA-256, subjectAltName for every host, serverAuth only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
DAYS = 30
_RENEW_S = 86_400  # a certificate that expires within a day is made again


@dataclass(frozen=True)
class LocalTls:
    ca: Path  # the certificate a client trusts
    cert: Path  # the server's chain: --tls-cert
    key: Path  # its key: --tls-key


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is needed to make a local certificate (apt-get install openssl)")
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-600:]}")


def _san(hosts: Sequence[str]) -> str:
    def entry(h: str) -> str:
        try:
            return f"IP:{ipaddress.ip_address(h)}"
        except ValueError:
            return f"DNS:{h}"
    return ",".join(entry(h) for h in hosts)


def make_local_tls(folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = DAYS) -> LocalTls:
    """A fresh CA and a certificate for `hosts` in `folder` (created, private: 0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    out = LocalTls(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        t = Path(tmp)
        _openssl("req", "-x509", *ec, "-sha256", "-days", str(days), "-keyout", str(t / "ca.key"),
                 "-out", str(t / "ca.pem"), "-subj", "/CN=personaplex-serve local CA",
                 "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        _openssl("req", *ec, "-keyout", str(t / "key.pem"), "-out", str(t / "leaf.csr"), "-subj", f"/CN={hosts[0]}")
        (t / "leaf.ext").write_text(f"subjectAltName={_san(hosts)}\nbasicConstraints=critical,CA:FALSE\n"
                                    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
        _openssl("x509", "-req", "-in", str(t / "leaf.csr"), "-CA", str(t / "ca.pem"), "-CAkey", str(t / "ca.key"),
                 "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-sha256", "-days", str(days),
                 "-extfile", str(t / "leaf.ext"), "-out", str(t / "leaf.pem"))
        (t / "key.pem").chmod(0o600)
        (t / "chain.pem").write_text((t / "leaf.pem").read_text() + (t / "ca.pem").read_text())
        # The CA's key goes with the temporary folder: it has signed its one certificate.
        os.replace(t / "key.pem", out.key)
        os.replace(t / "chain.pem", out.cert)
        os.replace(t / "ca.pem", out.ca)
    (folder / "hosts").write_text("\n".join(hosts) + "\n")
    return out


def ensure_local_tls(folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> LocalTls:
    """The files in `folder` if they are there, name these hosts and stay valid another day; else new ones
    (a new CA too: trust it again)."""
    out = LocalTls(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    names = folder / "hosts"
    if all(p.is_file() for p in (out.ca, out.cert, out.key, names)) and names.read_text().split() == list(hosts):
        try:
            _openssl("x509", "-checkend", str(_RENEW_S), "-noout", "-in", str(out.cert))
            return out
        except RuntimeError:
            pass  # expires soon (or unreadable): make new ones
    return make_local_tls(folder, hosts)


def spki_sha256(cert: Path) -> str:
    """Base64 SHA-256 of the certificate's public key: what Chromium's --ignore-certificate-errors-spki-list
    takes, to trust one certificate in a throwaway profile."""
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is needed (apt-get install openssl)")
    pem = subprocess.run([exe, "x509", "-pubkey", "-noout", "-in", str(cert)], capture_output=True, check=True,
                         timeout=30).stdout
    der = subprocess.run([exe, "pkey", "-pubin", "-outform", "der"], input=pem, capture_output=True, check=True,
                         timeout=30).stdout
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def trust_hint(tls: LocalTls) -> str:
    """How to make clients trust the local CA, for a person to read."""
    return f"""  The certificate is signed by a local CA made for this machine: {tls.ca}
  Trust it once (it signs nothing else; its key is gone):
    curl / Python:   curl --cacert {tls.ca} ...   SSL_CERT_FILE={tls.ca} python ...
    Node:            NODE_EXTRA_CA_CERTS={tls.ca} node ...
    Chromium/Chrome: certutil -d sql:$HOME/.pki/nssdb -A -t C,, -n personaplex-local-ca -i {tls.ca}
                     (or Settings > Privacy and security > Security > Manage certificates > Authorities > Import)
    Firefox:         Settings > Privacy & Security > Certificates > View Certificates > Authorities > Import
    Debian/Ubuntu:   sudo cp {tls.ca} /usr/local/share/ca-certificates/personaplex-local-ca.crt &&
                     sudo update-ca-certificates"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tls_cert", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for ca.pem, cert.pem and key.pem")
    p.add_argument("--host", action="append", help=f"a name or address the certificate is for (default: "
                                                   f"{', '.join(DEFAULT_HOSTS)})")
    a = p.parse_args(argv)
    tls = ensure_local_tls(a.out, tuple(a.host or DEFAULT_HOSTS))
    print(f"--tls-cert {tls.cert} --tls-key {tls.key}\n{trust_hint(tls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
