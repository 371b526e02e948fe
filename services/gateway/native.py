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
The session's audio is regrouped into 1920-sample frames exactly as on the Realtime wire and
goes through the same relay.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass

import numpy as np
import sphn
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from duplex.v1 import talker_pb2
from services.gateway import audio
from services.gateway.admission import admit, release
from services.gateway.bounded import OutputQueue
from services.gateway.relay import OpenParams, OutputFrame, Relay, RelayError
from services.gateway.realtime import LOGGED_CLIENT_ERRORS, ClientError, resolve_voice

log = logging.getLogger("gateway.native")

KIND_HANDSHAKE, KIND_AUDIO, KIND_TEXT, KIND_ERROR = 0, 1, 2, 5
_SEED = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit also takes '²'); below 2**63 is checked too
RETRY_AFTER_FULL_S, RETRY_AFTER_DOWN_S = 1, 5


@dataclass
class Refusal:
    """An /api/chat upgrade answered with an HTTP error instead of 101."""

    status: int
    error: dict  # {"type", "code", "message"}
    retry_after_s: int | None = None


@dataclass
class _Admitted:
    session_id: str
    relay: Relay
    claimed: bool = False


_ADMITTED_ATTR = "personaplex_admitted"  # set on the connection by admit_at_upgrade, taken by NativeSession
_background: set[asyncio.Task] = set()


def _in_background(coro) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def admit_at_upgrade(ctx, conn: ServerConnection, query: dict[str, str]) -> Refusal | None:
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
        return _refused(ctx, session_id, Refusal(400, {"type": "invalid_request_error", "code": "bad_event", "message": why}))
    voice, voice_audio = await asyncio.to_thread(ctx.voices.for_open, voice)  # enrolled: ships its audio
    sampling = talker_pb2.Sampling(seed=int(seed))
    params = lambda: OpenParams(f"{session_id}.{secrets.token_hex(4)}", voice, persona, sampling, voice_audio)  # noqa: E731
    opening = asyncio.ensure_future(admit(ctx, params))
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
        retry = RETRY_AFTER_FULL_S if e.code == "resource_exhausted" else RETRY_AFTER_DOWN_S
        return _refused(ctx, session_id, Refusal(503, error, retry))
    admitted = _Admitted(session_id, relay)
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
        log.info("chat %s: the client left before the session started; releasing", admitted.session_id)
        await release(ctx, admitted.relay, graceful=False)


