"""Which address the gateway logs for a connection (services/gateway/client_address.py): X-Forwarded-For
is believed only from a trusted proxy, read from the right, and a client's own entries are never used."""

from __future__ import annotations

import pytest

from services.gateway.client_address import client_address, parse_networks

PROXIES = parse_networks("10.0.0.0/8, fd00::/8")


@pytest.mark.parametrize("peer,xff,expected", [
    ("203.0.113.9", [], "203.0.113.9"),  # no proxy
    ("203.0.113.9", ["198.51.100.1"], "203.0.113.9"),  # an untrusted peer's header is ignored
    ("10.1.2.3", ["198.51.100.1"], "198.51.100.1"),  # the proxy names the client
    ("10.1.2.3", ["6.6.6.6, 198.51.100.1"], "198.51.100.1"),  # what the client wrote itself stays unused
    ("10.1.2.3", ["6.6.6.6", "198.51.100.1, 10.9.9.9"], "198.51.100.1"),  # two proxies, two header lines
    ("10.1.2.3", ["198.51.100.1:5555"], "198.51.100.1"),  # with a port
    ("fd00::5", ["[2001:db8::7]:443"], "2001:db8::7"),
    ("10.1.2.3", ["not-an-ip, 10.4.4.4"], "10.4.4.4"),  # a malformed hop ends the chain
    ("10.1.2.3", [], "10.1.2.3"),  # the proxy's own request
    (None, ["198.51.100.1"], "unknown"),
])
def test_forwarded_for_is_believed_only_from_a_trusted_proxy(peer, xff, expected):
    assert client_address(peer, xff, PROXIES) == expected


def test_with_no_trusted_proxies_the_header_is_ignored_and_bad_cidrs_are_refused():
    assert client_address("10.1.2.3", ["198.51.100.1"], ()) == "10.1.2.3"
    assert parse_networks("") == ()
    with pytest.raises(ValueError, match="'10.0.0.0/33'"):
        parse_networks("10.0.0.0/8,10.0.0.0/33")


def test_a_chain_of_proxies_only_is_read_as_far_as_the_bound():
    chain = ", ".join(["198.51.100.1"] + [f"10.0.0.{i}" for i in range(1, 40)])
    assert client_address("10.1.2.3", [chain], PROXIES) == "10.0.0.24"  # the 16th hop from the right
