"""One Realtime duplex WebSocket: raw events in, timestamped on the monotonic clock.

The driver speaks the wire directly (no client library's alias table), so a server-side event
rename cannot silently turn real audio into a zero-output measurement.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class SessionLost(RuntimeError):
    """The connection ended (or its reader failed) while the driver was waiting on it."""


# The model name the gateway shows clients; it accepts any (cut to 128 characters).
SDK_MODEL = "nvidia/personaplex-7b-v1"
# What answers the open of each style (config.OPENS): the driver streams after it.
OPEN_ANSWER = {"autostart0": "session.created", "sdk": "session.updated"}


def realtime_url(base: str, model: str | None, open_style: str = "autostart0") -> str:
    """The duplex URL of an open style. autostart0: `autostart=0`, so the driver's own session.update
    opens the session. sdk: `?model=` as the SDKs connect, so the server autostarts a session with
    its defaults at once (and the session.update that follows changes it)."""
    parts = urlsplit(base)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.setdefault("duplex", "1")
    if open_style == "sdk":
        query.pop("autostart", None)
        query["model"] = model or SDK_MODEL
    else:
        query["autostart"] = "0"
        if model:
            query["model"] = model
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/v1/realtime", urlencode(query), parts.fragment))


def session_update(*, model: str | None, voice: str, persona: str, input_format: str) -> dict[str, Any]:
    session: dict[str, Any] = {
        "modalities": ["audio", "text"],
        "input_audio_format": input_format,
        "output_audio_format": "pcm16",
        "voice": voice,
        "instructions": persona,
        "turn_detection": None,
    }
    if model:
        session["model"] = model
    return {"type": "session.update", "session": session}


class RawRealtimeClient:
    """A raw-event Realtime connection. `events[i]` arrived at `received_at[i]` (time.monotonic())."""

    def __init__(self, url: str, *, cleanup_timeout_s: float) -> None:
        self.url = url
        self.cleanup_timeout_s = cleanup_timeout_s
        self.events: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        self.protocol_faults: list[str] = []  # fixed codes: non_json_event, binary_message, untyped_event
        self.connect_started_at: float | None = None
        self.close_requested = False  # the driver asked for the end (session.close, or its own close)
        self.close_code: int | None = None  # the WebSocket's close code, once the server ended it
        self.ended_by_server = False  # the connection ended before the driver asked
        self.closed_at: float | None = None  # when the server's close arrived
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._lost: str | None = None

    # -- connection -------------------------------------------------------------------------

    async def connect(self, timeout_s: float) -> None:
        self.connect_started_at = time.monotonic()
        self._ws = await connect(
            self.url,
            open_timeout=timeout_s,
            close_timeout=self.cleanup_timeout_s,
            max_size=MAX_MESSAGE_BYTES,
            compression=None,
        )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            async for message in ws:
                now = time.monotonic()
                if isinstance(message, bytes):
                    self.protocol_faults.append("binary_message")
                    continue
                try:
                    event = json.loads(message)
                except ValueError:
                    self.protocol_faults.append("non_json_event")
                    continue
                if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                    self.protocol_faults.append("untyped_event")
                    continue
                self.events.append(event)
                self.received_at.append(now)
                self._wakeup.set()
            self._server_closed(ws)
        except ConnectionClosed:
            self._server_closed(ws)
        except Exception as exc:  # noqa: BLE001 - reported as a type name, the session then fails
            self._lost = f"reader {type(exc).__name__}"
        finally:
            self._wakeup.set()

    def _server_closed(self, ws: ClientConnection) -> None:
        self._lost = "closed"
        self.closed_at = time.monotonic()
        self.close_code = ws.close_code
        self.ended_by_server = not self.close_requested

    @property
    def connected(self) -> bool:
        return self._ws is not None and self._lost is None

    async def send(self, event: dict[str, Any], timeout_s: float) -> None:
        await self.send_text(json.dumps(event), timeout_s)

    async def send_text(self, text: str, timeout_s: float) -> None:
        if self._ws is None or self._lost is not None:
            raise SessionLost(f"send on a lost connection ({self._lost})")
        await asyncio.wait_for(self._ws.send(text), timeout_s)

    async def close(self) -> None:
        """Close the WebSocket: the handshake is bounded by cleanup_timeout_s, then the transport is aborted."""
        self.close_requested = True
        ws, self._ws = self._ws, None
        try:
            if ws is not None:
                try:
                    await asyncio.wait_for(ws.close(), self.cleanup_timeout_s)
                except (TimeoutError, OSError, ConnectionClosed):
                    pass
                finally:
                    if ws.transport is not None:
                        ws.transport.abort()  # no-op after a clean close; ends a stuck one
        finally:
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)
            if self._lost is None:
                self._lost = "closed by driver"

    # -- events -----------------------------------------------------------------------------

    def of_type(self, *types: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] in types]

    def errors(self) -> list[dict[str, Any]]:
        return self.of_type("error")

    def error_codes(self) -> list[str]:
        return self._error_field("code")

    def error_types(self) -> list[str]:
        return self._error_field("type")

    def _error_field(self, key: str) -> list[str]:
        values = []
        for event in self.errors():
            body = event.get("error")
            value = body.get(key) if isinstance(body, dict) else None
            values.append(value if isinstance(value, str) else "unknown")
        return values

    async def wait_for(self, predicate: Callable[[], Any], timeout_s: float, label: str) -> Any:
        """Wait until predicate() is truthy; TimeoutError(label) or SessionLost if the connection ends first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            result = predicate()
            if result:
                return result
            if self._lost is not None:
                raise SessionLost(f"connection {self._lost} while waiting for {label}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"timed out waiting for {label}")
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                pass

    async def open(self, update: dict[str, Any], timeout_s: float, answer: str = "session.created") -> dict[str, Any]:
        """Send session.update; return the first `answer` (OPEN_ANSWER's) or `error` event."""
        await self.send(update, timeout_s)
        return await self.wait_for(
            lambda: next((e for e in self.events if e["type"] in (answer, "error")), None), timeout_s, answer)

    async def request_close(self, timeout_s: float) -> None:
        """session.close, then wait for session.closed; both share one `timeout_s` budget."""

        self.close_requested = True

        async def close_and_ack() -> None:
            await self.send({"type": "session.close"}, timeout_s)
            await self.wait_for(lambda: self.of_type("session.closed"), timeout_s, "session.closed")

        await asyncio.wait_for(close_and_ack(), timeout_s)


def created_session(event: dict[str, Any]) -> dict[str, Any]:
    session = event.get("session")
    return session if isinstance(session, dict) else {}


def session_id_of(event: dict[str, Any]) -> str | None:
    value = created_session(event).get("id")
    return value if isinstance(value, str) and value else None


def capabilities_of(event: dict[str, Any]) -> dict[str, Any] | None:
    caps = created_session(event).get("capabilities")
    return caps if isinstance(caps, dict) else None


def error_code_of(event: dict[str, Any]) -> str | None:
    body = event.get("error")
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None
