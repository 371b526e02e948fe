"""A resume that lands on another worker of the same gateway: piped to the worker that holds its session.

With `--workers N` the kernel picks each new connection's worker (workers.py), so a reconnect reaches the
worker holding its session 1/N of the time. Each worker therefore also serves its routes, with the same
server code, on a Unix socket of its own: `worker-<i>.sock` in a directory private to this gateway start
(made 0700 by the supervisor, removed at its exit). A worker that reads the upgrade request of a resume
whose token names another worker answers nothing itself: it connects to that worker's socket, writes every
byte the client sent (the request exactly as received), and pipes bytes both ways until either end closes.
The owner sees an ordinary resume and answers it as ever, so every check (the API key, the token's MAC
under the owner's own secret, the session's status) stays where it was; the relaying worker checks only
its connection cap, where the relayed connection counts as any other. The owner's peer is the Unix socket,
so the client's address is logged by the relaying worker.

The bytes are plaintext: with TLS the relaying worker terminates it, and the Unix hop carries what TLS
decrypted.

Bounds. Each direction reads at most CHUNK_BYTES at a time and writes it before it reads more; a write
whose drain waits more than send_timeout_s ends the relay. Each side's reader stops reading its socket
past 2 x CHUNK_BYTES unread. Closes: when the client's side ends (EOF, reset), the owner's write side is
shut, so the owner sees its connection go (and pauses or ends the session as for a direct connection),
and the owner has close_timeout_s to close its side; when the owner's side ends, the client's is closed
after what is written has flushed. Every close waits at most close_timeout_s, then aborts.

Refusals, at once and typed: a token naming a worker this gateway does not have is 421 resume_wrong_worker
(it comes from another gateway or pod); a worker whose socket does not answer is 404 session_not_found (it
is restarting, and its sessions are gone with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
from dataclasses import dataclass

from websockets.datastructures import Headers
from websockets.http11 import Response

from services.gateway.client_connection import ClientConnection
from services.gateway.http_requests import error_response
from services.gateway.metrics import GatewayMetrics
from services.gateway.resume import offered_token, token_worker

log = logging.getLogger("gateway.resume_relay")

CHUNK_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 2.0  # a local socket answers at once or not at all
LISTEN_BACKLOG = 100
MAX_PATH_BYTES = 107  # sockaddr_un's sun_path, less its NUL


class Outcome(enum.Enum):
    """A resume for another worker (the metric's label)."""

    RELAYED = "relayed"  # piped to the owner, which answers it
    OWNER_UNREACHABLE = "owner_unreachable"  # 404: its socket did not answer (the worker is restarting)
    NO_SUCH_WORKER = "no_such_worker"  # 421: the token names a worker this gateway does not have


@dataclass(frozen=True)
class RelayLimits:
    send_timeout_s: float  # a write to either side drains within this long
    close_timeout_s: float  # a close (and the owner's close after the client's end) within this long


def socket_path(directory: str, worker: int) -> str:
    return os.path.join(directory, f"worker-{worker}.sock")


def listen(directory: str, worker: int) -> socket.socket:
    """This worker's listening Unix socket; a previous run of the same worker index left its file behind."""
    path = socket_path(directory, worker)
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"the resume relay socket path {path!r} is longer than {MAX_PATH_BYTES} bytes: "
                         "set TMPDIR to a shorter directory")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        s.listen(LISTEN_BACKLOG)
    except OSError:
        s.close()
        raise
    return s


