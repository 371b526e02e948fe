"""HTTP + WebSocket routing on one port.

    /v1/realtime   WebSocket: the Realtime duplex wire (realtime.py); query duplex=1|true|on (or absent)
    /api/chat      WebSocket: PersonaPlex's native Ogg/Opus protocol (native.py)
                   (the WebSocket paths are WS_ROUTES: path -> the wire's session class; a third wire is
                   one ClientSession subclass and one row)
    /v1/realtime/client_secrets   POST with the API key: a short-lived client secret for a browser (auth.py)
    /health        readiness: 200 when some cell is serving and not draining, else 503 (body says why)
    /health/live   liveness: 200 while the process answers (a cell outage must not restart the gateway)
    /metrics       Prometheus text format
    /v1/voices     the voice list; with --voice-upload, PUT/DELETE /v1/voices/NAME (voices.py)
    /              the browser page: files of the static folder (index.html at /)

With `--workers N` each worker process runs one Gateway on its own listening socket of the shared
port (services/gateway/workers.py): its own cell pool and capacity polls, its own sessions. It also
serves the same routes on a private Unix socket, where the other workers pipe the resumes of its
sessions that the kernel handed to them (resume_relay.py).

Every connection reads its request strictly, with nothing of a body read before its route and key
are checked (http_requests.py), and keeps its socket bounded in time and bytes whatever the client
reads (client_connection.py). Bodies: PUT /v1/voices/NAME (voices.py says when), POST
client_secrets (at most CLIENT_SECRET_BODY_BYTES, ignored); every other route takes none (413).
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import os
import signal
import socket
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from services.gateway import auth, resume_relay, tls
from services.gateway.admission import Releases
from services.gateway.cells import CellPool
from services.gateway.client_address import client_address
from services.gateway.client_connection import Limits, OpenSockets, connection_factory
from services.gateway.config import GatewayConfig
from services.gateway.context import GatewayContext
from services.gateway.http_requests import BodyBudget, error_response, json_response, response
from services.gateway.metrics import GatewayMetrics
from services.gateway.native import NativeSession
from services.gateway.realtime import RealtimeSession
from services.gateway.resume import Resumes, ResumeTokens
from services.gateway.resume_relay import RelayLimits, ResumeRelay
from services.gateway.session import ClientSession
from services.gateway.voices import PREFIX as VOICES_PREFIX
from services.gateway.voices import Voices

log = logging.getLogger("gateway.server")

# A WebSocket path -> its wire's adapter: `at_upgrade` (checks before the 101) and `for_connection`
# (the session `run` serves), both ClientSession classmethods.
WS_ROUTES: dict[str, type[ClientSession]] = {
    "/v1/realtime": RealtimeSession,
    "/api/chat": NativeSession,
}
CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"
CLIENT_SECRET_BODY_BYTES = 64 * 1024  # OpenAI's SDKs send a session config; it is read and ignored
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".wasm": "application/wasm",
    ".wav": "audio/wav",
    ".txt": "text/plain; charset=utf-8",
}


class Gateway:
    def __init__(self, config: GatewayConfig, *, worker: int = 0, listen_socket: socket.socket | None = None,
                 metrics_dir: str | None = None, relay_dir: str | None = None):
        """Alone: listens on config.host:port. As worker `worker` of config.workers: serves the
        supervisor's `listen_socket`, renders /metrics from every worker's `metrics_dir`, and serves
        and reaches the workers' resume relay sockets in `relay_dir` (resume_relay.py)."""
        self.config = config
        self.worker = worker
        self._listen_socket = listen_socket
        self._relay_dir = relay_dir
        self.metrics = GatewayMetrics(worker, metrics_dir)
        self.pool = CellPool(config, on_poll=self.metrics.observe_cells)
        self.voices = Voices(config, self.pool, self.metrics)
        self.releases = Releases()
        self.resumes = Resumes(ResumeTokens(worker, config.api_key), config.resume_grace_s)
        self.ctx = GatewayContext(config, self.pool, self.metrics, self.voices, self.releases,  # what sessions see
                                  self.resumes)
        self.tls = tls.server_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        self.secrets = auth.ClientSecrets(config.api_key, config.client_secret_ttl_s, config.client_secret_rate,
                                          config.client_secret_burst)
        self.sockets = OpenSockets()  # the connection cap counts these
        self.bodies = BodyBudget(config.body_buffer_bytes)
        self.relay = ResumeRelay(relay_dir, worker, config.workers,
                                 RelayLimits(config.send_timeout_s, config.close_timeout_s), self.metrics)
        self.server: Server | None = None
        self.relay_server: Server | None = None  # this worker's routes on its Unix socket (resume_relay.py)

    @property
    def port(self) -> int:
        assert self.server is not None
        return next(iter(self.server.sockets)).getsockname()[1]

    async def start(self) -> None:
        await self.pool.start()
        await self.pool.wait_first_poll()
        sock = self._listen_socket
        where = {"sock": sock} if sock else {"host": self.config.host, "port": self.config.port}
        cfg = self.config
        limits = Limits(cfg.send_timeout_s, cfg.write_buffer_bytes, cfg.request_timeout_s)
        options = dict(
            process_request=self._process_request,
            max_size=cfg.max_message_bytes,
            max_queue=4,  # received messages waiting for a session's reader: at most 4 x max_size bytes
            select_subprotocol=auth.select_subprotocol,
            server_header="personaplex-gateway",
            create_connection=connection_factory(limits, self._body_refusal, self.bodies, self.sockets,
                                                 lambda reason: self.metrics.client_aborts.labels(reason).inc()),
            close_timeout=cfg.close_timeout_s,
            # /api/chat opens its session (prompt prefill included) before the upgrade's answer.
            open_timeout=max(10.0, cfg.open_timeout_s + 5.0),
        )
        self.server = await serve(self._handle, **where, ssl=self.tls, **options)
        if self._relay_dir is not None:  # plaintext: the relaying worker terminated the client's TLS
            self.relay_server = await serve(self._handle, sock=resume_relay.listen(self._relay_dir, self.worker),
                                            **options)
        log.info("gateway%s listening on http%s://%s:%d (%d cell(s) configured%s)",
                 f" worker {self.worker}" if self.config.workers > 1 else "", "s" if self.tls else "",
                 self.config.host, self.port, len(self.config.cells),
                 f", DNS {self.config.cells_dns}" if self.config.cells_dns else "")

    async def stop(self) -> None:
        self.resumes.end_paused()  # a paused session's grace would hold the close; none pauses from here on
        servers = [s for s in (self.server, self.relay_server) if s is not None]
        for server in servers:
            server.close()  # closes live sockets (1001); their sessions release their streams
        await self.relay.close()  # the servers wait for every transport, the relays' too
        for server in servers:
            await server.wait_closed()
        await self.pool.stop()

    # ---- HTTP -------------------------------------------------------------

    def _body_refusal(self, method: str, target: str, headers: Headers, length: int | None) -> Response | None:
        """http_requests' route: whether this request's body may be read (None) or the answer to give
        before reading it. Runs on the head alone, so the key is checked before any body byte is read."""
        path = urlsplit(target).path
        if path.startswith(VOICES_PREFIX + "/") and method == "PUT":
            return self.voices.before_body(path, headers, length)
        cap = 0
        if path == CLIENT_SECRETS_PATH and method == "POST":
            if self.config.api_key and not auth.bearer_is_key(self.config.api_key, headers):
                return self._unauthorized("minting a client secret needs the API key as bearer token")
            cap = CLIENT_SECRET_BODY_BYTES
        if length is not None and length > cap:
            return error_response(413, "body_too_large", f"{method} {path[:80]} takes at most {cap} bytes of body, "
                                                         f"got a Content-Length of {length}")
        return None

    async def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        path = url.path
        if (route := WS_ROUTES.get(path)) is not None:
            if request.headers.get("Upgrade", "").lower() != "websocket":
                return response(426, b"this endpoint is a WebSocket\n", "text/plain; charset=utf-8",
                                [("Upgrade", "websocket")])
            if len(self.sockets) + len(self.relay) >= self.config.max_connections:
                self.metrics.errors.labels("server_error", "server_busy").inc()
                busy = f"this gateway holds {self.config.max_connections} connections; retry shortly"
                return error_response(503, "server_busy", busy, [("Retry-After", "1")])
            if route.resumable and (owner := self.relay.owner(request.headers)) is not None:
                self._bound_send_buffer(conn)
                peer = conn.remote_address[0] if conn.remote_address else None
                client = client_address(peer, request.headers.get_all("X-Forwarded-For"), self.config.trusted_proxies)
                return await self.relay.take(conn, owner, client)  # the owner checks the key, the token, the rest
            admission = self.secrets.admit(request.headers)
            if admission is auth.Admission.SPENT:
                return self._unauthorized("this client secret already opened its connection: mint one per connection")
            if admission is auth.Admission.BUSY:
                return error_response(429, "rate_limit_exceeded", "too many client secrets are in use; retry "
                                      "shortly", [("Retry-After", "1")])
            if admission is auth.Admission.REFUSED:
                return self._unauthorized(
                    "missing or wrong API key (a bearer header or the openai-insecure-api-key. subprotocol)")
            self.sockets.admit(conn)
            query = dict(parse_qsl(url.query))
            self._bound_send_buffer(conn)
            return await route.at_upgrade(self.ctx, conn, query)  # None: go on with the WebSocket handshake
        if path == CLIENT_SECRETS_PATH:
            return self._client_secret(request)
        if path == "/health":
            state = self.pool.admission_state()
            body = {"status": {"ready": "ok", "draining": "draining", "down": "unavailable"}[state],
                    **self.pool.capacity_summary(),
                    "cell_detail": [c.describe() for c in self.pool.cells.values()],
                    "worker": {"index": self.worker, "pid": os.getpid(), "workers": self.config.workers}}
            return json_response(200 if state == "ready" else 503, body)
        if path == "/health/live":
            return json_response(200, {"status": "alive"})
        if path == VOICES_PREFIX or path.startswith(VOICES_PREFIX + "/"):
            return await self.voices.handle(request)
        if path == "/metrics":
            return response(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        return self._static(path)

    def _bound_send_buffer(self, conn: ServerConnection) -> None:
        sock = conn.transport.get_extra_info("socket")
        if sock is not None and self.config.send_buffer_bytes > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer_bytes)

    def _unauthorized(self, message: str) -> Response:
        self.metrics.errors.labels("invalid_request_error", "unauthorized").inc()
        return error_response(401, "unauthorized", message)

    def _client_secret(self, request: Request) -> Response:
        """Mint a short-lived client secret for a browser, for one connection. Only the API key itself
        mints one (a client secret cannot extend itself); with no key configured the secret is accepted
        but not needed. Minting is rate-limited (auth.ClientSecrets)."""
        if request.method != "POST":
            return response(405, b"POST with the API key as bearer token\n", "text/plain; charset=utf-8",
                            [("Allow", "POST")])
        if self.config.api_key and not auth.bearer_is_key(self.config.api_key, request.headers):
            return self._unauthorized("minting a client secret needs the API key as bearer token")
        try:
            value, expires_at = self.secrets.mint()
        except auth.RateLimited as e:
            self.metrics.errors.labels("invalid_request_error", "rate_limit_exceeded").inc()
            return error_response(429, "rate_limit_exceeded", f"client secrets are minted at most "
                                  f"{self.config.client_secret_rate:g} a second; {e}",
                                  [("Retry-After", str(e.retry_after_s))])
        return json_response(200, {"value": value, "expires_at": expires_at})

    def _static(self, path: str) -> Response:
        if any(c < " " or c == "\x7f" for c in path):  # NUL and other control characters name no file
            return response(400, b"bad path\n", "text/plain; charset=utf-8")
        root = Path(self.config.static_dir).resolve()
        rel = "index.html" if path in ("", "/") else path.lstrip("/")
        try:
            target = (root / rel).resolve()
            found = root in target.parents and target.is_file()
        except (OSError, ValueError):  # a name the file system refuses (too long, ...)
            found = False
        if not found:
            return response(404, b"not found\n", "text/plain; charset=utf-8")
        ctype = (_CONTENT_TYPES.get(target.suffix.lower()) or mimetypes.guess_type(target.name)[0]
                 or "application/octet-stream")
        return response(200, target.read_bytes(), ctype)

    # ---- WebSocket ---------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        url = urlsplit(ws.request.path)
        query = dict(parse_qsl(url.query))
        session = WS_ROUTES[url.path].for_connection(ws, self.ctx, query)
        peer = ws.remote_address[0] if ws.remote_address else None
        log.info("%s %s from %s", url.path, session.session_id,
                 client_address(peer, ws.request.headers.get_all("X-Forwarded-For"), self.config.trusted_proxies))
        self.metrics.websockets_taken.inc()
        try:
            await session.run()  # counts its connection in websockets_open while it serves it
        except Exception:
            log.exception("session on %s ended with an unexpected error", url.path)
            self.metrics.errors.labels("server_error", "internal").inc()


async def serve_until_signalled(gateway: Gateway) -> None:
    """Start, serve until SIGINT or SIGTERM, then close every session and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    await stop.wait()
    log.info("stopping: closing sessions")
    await gateway.stop()
