"""TLS on the gateway's port (services/gateway/tls.py, --tls-cert/--tls-key) and the local CA that
`make run ARGS="--tls"` and the TLS tests make (tools/tls_cert.py): real handshakes on real sockets."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from services.common.config import ConfigError
from services.gateway import tls
from services.gateway.config import GatewayConfig
from tools.tls_cert import ensure_local_tls, make_local_tls

CELL = ["--cells", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return make_local_tls(tmp_path_factory.mktemp("tls"), ("localhost", "127.0.0.1"))


async def handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str = "127.0.0.1") -> str:
    """Connect to a real TLS server on a loopback port; returns the negotiated version."""
    async def echo(reader, writer):
        writer.write(await reader.readexactly(2))
        await writer.drain()
        writer.close()
    srv = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server)
    try:
        port = srv.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=host)
        writer.write(b"hi")
        assert await reader.readexactly(2) == b"hi"
        version = writer.get_extra_info("ssl_object").version()
        writer.close()
        return version
    finally:
        srv.close()


async def test_the_certificate_verifies_for_its_hosts_with_tls_1_3_and_only_from_the_local_ca(local):
    server = tls.server_context(str(local.cert), str(local.key))
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    trusting = ssl.create_default_context(cafile=local.ca)
    assert await handshake(server, trusting) == "TLSv1.3"
    assert await handshake(server, trusting, "localhost") == "TLSv1.3"
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(server, trusting, "elsewhere.example")  # not a name of the certificate
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(server, ssl.create_default_context())  # the system's CAs do not know the local one


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
async def test_clients_older_than_tls_1_2_are_refused(local):
    old = ssl.create_default_context(cafile=local.ca)
    old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("ALL:@SECLEVEL=0")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await handshake(tls.server_context(str(local.cert), str(local.key)), old)
    tls12 = ssl.create_default_context(cafile=local.ca)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    assert await handshake(tls.server_context(str(local.cert), str(local.key)), tls12) == "TLSv1.2"


def test_the_gateway_takes_both_files_or_neither_and_refuses_bad_ones_at_start(local, tmp_path):
    cfg = GatewayConfig.from_args([*CELL, "--tls-cert", str(local.cert), "--tls-key", str(local.key)], env={})
    assert (cfg.tls_cert, cfg.tls_key) == (str(local.cert), str(local.key))
    from_env = GatewayConfig.from_args(CELL, env={"GATEWAY_TLS_CERT": str(local.cert),
                                                  "GATEWAY_TLS_KEY": str(local.key)})
    assert from_env.tls_cert == str(local.cert)
    other = make_local_tls(tmp_path / "other", ("localhost",))
    for args, says in ((["--tls-cert", str(local.cert)], "both"),
                       (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(local.key)], "nope.pem"),
                       (["--tls-cert", str(local.cert), "--tls-key", str(other.key)], "--tls-key")):
        with pytest.raises(ConfigError) as e:
            GatewayConfig.from_args([*CELL, *args], env={})
        assert says in str(e.value), str(e.value)
        assert "PRIVATE KEY" not in str(e.value)


def test_the_local_ca_is_made_once_per_host_list_and_its_key_is_not_kept(tmp_path):
    first = ensure_local_tls(tmp_path, ("localhost",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.pem", "cert.pem", "hosts", "key.pem"]
    assert (tmp_path / "key.pem").stat().st_mode & 0o077 == 0
    ca = first.ca.read_bytes()
    assert ensure_local_tls(tmp_path, ("localhost",)).ca.read_bytes() == ca  # reused
    assert ensure_local_tls(tmp_path, ("localhost", "personaplex.test")).ca.read_bytes() != ca  # other hosts: new