class ResumeRelay:
    """This worker's relays of resumes to the other workers (module doc). Everything runs on the event loop."""

    def __init__(self, directory: str | None, worker: int, workers: int, limits: RelayLimits,
                 metrics: GatewayMetrics):
        """`directory` None: a lone gateway, nothing to relay to."""
        self.directory, self.worker, self.workers = directory, worker, workers
        self.limits, self.metrics = limits, metrics
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        """Relayed connections open now (the connection cap counts them)."""
        return len(self._tasks)

    def owner(self, headers: Headers) -> int | None:
        """The other worker a resume request's token names; None when this worker answers the request itself
        (no relay here, not a resume, a malformed token, or a token of this worker)."""
        if self.directory is None or (token := offered_token(headers)) is None:
            return None
        worker = token_worker(token)
        return None if worker is None or worker == self.worker else worker

    async def take(self, conn: ClientConnection, owner: int, client: str) -> Response:
        """Pipe `conn` to worker `owner`; the refusal to send when it cannot be. Once handed off, what this
        returns is never sent (websockets sees the connection lost)."""
        if owner >= self.workers:
            self.metrics.resume_relays.labels(Outcome.NO_SUCH_WORKER.value).inc()
            return error_response(421, "resume_wrong_worker", f"the resume token names gateway worker {owner}, and "
                                  f"this gateway has {self.workers}: it comes from another gateway (or pod)")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                owner_r, owner_w = await asyncio.open_unix_connection(socket_path(self.directory, owner),
                                                                      limit=CHUNK_BYTES)
        except (OSError, TimeoutError) as e:
            self.metrics.resume_relays.labels(Outcome.OWNER_UNREACHABLE.value).inc()
            log.warning("resume for worker %d: its socket does not answer (%s)", owner, type(e).__name__)
            return error_response(404, "session_not_found", f"gateway worker {owner}, which held this session, is "
                                  "not running (it restarted, and its sessions are gone)")
        handed = conn.hand_off()
        if handed is None:  # the client went away meanwhile, or sent more than a request before its answer
            owner_w.transport.abort()
            return error_response(400, "bad_request", "a WebSocket client waits for the upgrade's answer")
        transport, received = handed
        loop = asyncio.get_running_loop()
        client_r = asyncio.StreamReader(limit=CHUNK_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(client_r, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        client_w = asyncio.StreamWriter(transport, protocol, client_r, loop)
        self.metrics.resume_relays.labels(Outcome.RELAYED.value).inc()
        log.info("a resume from %s piped to worker %d (its log names the session)", client, owner)
        task = asyncio.create_task(self._pipe(client_r, client_w, owner_r, owner_w, received))
        self._tasks.add(task)
        self.metrics.resume_relays_open.inc()
        task.add_done_callback(self._done)
        return error_response(500, "handed_off", "this connection was handed to another worker (never sent)")

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.metrics.resume_relays_open.dec()
        if not task.cancelled() and task.exception() is not None:
            log.error("resume relay failed", exc_info=task.exception())

    async def _pipe(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                    owner_r: asyncio.StreamReader, owner_w: asyncio.StreamWriter, received: bytes) -> None:
        to_owner = asyncio.create_task(self._copy(client_r, owner_w, received))
        to_client = asyncio.create_task(self._copy(owner_r, client_w, b""))
        try:
            await asyncio.wait({to_owner, to_client}, return_when=asyncio.FIRST_COMPLETED)
            if not to_client.done():  # the client's side ended: the owner sees its connection go, then closes
                with contextlib.suppress(OSError):
                    owner_w.write_eof()
                await asyncio.wait({to_client}, timeout=self.limits.close_timeout_s)
        finally:
            for task in (to_owner, to_client):
                task.cancel()
            await asyncio.gather(to_owner, to_client, return_exceptions=True)
            await asyncio.gather(self._close(client_w), self._close(owner_w))

    async def _copy(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, first: bytes) -> None:
        """src to dst, CHUNK_BYTES at a time, each drained within send_timeout_s, until src ends."""
        data = first
        try:
            while True:
                if data:
                    dst.write(data)
                    async with asyncio.timeout(self.limits.send_timeout_s):
                        await dst.drain()
                data = await src.read(CHUNK_BYTES)
                if not data:
                    return
        except (OSError, TimeoutError) as e:  # a reset, or a side that reads nothing: the relay ends
            log.info("resume relay: %s", type(e).__name__)

    async def _close(self, w: asyncio.StreamWriter) -> None:
        w.close()
        try:
            async with asyncio.timeout(self.limits.close_timeout_s):
                await w.wait_closed()
        except (OSError, TimeoutError):
            w.transport.abort()

    async def close(self) -> None:
        """At shutdown: every relay ends now (each side closed within close_timeout_s)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