class NativeSession:
    def __init__(self, ws: ServerConnection, ctx, query: dict[str, str]):
        self.ws, self.ctx, self.cfg = ws, ctx, ctx.config
        self.query = query
        self._admitted: _Admitted | None = getattr(ws, _ADMITTED_ATTR, None)
        self.session_id = self._admitted.session_id if self._admitted else "chat_" + secrets.token_hex(8)
        self._out = OutputQueue(self.cfg.output_queue_events, self.cfg.output_queue_bytes)
        self._ended = asyncio.Event()
        self._close = (1000, "session closed")
        self._opus_in = sphn.OpusStreamReader(audio.SAMPLE_RATE)
        self._granule: int | None = 0  # the input stream's last Ogg granule position (None: unknown)
        self._opus_out = sphn.OpusStreamWriter(audio.SAMPLE_RATE)
        self._assembler = audio.FrameAssembler()
        self._relay = None
        self._client_errors = 0
        self._audio_at = time.monotonic()

    def _send(self, kind: int, payload: bytes) -> None:
        try:
            self._out.put_nowait(bytes([kind]) + payload)
        except asyncio.QueueFull:
            if not self._ended.is_set():
                log.warning("chat %s cut off: client is not reading (%d messages, %d bytes queued)", self.session_id,
                            self._out.qsize(), self._out.bytes)
                self.ctx.metrics.slow_client_cutoffs.inc()
                self._close = (1008, "client not reading output")
                self._ended.set()

    async def run(self) -> None:
        if self._admitted is None or self._admitted.claimed:  # sessions are admitted at the upgrade
            await self.ws.close(1011, "session was not admitted")
            return
        self._admitted.claimed = True
        p = self._relay = self._admitted.relay
        p.on_output = self._on_output
        p.on_error = self._on_error
        self.ctx.metrics.sessions_opened.labels("native").inc()
        self.ctx.metrics.sessions_active.labels("native").inc()
        log.info("chat %s open on cell %s", self.session_id, p.cell.name)
        self._send(KIND_HANDSHAKE, b"")
        writer = asyncio.create_task(self._write_loop())
        reader = asyncio.create_task(self._read_loop())
        ended = asyncio.create_task(self._ended.wait())
        idle = asyncio.create_task(self._idle_watch())
        try:
            await asyncio.wait({reader, writer, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (reader, ended, idle):
                t.cancel()
            await asyncio.gather(reader, ended, idle, return_exceptions=True)
            await release(self.ctx, p, graceful=False)
            self.ctx.metrics.sessions_active.labels("native").dec()
            log.info("chat %s released (frames in %d, out %d)", self.session_id, p.frames_in, p.frames_out)
            if self._close[0] != 1008 and not writer.done():
                self._out.finish()
                try:
                    await asyncio.wait_for(asyncio.shield(writer), 2.0)
                except (asyncio.TimeoutError, ConnectionClosed):
                    pass
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self.ws.close(*self._close)

    async def _write_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(msg)

    async def _idle_watch(self) -> None:
        """No audio message for idle_session_timeout_s (0 = never): the client is gone or stuck; free the slots."""
        limit = self.cfg.idle_session_timeout_s
        if limit <= 0:
            return
        while time.monotonic() - self._audio_at <= limit:
            await asyncio.sleep(min(1.0, limit / 4))
        self._error("idle_timeout", f"no audio message for {limit:g} s: the session is closed")
        self._close = (1008, "idle timeout")
        self._ended.set()

    async def _read_loop(self) -> None:
        async for message in self.ws:
            if isinstance(message, str) or not message:
                self._error("bad_event", "messages are binary: one kind byte, then the payload")
                continue
            kind, payload = message[0], message[1:]
            if kind == KIND_AUDIO:
                self._audio_at = time.monotonic()  # a live client, even if this message is refused
            else:
                self._error("unknown_event", f"message kind {kind} is not accepted from clients (1 = Ogg/Opus audio)")
                continue
            pcm = self._decode(payload)
            if pcm is None:
                continue
            if pcm.size and not np.isfinite(pcm).all():
                self._error("bad_audio", "decoded audio is not finite")
                continue
            for frame in self._assembler.push(np.asarray(pcm, dtype=np.float32)):
                try:
                    await self._relay.send_frame(frame)
                except RelayError:
                    return
                self.ctx.metrics.frames_in.inc()

    def _decode(self, payload: bytes) -> np.ndarray | None:
        """One audio message's Ogg/Opus pages -> float32 PCM, or None after a typed error."""
        granule = audio.ogg_last_granule(payload)
        if granule is not None and self._granule is not None and (granule - self._granule) // 2 > audio.MAX_OPUS_MESSAGE_SAMPLES:
            seconds = (granule - self._granule) / 48_000
            self._error("bad_audio", f"one audio message holds {seconds:.1f} s of audio; at most "
                                     f"{audio.MAX_OPUS_MESSAGE_SAMPLES // audio.SAMPLE_RATE} s per message (send smaller pieces)")
            self._granule = granule  # the pages are skipped; the stream goes on after them
            return None
        try:
            pcm = self._opus_in.append_bytes(payload)
        except ValueError as e:
            # The Ogg stream is now out of step; a fresh reader starts at the next page.
            self._opus_in = sphn.OpusStreamReader(audio.SAMPLE_RATE)
            self._granule = None
            self._error("bad_audio", f"not Ogg/Opus (or over {audio.MAX_OPUS_MESSAGE_SAMPLES // audio.SAMPLE_RATE} s of audio "
                                     f"in one message): {str(e)[:100]}")
            return None
        if granule is not None:
            self._granule = granule
        return pcm

    def _error(self, code: str, message: str, type_: str = "invalid_request_error") -> None:
        self.ctx.metrics.errors.labels(type_, code).inc()
        self._client_errors += 1
        if self._client_errors <= LOGGED_CLIENT_ERRORS:
            log.info("chat %s: %s %s", self.session_id, code, message)
        self._send(KIND_ERROR, f"{code}: {message}".encode())

    def _on_output(self, f: OutputFrame) -> None:
        data = self._opus_out.append_pcm(np.clip(f.pcm, -1.0, 1.0))
        if data:
            self._send(KIND_AUDIO, data)
        if f.text:
            self._send(KIND_TEXT, f.text.encode("utf-8"))
        self.ctx.metrics.frames_out.inc()
        self.ctx.metrics.frame_latency.observe(f.latency_s)

    def _on_error(self, err: RelayError) -> None:
        self._error(err.code, err.message, err.error_type)
        self._close = (1011, err.code)
        self._ended.set()
