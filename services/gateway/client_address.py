"""The client's address for the logs: the socket's peer, or what a trusted proxy says it forwarded for.

A proxy in front (an ingress, a Gateway API data plane) is the socket's peer; it appends the address it
took the request from to `X-Forwarded-For`. That header is believed only when the peer is one of
`--trusted-proxies` (CIDRs), and then read from the right: each hop that is itself a trusted proxy is
skipped, and the first address that is not is the client. Anything a client wrote into the header itself
stands to the left of that and is never used. With no trusted proxies the header is ignored.
"""

from __future__ import annotations

import ipaddress
from typing import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_HOPS = 16  # hops read from the right of the header; a longer chain is cut (the header is a client's to pad)


def parse_networks(text: str) -> tuple[Network, ...]:
    """'10.0.0.0/8, 192.168.1.7' -> networks ('' -> none); ValueError naming a bad entry."""
    nets = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"{part[:60]!r} is not an address or CIDR") from None
    return tuple(nets)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def client_address(peer: str | None, forwarded_for: Sequence[str], trusted: Sequence[Network]) -> str:
    """The address to log for a connection from `peer` carrying these X-Forwarded-For header values."""
    peer_ip = _address(peer or "")
    if peer_ip is None:
        return peer or "unknown"

    def is_trusted(ip) -> bool:
        return any(ip in net for net in trusted)

    if not is_trusted(peer_ip):
        return str(peer_ip)
    hops = [h for value in forwarded_for for h in value.split(",")][-MAX_HOPS:]
    client = peer_ip
    for hop in reversed(hops):
        ip = _address(hop)
        if ip is None:
            break  # a malformed hop: nothing left of it can be believed
        client = ip
        if not is_trusted(ip):
            break
    return str(client)
