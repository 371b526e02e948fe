"""One client socket, bounded in time and bytes whatever the client does (or does not) read.

`ClientConnection` is websockets' ServerConnection with the bounds the library does not keep:

    writes           a write that waits `send_timeout_s` for a client that does not read (a message,
                     a close frame, a keepalive ping, an HTTP answer) fails, and the transport is
                     aborted: every close and ping has a deadline (then websockets' close_timeout
                     for the closing handshake)
    write buffer     once the WebSocket is open, past `write_buffer_bytes` unsent in the transport
                     (pongs to a ping flood, a close behind queued output) it is aborted at once
    the request      its head and body are due within `request_timeout_s` of the connection, else
                     408 request_timeout; an answer the request parser gave (400, 413, ...) waits at
                     most close_timeout for the client to close
    the count        `OpenSockets` counts an admitted WebSocket from its upgrade until its transport
                     is gone (connection_lost): the connection cap sees closing sockets too
    the hand-off     until its handshake is answered a connection keeps every byte it received (at most
                     HEAD_BYTES + HANDOFF_EXTRA_BYTES), so that `hand_off` can give the transport and
                     those bytes, exactly as received, to another protocol (resume_relay.py)

Requests are read by http_requests.parse (strict, nothing buffered before the route says so).
`connection_factory(...)` is the `create_connection` for websockets' serve().
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from websockets.asyncio.server import ServerConnection
from websockets.protocol import CONNECTING
from websockets.server import ServerProtocol

from services.gateway import http_requests

log = logging.getLogger("gateway.connection")

HANDOFF_EXTRA_BYTES = 16 * 1024  # received after the request head and before its answer; more is not handed off


@dataclass(frozen=True)
class Limits:
    send_timeout_s: float
    write_buffer_bytes: int
    request_timeout_s: float


class OpenSockets:
    """The admitted WebSockets whose transport is not gone yet."""

    def __init__(self) -> None:
        self._held: set[ClientConnection] = set()

    def __len__(self) -> int:
        return len(self._held)

    def admit(self, conn: "ClientConnection") -> None:
        if not conn.lost:
            self._held.add(conn)

    def discard(self, conn: "ClientConnection") -> None:
        self._held.discard(conn)


def connection_factory(limits: Limits, route: http_requests.Route, budget: http_requests.BodyBudget,
                       sockets: OpenSockets, on_abort: Callable[[str], None]):
    """websockets' `create_connection`: each connection reads its request with http_requests.parse and
    keeps `limits`; `on_abort(reason)` is told of each transport it aborts (send_timeout,
    write_buffer, request_timeout)."""

    def create(protocol: ServerProtocol, *args, **kwargs) -> ClientConnection:
        protocol.parser = http_requests.parse(protocol, route, budget)  # nothing was fed yet
        next(protocol.parser)
        return ClientConnection(protocol, *args, limits=limits, budget=budget, sockets=sockets, on_abort=on_abort,
                                **kwargs)

    return create


class ClientConnection(ServerConnection):
    def __init__(self, protocol: ServerProtocol, *args, limits: Limits, budget: http_requests.BodyBudget,
                 sockets: OpenSockets, on_abort: Callable[[str], None], **kwargs):
        super().__init__(protocol, *args, **kwargs)
        self.limits, self._budget, self._sockets, self._on_abort = limits, budget, sockets, on_abort
        self.lost = False
        self._answered = False  # the request parser or the read deadline answered: the abort is scheduled
        self._timers: list[asyncio.TimerHandle] = []
        self._received: bytearray | None = bytearray()  # every byte until the handshake's answer (hand_off)

    # ---- the request ------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._timers.append(self.loop.call_later(self.limits.request_timeout_s, self._request_overdue))

    def _request_overdue(self) -> None:
        if self.request is not None or self.protocol.eof_sent or self.lost:
            return
        self.protocol.handshake_exc = TimeoutError(f"no whole request in {self.limits.request_timeout_s:g} s")
        self.protocol.send_response(http_requests.error_response(
            408, "request_timeout", f"the request's head and body are due within {self.limits.request_timeout_s:g} s"))
        self._abort_later("request_timeout")
        self.send_data()

    def data_received(self, data: bytes) -> None:
        if self._received is not None:
            if self.protocol.state is CONNECTING and \
                    len(self._received) + len(data) <= http_requests.HEAD_BYTES + HANDOFF_EXTRA_BYTES:
                self._received += data
            else:
                self._received = None  # answered, or more than a request came: nothing to hand off
        super().data_received(data)
        if self.request is None and self.protocol.eof_sent:  # the request parser answered: close soon
            self._abort_later(None)

    def _abort_later(self, reason: str | None) -> None:
        """The client has had its answer: it closes within close_timeout, or its transport is aborted."""
        if self._answered:
            return
        self._answered = True
        if reason is not None:
            self._on_abort(reason)
        self._timers.append(self.loop.call_later(self.close_timeout or 0, self.transport.abort))

    # ---- writes -----------------------------------------------------------------------------

    def send_data(self) -> None:
        if self._received is not None and (self.protocol.writes or self.protocol.state is not CONNECTING):
            self._received = None  # an answer (a 101, a refusal, a 100 Continue) goes out: no hand-off now
        super().send_data()
        if (self.protocol.state is not CONNECTING and not self.transport.is_closing()
                and self.transport.get_write_buffer_size() > self.limits.write_buffer_bytes):
            log.warning("client %s: %d bytes unsent (more than %d): aborted", self.remote_address,
                        self.transport.get_write_buffer_size(), self.limits.write_buffer_bytes)
            self._on_abort("write_buffer")
            self.transport.abort()

    async def drain(self) -> None:
        """websockets' drain, with a deadline: raising here makes websockets abort the transport and
        raise ConnectionClosed to the writer (a send, close or ping)."""
        if not self.paused:
            return await super().drain()
        try:
            async with asyncio.timeout(self.limits.send_timeout_s):
                await super().drain()
        except TimeoutError:
            log.warning("client %s read nothing for %g s: aborted", self.remote_address, self.limits.send_timeout_s)
            self._on_abort("send_timeout")
            raise TimeoutError(f"the client read nothing for {self.limits.send_timeout_s:g} s") from None

    # ---- the hand-off ---------------------------------------------------------------------------

    def hand_off(self) -> tuple[asyncio.Transport, bytes] | None:
        """Let go of the transport before the handshake is answered: (the transport, every byte received on
        it, exactly as received) for another protocol to take over (transport.set_protocol). websockets then
        sees this connection lost: it answers nothing and closes nothing, and the cap and the body budget no
        longer count it. None: there is nothing to hand off (answered, lost, or more than a request came)."""
        if self._received is None or self.lost or self.protocol.state is not CONNECTING \
                or self.transport.is_closing():
            return None
        transport, received = self.transport, bytes(self._received)
        self._received = None
        self.transport = _HandedOff()
        self.connection_lost(None)
        return transport, received

    # ---- the end ----------------------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for timer in self._timers:
            timer.cancel()
        self._sockets.discard(self)
        self._budget.release(getattr(self.protocol, "body_reserved", 0))
        self.protocol.body_reserved = 0
        super().connection_lost(exc)


class _HandedOff(asyncio.Transport):
    """What a connection holds once it handed its transport off: websockets ends a connection that did not
    open by aborting its transport (and its timers might), and that transport is another protocol's now."""

    def is_closing(self) -> bool:
        return True

    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass
