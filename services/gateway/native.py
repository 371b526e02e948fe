"""PersonaPlex's native `/api/chat` protocol: binary messages, first byte = kind.

    0  handshake  server -> client, once the prompt prefill is done
    1  audio      Ogg/Opus pages at 24 kHz, both directions (sphn encodes and decodes)
    2  text       server -> client, a UTF-8 text piece (special tokens are never sent)
    5  error      server -> client, a UTF-8 message ("code: message") about a bad client message

Query: `voice_prompt` (a bundled voice such as NATF2.pt, or an alias), `text_prompt` (the persona),
optional `seed`. The session is opened (prompt prefill included) while the HTTP upgrade waits, so a
refusal is an HTTP status a client can act on, never a socket that opens and then closes:
400 for what retrying cannot fix (bad query, unknown voice, persona the model cannot take),
503 with Retry-After when every cell is full, draining or down.
`NativeSession` is this wire's adapter on the shared session (session.py) and its row in
server.WS_ROUTES: it is made at the upgrade (the relay it opens there tells it), decodes Opus into
the same 1920-sample frames as the Realtime wire and renders output frames as Opus pages and text
pieces.
"""

from __future__ import annotations

import asyncio
import math
import logging
import re
import secrets
from dataclasses import dataclass

import numpy as np
import sphn
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Response

from duplex.v1 import talker_pb2
from services.gateway import audio
from services.gateway.admission import release
from services.gateway.context import GatewayContext
from services.gateway.http_requests import json_response
from services.gateway.realtime_wire import ClientError, resolve_voice
from services.gateway.relay import OutputFrame, Relay, RelayError
from services.gateway.session import ClientSession, open_relay

log = logging.getLogger("gateway.native")

KIND_HANDSHAKE, KIND_AUDIO, KIND_TEXT, KIND_ERROR = 0, 1, 2, 5
_SEED = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit also takes '²'); under 2**63 is checked too
RETRY_AFTER_FULL_S, RETRY_AFTER_DOWN_S = 1, 5


@dataclass
class Refusal:
    """An /api/chat upgrade answered with an HTTP error instead of 101."""

    status: int
    error: dict  # {"type", "code", "message"}
    retry_after_s: int | None = None


@dataclass
class _Admitted:
    session: "NativeSession"
    relay: Relay
    claimed: bool = False


_ADMITTED_ATTR = "personaplex_admitted"  # set on the connection by admit_at_upgrade, taken by NativeSession
_background: set[asyncio.Task] = set()


def _in_background(coro) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def admit_at_upgrade(ctx: GatewayContext, conn: ServerConnection, query: dict[str, str]) -> Refusal | None:
    """Validate the query and open the session's relay while the HTTP upgrade waits."""
    cfg = ctx.config
    session_id = "chat_" + secrets.token_hex(8)
    persona = query.get("text_prompt", cfg.default_instructions)
    seed = query.get("seed", "0")
    try:
        voice = resolve_voice(query.get("voice_prompt", cfg.default_voice), dict(cfg.voice_aliases), "voice_prompt",
                              ctx.voices.is_enrolled)
    except ClientError as e:
        return _refused(ctx, session_id, Refusal(400, {"type": e.type, "code": e.code, "message": e.message}))
    if len(persona) > cfg.max_instructions_chars or not _SEED.fullmatch(seed) or int(seed) >= 2**63:
        why = "text_prompt too long or seed not a non-negative integer"
        return _refused(ctx, session_id, Refusal(400, {"type": "invalid_request_error", "code": "bad_event",
                                                       "message": why}))
    sampling = talker_pb2.Sampling(seed=int(seed))
    session = NativeSession(conn, ctx, session_id)  # the relay's listener from its open on
    opening = asyncio.ensure_future(open_relay(ctx, session, session_id, voice, persona, sampling))
    try:
        relay = await asyncio.shield(opening)
    except asyncio.CancelledError:  # the upgrade timed out or the server stops: release what opens later
        opening.add_done_callback(lambda t: t.cancelled() or t.exception()
                                  or _in_background(release(ctx, t.result(), graceful=False)))
        raise
    except RelayError as e:
        error = {"type": e.error_type, "code": e.code, "message": e.message}
        if e.client_fault:
            return _refused(ctx, session_id, Refusal(400, error))
        if e.code == "server_busy" and e.retry_after_s is not None:
            retry = max(1, math.ceil(e.retry_after_s))  # the talker's estimate of its prefill queue
        else:
            retry = RETRY_AFTER_FULL_S if e.code in ("resource_exhausted", "server_busy") else RETRY_AFTER_DOWN_S
        return _refused(ctx, session_id, Refusal(503, error, retry))
    admitted = _Admitted(session, relay)
    setattr(conn, _ADMITTED_ATTR, admitted)
    _in_background(_release_if_unclaimed(ctx, conn, admitted))
    return None


def _refused(ctx, session_id: str, refusal: Refusal) -> Refusal:
    code = refusal.error["code"]
    ctx.metrics.errors.labels(refusal.error["type"], code).inc()
    ctx.metrics.sessions_refused.labels("native", code).inc()
    log.info("chat %s refused at the upgrade: %d %s: %s", session_id, refusal.status, code,
             refusal.error["message"][:200])
    return refusal


async def _release_if_unclaimed(ctx, conn: ServerConnection, admitted: _Admitted) -> None:
    """An upgrade that never reached its session (the client left during the handshake) frees its slot."""
    await conn.wait_closed()
    if not admitted.claimed:
        admitted.claimed = True
        log.info("chat %s: the client left before the session started; releasing", admitted.session.session_id)
        await release(ctx, admitted.relay, graceful=False)


class NativeSession(ClientSession):
    protocol = "native"
    log_tag = "chat"

    def __init__(self, ws: ServerConnection, ctx: GatewayContext, session_id: str):
        super().__init__(ws, ctx, session_id)
        self._admitted: _Admitted | None = None  # the upgrade's admission, once the connection is upgraded
        self._opus_in = sphn.OpusStreamReader(audio.SAMPLE_RATE)
        self._granule: int | None = 0  # the input stream's last Ogg granule position (None: unknown)
        self._opus_out = sphn.OpusStreamWriter(audio.SAMPLE_RATE)

    @classmethod
    async def at_upgrade(cls, ctx: GatewayContext, conn: ServerConnection, query: dict[str, str]) -> Response | None:
        """Refused here with an HTTP status, or opened (prompt prefill included) and handed to the session."""
        refusal = await admit_at_upgrade(ctx, conn, query)
        if refusal is None:
            return None
        retry = [("Retry-After", str(refusal.retry_after_s))] if refusal.retry_after_s else []
        return json_response(refusal.status, {"error": refusal.error}, retry)

    @classmethod
    def for_connection(cls, ws: ServerConnection, ctx: GatewayContext, query: dict[str, str]) -> "NativeSession":
        """The session the upgrade made (or one that ends at once: the connection was not admitted)."""
        admitted: _Admitted | None = getattr(ws, _ADMITTED_ATTR, None)
        if admitted is None:
            return cls(ws, ctx, "chat_" + secrets.token_hex(8))
        admitted.session._admitted = admitted
        return admitted.session

    def _send(self, kind: int, payload: bytes) -> None:
        self.send(bytes([kind]) + payload)

    async def start(self) -> None:
        admitted = self._admitted
        if admitted is None or admitted.claimed:  # sessions are admitted at the upgrade
            self.end(1011, "session was not admitted")
            return
        admitted.claimed = True
        self.adopt(admitted.relay)
        self.count_opened()
        self._send(KIND_HANDSHAKE, b"")

    async def on_message(self, message: str | bytes) -> None:
        if isinstance(message, str) or not message:
            self._error("bad_event", "messages are binary: one kind byte, then the payload")
            return
        kind, payload = message[0], message[1:]
        if kind != KIND_AUDIO:
            self._error("unknown_event", f"message kind {kind} is not accepted from clients (1 = Ogg/Opus audio)")
            return
        self.heard_from_client()  # a live client, even if this message is refused
        pcm = self._decode(payload)
        if pcm is None:
            return
        if pcm.size and not np.isfinite(pcm).all():
            self._error("bad_audio", "decoded audio is not finite")
            return
        await self.push_audio(np.asarray(pcm, dtype=np.float32))

    def _decode(self, payload: bytes) -> np.ndarray | None:
        """One audio message's Ogg/Opus pages -> float32 PCM, or None after a typed error."""
        granule = audio.ogg_last_granule(payload)
        limit_s = audio.MAX_OPUS_MESSAGE_SAMPLES // audio.SAMPLE_RATE
        if (granule is not None and self._granule is not None
                and (granule - self._granule) // 2 > audio.MAX_OPUS_MESSAGE_SAMPLES):
            seconds = (granule - self._granule) / 48_000
            self._error("bad_audio", f"one audio message holds {seconds:.1f} s of audio; at most "
                                     f"{limit_s} s per message (send smaller pieces)")
            self._granule = granule  # the pages are skipped; the stream goes on after them
            return None
        try:
            pcm = self._opus_in.append_bytes(payload)
        except ValueError as e:
            # The Ogg stream is now out of step; a fresh reader starts at the next page.
            self._opus_in = sphn.OpusStreamReader(audio.SAMPLE_RATE)
            self._granule = None
            self._error("bad_audio", f"not Ogg/Opus (or over {limit_s} s of audio in one message): {str(e)[:100]}")
            return None
        if granule is not None:
            self._granule = granule
        return pcm

    def _error(self, code: str, message: str, type_: str = "invalid_request_error") -> None:
        self.send_error(type_, code, message)

    def send_error(self, type_: str, code: str, message: str) -> None:
        self.count_error(type_, code, message)
        self._send(KIND_ERROR, f"{code}: {message}".encode())

    def render_output(self, f: OutputFrame) -> bool:
        data = self._opus_out.append_pcm(np.clip(f.pcm, -1.0, 1.0))
        if data:
            self._send(KIND_AUDIO, data)
        if f.text:
            self._send(KIND_TEXT, f.text.encode("utf-8"))
        return True

    async def on_idle(self, limit: float) -> None:
        self._error("idle_timeout", f"no audio message for {limit:g} s: the session is closed")
