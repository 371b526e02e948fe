"""The Realtime duplex wire (vLLM-Omni `/v1/realtime?duplex=1`, OpenAI Realtime GA names).

One WebSocket = one session = one continuous response. The pure parts (session.update
parsing, capabilities, event shapes) are module functions; `RealtimeSession` runs one
connection: a reader (client events), the pipeline's callbacks (output frames, stage
errors) and a writer task that drains a bounded queue to the socket.

Ordering rules kept here:
- every server event gets `event_id` and a per-connection increasing `server_event_seq`;
- `rate_limit_error`/`resource_exhausted` comes before any `session.created`;
- `response.created` once (at the first accepted audio), then per output frame exactly one
  audio delta and one transcript delta (GA names, or legacy names if asked, never both);
- `session.close` -> `response.done` -> `session.closed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from duplex.v1 import talker_pb2
from services.common import voice_names
from services.gateway import audio
from services.gateway.bounded import OutputQueue, RecentIds, brief
from services.gateway.pipeline import OpenParams, OutputFrame, Pipeline, PipelineError, open_on_cells

log = logging.getLogger("gateway.realtime")

_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")

GA_NAMES = ("response.output_audio.delta", "response.output_audio_transcript.delta")
LEGACY_NAMES = ("response.audio.delta", "response.audio_transcript.delta")

# Keys a client may put in `session`. Server-owned keys (id, object, capabilities, ...) are refused.
_SESSION_KEYS = {
    "type", "model", "modalities", "output_modalities", "input_audio_format", "output_audio_format",
    "audio", "voice", "instructions", "turn_detection", "extra_body",
}
_EXTRA_BODY_KEYS = {"auto_response", "legacy_event_names", "seed", "greedy"}
# Client ids the gateway echoes or remembers: longer ones are refused, not stored.
MAX_EVENT_ID_CHARS = 256
MAX_OPERATION_ID_CHARS = 128
# Client errors logged per session (at INFO); past that they are only counted (a flood is one line).
LOGGED_CLIENT_ERRORS = 20


class ClientError(Exception):
    """A refused client event: becomes one `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.type = code, message, param, type_


def _unsupported(feature: str, why: str) -> ClientError:
    return ClientError("unsupported_feature", f"{feature} is not supported: {why}", feature)


@dataclass(frozen=True)
class SessionSettings:
    voice: str
    instructions: str
    input_format: str = audio.PCM16
    input_format_explicit: bool = False
    legacy_event_names: bool = False
    greedy: bool = False
    seed: int = 0

    def runtime_key(self) -> tuple:
        """What the talker was opened with; changing it needs a new prefill."""
        return (self.voice, self.instructions, self.greedy, self.seed)

    def sampling(self) -> talker_pb2.Sampling:
        return talker_pb2.Sampling(greedy=self.greedy, seed=self.seed)


def _format_from_ga(fmt: object, where: str) -> str:
    """GA `audio.*.format` object -> our format name. Only pcm16 at 24 kHz exists in GA."""
    if not isinstance(fmt, dict):
        raise ClientError("bad_event", f"{where} must be an object like {{'type': 'audio/pcm', 'rate': 24000}}", where)
    kind, rate = fmt.get("type"), fmt.get("rate", audio.SAMPLE_RATE)
    if rate != audio.SAMPLE_RATE:
        raise ClientError("unsupported_audio_format", f"{where}.rate {brief(rate)}: only {audio.SAMPLE_RATE} Hz is supported", where)
    if kind == "audio/pcm":
        return audio.PCM16
    raise ClientError("unsupported_audio_format", f"{where}.type {brief(kind)}: only 'audio/pcm' (pcm16 LE mono) is supported", where)


def parse_session_update(session: object, current: SessionSettings, max_instructions: int,
                         enrolled: Callable[[str], bool] = lambda name: False) -> SessionSettings:
    """Validate a `session` object whole and return the settings it asks for (nothing is changed on error).
    enrolled(name): whether a bare voice name is an enrolled voice (services/gateway/voices.py)."""
    if not isinstance(session, dict):
        raise ClientError("bad_event", "'session' must be an object", "session")
    unknown = sorted(set(session) - _SESSION_KEYS)
    if unknown:
        raise ClientError("bad_event", f"session.{brief(unknown[0])} is not a setting this server accepts", f"session.{unknown[0][:64]}")
    s = current
    if "type" in session and session["type"] != "realtime":
        raise ClientError("bad_event", f"session.type {brief(session['type'])}: only 'realtime' is served", "session.type")
    for key in ("modalities", "output_modalities"):
        if key in session:
            mods = session[key]
            if not isinstance(mods, list) or "audio" not in mods or not set(mods) <= {"audio", "text"}:
                raise ClientError("bad_event", f"session.{key} must contain 'audio' (and may contain 'text'): the model always speaks", f"session.{key}")
    if "input_audio_format" in session:
        fmt = session["input_audio_format"]
        if fmt not in audio.INPUT_FORMATS:
            raise ClientError("unsupported_audio_format", f"input_audio_format {brief(fmt)}: use one of {list(audio.INPUT_FORMATS)}", "session.input_audio_format")
        s = replace(s, input_format=fmt, input_format_explicit=True)
    if "output_audio_format" in session and session["output_audio_format"] != audio.PCM16:
        raise ClientError("unsupported_audio_format", f"output_audio_format {brief(session['output_audio_format'])}: only 'pcm16' is produced", "session.output_audio_format")
    if "turn_detection" in session and session["turn_detection"] is not None:
        raise _unsupported("turn_detection", "the model decides turns itself; send turn_detection: null")
    if "audio" in session:
        a = session["audio"]
        if not isinstance(a, dict) or not set(a) <= {"input", "output"}:
            raise ClientError("bad_event", "session.audio may only have 'input' and 'output'", "session.audio")
        inp, out = a.get("input") or {}, a.get("output") or {}
        if not isinstance(inp, dict) or not isinstance(out, dict):
            raise ClientError("bad_event", "session.audio.input/output must be objects", "session.audio")
        if "format" in inp:
            s = replace(s, input_format=_format_from_ga(inp["format"], "session.audio.input.format"), input_format_explicit=True)
        if inp.get("turn_detection") is not None:
            raise _unsupported("turn_detection", "the model decides turns itself; send turn_detection: null")
        for k in set(inp) - {"format", "turn_detection", "transcription", "noise_reduction"}:
            raise ClientError("bad_event", f"session.audio.input.{brief(k)} is not a setting this server accepts", f"session.audio.input.{k[:64]}")
        for k in ("transcription", "noise_reduction"):
            if inp.get(k) is not None:
                raise _unsupported(f"audio.input.{k}", "not offered by this model")
        if "format" in out:
            _format_from_ga(out["format"], "session.audio.output.format")
        for k in set(out) - {"format", "voice"}:
            raise ClientError("bad_event", f"session.audio.output.{brief(k)} is not a setting this server accepts", f"session.audio.output.{k[:64]}")
        if "voice" in out:
            s = replace(s, voice=_check_voice(out["voice"], "session.audio.output.voice", enrolled))
    if "voice" in session:
        s = replace(s, voice=_check_voice(session["voice"], "session.voice", enrolled))
    if "instructions" in session:
        text = session["instructions"]
        if not isinstance(text, str) or len(text) > max_instructions:
            raise ClientError("bad_event", f"session.instructions must be a string of at most {max_instructions} characters", "session.instructions")
        s = replace(s, instructions=text)
    if "extra_body" in session:
        s = _parse_extra_body(session["extra_body"], s)
    return s


def _check_voice(voice: object, param: str, enrolled: Callable[[str], bool]) -> str:
    if voice == "" or voice is None:
        return ""
    if not (voice_names.is_bundled(voice) or (voice_names.is_enrolled(voice) and enrolled(voice))):
        raise ClientError("invalid_voice", f"voice {brief(voice)} is not a voice: a bundled basename such as "
                          "'NATF2.pt' (no path) or an enrolled name (GET /v1/voices)", param)
    return voice


def _parse_extra_body(body: object, s: SessionSettings) -> SessionSettings:
    if not isinstance(body, dict):
        raise ClientError("bad_event", "session.extra_body must be an object", "session.extra_body")
    unknown = sorted(set(body) - _EXTRA_BODY_KEYS)
    if unknown:
        raise ClientError("bad_event", f"session.extra_body.{brief(unknown[0])} is not a setting this server accepts", f"session.extra_body.{unknown[0][:64]}")
    if body.get("auto_response", True) is not True:
        raise _unsupported("extra_body.auto_response=false", "the model answers continuously")
    for key in ("legacy_event_names", "greedy"):
        if key in body and not isinstance(body[key], bool):
            raise ClientError("bad_event", f"session.extra_body.{key} must be a boolean", f"session.extra_body.{key}")
    seed = body.get("seed", s.seed)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ClientError("bad_event", "session.extra_body.seed must be a non-negative integer", "session.extra_body.seed")
    return replace(s, legacy_event_names=body.get("legacy_event_names", s.legacy_event_names), greedy=body.get("greedy", s.greedy), seed=seed)


def parse_event(message: str) -> dict:
    """One client message -> an event dict, or a typed ClientError (never another exception)."""
    try:
        event = json.loads(message)
    except json.JSONDecodeError as e:
        raise ClientError("invalid_json", f"message is not JSON: {e}") from None
    except RecursionError:
        raise ClientError("invalid_json", "message is nested too deeply") from None
    except ValueError:  # an integer over the interpreter's digit limit
        raise ClientError("invalid_json", "message has a number with too many digits") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ClientError("bad_event", "an event is a JSON object with a string 'type'", "type")
    return event


# Refusals a client should retry later (close 1013), not give up on.
RETRY_LATER = ("resource_exhausted", "server_shutting_down")


def admission_error(pool) -> PipelineError | None:
    """Why no session can be opened now, before trying any cell (None: some cell admits)."""
    state = pool.admission_state()
    if state == "down":
        return PipelineError("runtime_open_failed", "no cell is serving (every cell has a stage down)")
    if state == "draining":
        return PipelineError("server_shutting_down", "every cell is draining (shutting down): retry in a few seconds")
    return None


def capabilities(pool_summary: dict, output_delay_frames: int | None = None) -> dict:
    """What this deployment really does, from the polled capacity of the serving cells."""
    caps = {
        "implementation_level": "model_native_duplex",
        "chunk_period_ms": audio.FRAME_MS,
        "sample_rate_hz": audio.SAMPLE_RATE,
        "max_sessions": pool_summary["total_slots"],
        "supports_multi_session": pool_summary["total_slots"] > 1,
        "supports_multi_session_same_replica": pool_summary["max_cell_slots"] > 1,
        "supports_barge_in": False,
        "supports_session_resume": False,
        "supports_audio_truncate": False,
        "supports_client_commit": False,
        "supports_input_append": True,
        "supports_model_native_turn_policy": True,
        "input_modes": ["append_audio_chunk"],
        "input_audio_formats": list(audio.INPUT_FORMATS),
        "output_audio_formats": [audio.PCM16],
    }
    if output_delay_frames is not None:
        caps["output_delay_frames"] = output_delay_frames
    return caps


@dataclass
class _State:
    settings: SessionSettings
    pipeline: Pipeline | None = None
    audio_started: bool = False
    response_created: bool = False
    closing: bool = False
    frames_out: int = 0
    recent_ops: RecentIds = field(default_factory=lambda: RecentIds(max_len=MAX_OPERATION_ID_CHARS))


class RealtimeSession:
    def __init__(self, ws: ServerConnection, ctx, query: dict[str, str]):
        self.ws = ws
        self.ctx = ctx  # server.Gateway: config, pool, metrics
        self.cfg = ctx.config
        sid = query.get("session_id", "")
        self.session_id = sid if _SESSION_ID.match(sid) else "sess_" + secrets.token_hex(8)
        self.response_id = "resp_" + secrets.token_hex(8)
        self.item_id = "item_" + secrets.token_hex(8)
        self.model = (query.get("model") or self.cfg.model)[:128]
        autostart = query.get("autostart", "").lower()
        self.autostart = ("model" in query and autostart not in FALSE) or autostart in TRUE
        legacy = query.get("legacy_events", "").lower() in TRUE
        self.st = _State(SessionSettings(voice=self.cfg.default_voice, instructions=self.cfg.default_instructions, legacy_event_names=legacy))
        self._seq = 0
        self._out = OutputQueue(self.cfg.output_queue_events, self.cfg.output_queue_bytes)
        self._client_errors = 0
        self._ended = asyncio.Event()
        self._close_code, self._close_reason = 1000, "session closed"
        self._bg: set[asyncio.Task] = set()
        self._slow_client = False
        self._assembler = audio.FrameAssembler()
        self._connected_at = self._audio_at = time.monotonic()

    # ---- outbound -------------------------------------------------------------

    def emit(self, event: dict) -> None:
        self._seq += 1
        event = {"event_id": f"event_{secrets.token_hex(6)}", "server_event_seq": self._seq, **event}
        try:
            self._out.put_nowait(json.dumps(event, separators=(",", ":")))
        except asyncio.QueueFull:
            self._cut_off(f"client is not reading: {self._out.qsize()} events ({self._out.bytes} bytes) queued")

    def emit_error(self, type_: str, code: str, message: str, client_event_id: str | None = None, param: str | None = None) -> None:
        err = {"type": type_, "code": code, "message": message}
        if param:
            err["param"] = param
        if client_event_id:
            err["event_id"] = client_event_id
        self.ctx.metrics.errors.labels(type_, code).inc()
        self._client_errors += 1
        if self._client_errors <= LOGGED_CLIENT_ERRORS:
            log.info("session %s: %s/%s: %s", self.session_id, type_, code, message)
        elif self._client_errors == LOGGED_CLIENT_ERRORS + 1:
            log.info("session %s: more errors are counted, not logged (gateway_errors_total)", self.session_id)
        self.emit({"type": "error", "error": err})

    def _cut_off(self, reason: str) -> None:
        if self._ended.is_set():
            return
        log.warning("session %s cut off: %s", self.session_id, reason)
        self.ctx.metrics.slow_client_cutoffs.inc()
        self.ctx.metrics.errors.labels("server_error", "slow_client").inc()
        self._close_code, self._close_reason = 1008, "client not reading output"
        self._slow_client = True
        self._ended.set()

    async def _write_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(msg)

    # ---- run ------------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        reader: asyncio.Task | None = None
        try:
            if self.autostart:
                await self._open(self.st.settings)
            if not self._ended.is_set():
                reader = asyncio.create_task(self._read_loop())
                ended = asyncio.create_task(self._ended.wait())
                idle = asyncio.create_task(self._idle_watch())
                await asyncio.wait({reader, ended, writer}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                idle.cancel()
                await asyncio.gather(idle, return_exceptions=True)
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await self._release(graceful=False)
            await asyncio.gather(*self._bg, return_exceptions=True)
            await self._finish_writer(writer)

    async def _finish_writer(self, writer: asyncio.Task) -> None:
        # Whatever is queued (error, response.done, session.closed) reaches the client,
        # unless the client is the reason the queue is full.
        if not self._slow_client and not writer.done():
            try:
                self._out.finish()
                await asyncio.wait_for(asyncio.shield(writer), 2.0)
            except (asyncio.TimeoutError, ConnectionClosed):
                pass
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await self.ws.close(self._close_code, self._close_reason)

    async def _idle_watch(self) -> None:
        """End a connection that opens no session, or a session that appends no audio, for too long
        (operator-set; 0 = never): either holds resources a live client would be using."""
        limits = [t for t in (self.cfg.idle_connection_timeout_s, self.cfg.idle_session_timeout_s) if t > 0]
        if not limits:
            return
        while not self.st.closing:
            await asyncio.sleep(min(1.0, min(limits) / 4))
            if self.st.pipeline is None:
                limit, since, what = self.cfg.idle_connection_timeout_s, self._connected_at, "no session was opened"
            else:
                limit, since, what = self.cfg.idle_session_timeout_s, self._audio_at, "no audio was appended"
            if limit > 0 and time.monotonic() - since > limit and not self.st.closing:
                await self._end_idle(f"{what} for {limit:g} s")
                return

    async def _end_idle(self, why: str) -> None:
        self.st.closing = True
        self.emit_error("invalid_request_error", "idle_timeout", f"{why}: the connection is closed")
        if self.st.pipeline is not None:
            await self._release(graceful=False)
            self._emit_done_and_closed("cancelled")
        self._close_code, self._close_reason = 1008, "idle timeout"
        self._ended.set()

    async def _read_loop(self) -> None:
        async for message in self.ws:
            await self._handle(message)
            if self._ended.is_set():
                return

    async def _handle(self, message: str | bytes) -> None:
        client_event_id = None
        try:
            if isinstance(message, bytes):
                raise ClientError("invalid_json", "binary messages are not part of this protocol; send JSON text")
            event = parse_event(message)
            if isinstance(event.get("event_id"), str):
                if len(event["event_id"]) > MAX_EVENT_ID_CHARS:
                    raise ClientError("bad_event", f"event_id has {len(event['event_id'])} characters; at most {MAX_EVENT_ID_CHARS}", "event_id")
                client_event_id = event["event_id"]
            handler = self._handlers().get(event["type"])
            if handler is None:
                raise ClientError("unknown_event", f"unknown event type {brief(event['type'])}", "type")
            await handler(event)
        except ClientError as e:
            self.emit_error(e.type, e.code, e.message, client_event_id, e.param)
        except PipelineError:
            pass  # already reported through the pipeline's on_error

    def _handlers(self):
        def refuse(feature, why):
            async def h(event):
                raise _unsupported(feature, why)
            return h

        return {
            "session.update": self._on_session_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.clear": self._on_clear,
            "session.close": lambda e: self._on_close("completed"),
            "response.cancel": lambda e: self._on_close("cancelled"),
            "session.heartbeat": self._on_heartbeat,
            "input_audio_buffer.commit": refuse("input_audio_buffer.commit", "input is continuous (supports_client_commit=false)"),
            "response.create": refuse("response.create", "one continuous response opens with the first audio"),
            "session.resume": refuse("session.resume", "sessions cannot be resumed (supports_session_resume=false)"),
            "barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "session.barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "input_audio_buffer.barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "output_audio_buffer.clear": refuse("output_audio_buffer.clear", "output audio cannot be truncated (supports_audio_truncate=false)"),
            "conversation.item.truncate": refuse("conversation.item.truncate", "output audio cannot be truncated (supports_audio_truncate=false)"),
        }

    # ---- session lifecycle --------------------------------------------------

    def _session_object(self) -> dict:
        s = self.st.settings
        ga_in = {"type": "audio/pcm", "rate": audio.SAMPLE_RATE} if s.input_format == audio.PCM16 else {"type": "audio/pcm_f32le", "rate": audio.SAMPLE_RATE}
        p = self.st.pipeline
        return {
            "object": "realtime.session",
            "type": "realtime",
            "id": self.session_id,
            "model": self.model,
            "voice": s.voice,
            "instructions": s.instructions,
            "modalities": ["audio", "text"],
            "output_modalities": ["audio", "text"],
            "input_audio_format": s.input_format,
            "output_audio_format": audio.PCM16,
            "turn_detection": None,
            "audio": {
                "input": {"format": ga_in, "turn_detection": None},
                "output": {"format": {"type": "audio/pcm", "rate": audio.SAMPLE_RATE}, "voice": s.voice},
            },
            "event_names": "legacy" if s.legacy_event_names else "ga",
            "capabilities": capabilities(self.ctx.pool.capacity_summary(), p.output_delay_frames if p else None),
        }

    async def _open(self, settings: SessionSettings, client_event_id: str | None = None) -> bool:
        """Admit the session on a cell. On refusal the error goes out before any session.created
        (naming the session.update that asked, if it carried an event_id)."""
        try:
            pipeline = await self._open_pipeline(settings)
        except PipelineError as e:
            self.ctx.metrics.sessions_refused.labels("realtime", e.code).inc()
            self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
            if not e.client_fault:
                self._end_refused(e)
            return False
        self.st.settings = settings
        self._adopt(pipeline)
        self.ctx.metrics.sessions_opened.labels("realtime").inc()
        log.info("session %s open on cell %s (voice=%r, prefill %d frames in %.0f ms)", self.session_id, pipeline.cell.name,
                 settings.voice, pipeline.ready.prefill_frames, pipeline.ready.prefill_ms)
        self.emit({"type": "session.created", "session": self._session_object()})
        self.emit({"type": "session.updated", "session": self._session_object()})
        return True

    async def _open_pipeline(self, settings: SessionSettings, prefer=None) -> Pipeline:
        cells = self.ctx.pool.candidates()
        if prefer is not None:
            cells = [prefer] + [c for c in cells if c is not prefer]
        voice, audio = await asyncio.to_thread(self.ctx.voices.for_open, settings.voice)  # enrolled: ships its audio
        params = lambda: OpenParams(f"{self.session_id}.{secrets.token_hex(4)}", voice,  # noqa: E731
                                    settings.instructions, settings.sampling(), audio)
        if (refusal := admission_error(self.ctx.pool)) is not None:
            raise refusal
        return await open_on_cells(cells, params, open_timeout_s=self.cfg.open_timeout_s, stall_timeout_s=self.cfg.stall_timeout_s,
                                   cleanup_timeout_s=self.cfg.cleanup_timeout_s)

    def _adopt(self, p: Pipeline) -> None:
        """The session holds `p` now: it counts in the active gauge until `_retire` or `_release` lets it go."""
        p.on_output = self._on_output
        p.on_error = self._on_pipeline_error
        self.st.pipeline = p
        self._audio_at = time.monotonic()  # the no-audio clock starts at open
        self.ctx.metrics.sessions_active.labels("realtime").inc()

    def _end_refused(self, e: PipelineError) -> None:
        """No session after a refusal that is not the client's fault: close (1013 = retry later)."""
        self._close_code, self._close_reason = (1013, "try again later") if e.code in RETRY_LATER else (1011, "runtime open failed")
        self._ended.set()

    async def _on_session_update(self, event: dict) -> None:
        if self.st.closing:
            raise ClientError("bad_event", "the session is closing")
        new = parse_session_update(event.get("session"), self.st.settings, self.cfg.max_instructions_chars,
                                   self.ctx.voices.is_enrolled)
        client_event_id = event["event_id"] if isinstance(event.get("event_id"), str) else None
        if self.st.pipeline is None:
            await self._open(new, client_event_id)
            return
        old = self.st.settings
        if self.st.audio_started:
            if new.runtime_key() != old.runtime_key() or new.input_format != old.input_format or new.legacy_event_names != old.legacy_event_names:
                raise ClientError("session_locked", "voice, instructions, sampling, audio format and event names are fixed once audio has been appended", "session")
        elif new.runtime_key() != old.runtime_key() and not await self._reopen(new, client_event_id):
            return
        self.st.settings = new
        self.emit({"type": "session.updated", "session": self._session_object()})

    async def _reopen(self, new: SessionSettings, client_event_id: str | None) -> bool:
        """Nothing was said yet: redo the prompt prefill with the new settings (same cell first).
        True when the new settings are live. On refusal the client gets the typed error and then:

        - its old session, untouched, when the new one is refused while the old one is still held
          (settings the talker refuses, every cell draining, a stage down): stages judge settings
          before they take a slot, so this is tried beside the old session first;
        - a clearly closed session (session.closed, close 1013 or 1011) when every cell was full:
          the old slot is given up for the new settings, and another client may take it first."""
        cell = self.st.pipeline.cell
        try:
            p = await self._open_pipeline(new, prefer=cell)
        except PipelineError as e:
            if e.code != "resource_exhausted":
                self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
                return False
            p = None
        await self._retire()
        if p is not None:
            self._adopt(p)
            return True
        try:  # the cell was full: its slot is ours again only if nobody takes it first
            self._adopt(await self._open_pipeline(new, prefer=cell))
            return True
        except PipelineError as e:
            self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
            self.st.closing = True
            self._emit_done_and_closed("failed")
            self._end_refused(e)
            return False

    async def _retire(self) -> None:
        """Let the current pipeline go (before a reopen)."""
        p, self.st.pipeline = self.st.pipeline, None
        try:
            if not await p.abort():
                self.ctx.metrics.cleanup_unconfirmed.inc()
        finally:
            self.ctx.metrics.sessions_active.labels("realtime").dec()

    async def _on_heartbeat(self, event: dict) -> None:
        ack = {"type": "session.heartbeat_ack"}
        if isinstance(event.get("event_id"), str):
            ack["client_event_id"] = event["event_id"]
        self.emit(ack)

    # ---- input ------------------------------------------------------------------

    async def _on_append(self, event: dict) -> None:
        self._audio_at = time.monotonic()  # a live client, even if this packet is refused
        p = self.st.pipeline
        if p is None:
            raise ClientError("session_not_started", "send session.update (or connect with ?model=) before appending audio", "type")
        if self.st.closing:
            raise ClientError("bad_event", "the session is closing")
        op = event.get("operation_id")
        if op is not None and (not isinstance(op, str) or not 0 < len(op) <= MAX_OPERATION_ID_CHARS):
            raise ClientError("bad_event", f"operation_id must be a string of 1..{MAX_OPERATION_ID_CHARS} characters, got {brief(op)}", "operation_id")
        if op is not None and op in self.st.recent_ops:
            log.debug("session %s: append with repeated operation_id %s ignored", self.session_id, brief(op))
            return
        s = self.st.settings
        fmt = event.get("format", s.input_format)
        if fmt != s.input_format and (s.input_format_explicit or self.st.audio_started):
            raise ClientError("unsupported_audio_format", f"packet format {brief(fmt)} differs from the session's {s.input_format!r}", "format")
        rate = event.get("sample_rate_hz", audio.SAMPLE_RATE)
        if rate != audio.SAMPLE_RATE:
            raise ClientError("unsupported_audio_format", f"sample_rate_hz {brief(rate)}: only {audio.SAMPLE_RATE} is accepted", "sample_rate_hz")
        try:
            samples = audio.pcm_bytes_to_f32(audio.b64decode_strict(event.get("audio")), fmt, self.cfg.max_packet_samples)
        except audio.AudioError as e:
            raise ClientError(e.code, str(e), e.param) from None
        # Accepted whole: from here on the packet is committed.
        if op is not None:
            self.st.recent_ops.add(op)
        if not self.st.audio_started:
            self.st.audio_started = True
            if fmt != s.input_format:
                self.st.settings = replace(s, input_format=fmt)
            self._response_created()
        for frame in self._assembler.push(samples):
            await p.send_frame(frame)
            self.ctx.metrics.frames_in.inc()

    async def _on_clear(self, event: dict) -> None:
        dropped = self._assembler.clear()
        self.emit({"type": "input_audio_buffer.cleared", "dropped_samples": dropped})

    def _response_created(self) -> None:
        if self.st.response_created:
            return
        self.st.response_created = True
        self.emit({"type": "response.created", "response": self._response_object("in_progress")})

    def _response_object(self, status: str) -> dict:
        return {"object": "realtime.response", "id": self.response_id, "status": status, "conversation_id": self.session_id,
                "output_modalities": ["audio", "text"], "output": [{"id": self.item_id, "type": "message", "role": "assistant"}]}

    # ---- output -----------------------------------------------------------------

    def _on_output(self, f: OutputFrame) -> None:
        if self._ended.is_set():
            return
        audio_name, text_name = LEGACY_NAMES if self.st.settings.legacy_event_names else GA_NAMES
        common = {"response_id": self.response_id, "item_id": self.item_id, "output_index": 0, "content_index": 0}
        self.emit({"type": audio_name, **common, "delta": audio.b64encode(audio.f32_to_pcm16_bytes(f.pcm)), "sample_rate_hz": audio.SAMPLE_RATE})
        self.emit({"type": text_name, **common, "delta": f.text})
        self.st.frames_out += 1
        self.ctx.metrics.frames_out.inc()
        self.ctx.metrics.frame_latency.observe(f.latency_s)

    def _on_pipeline_error(self, err: PipelineError) -> None:
        # Called from a pump task: report now (within the second), clean up in the background.
        if self._ended.is_set() or self.st.closing:
            return
        self.emit_error(err.error_type, err.code, err.message)
        task = asyncio.create_task(self._end_after_failure())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _end_after_failure(self) -> None:
        self.st.closing = True
        await self._release(graceful=False)
        self._emit_done_and_closed("failed")
        self._close_code, self._close_reason = 1011, "stage failure"
        self._ended.set()

    # ---- close ------------------------------------------------------------------

    async def _on_close(self, status: str) -> None:
        if self.st.closing:
            return
        self.st.closing = True
        p = self.st.pipeline
        if p is not None and status == "completed" and p.failed is None:
            last = self._assembler.flush()
            if last is not None:
                try:
                    await p.send_frame(last)
                    self.ctx.metrics.frames_in.inc()
                except PipelineError:
                    pass
        await self._release(graceful=(status == "completed"))
        if p is not None and p.failed is not None:
            err = p.failed
            self.emit_error(err.error_type, err.code, err.message)
            status = "failed"
        self._emit_done_and_closed(status)
        self._ended.set()

    def _emit_done_and_closed(self, status: str) -> None:
        if self.st.pipeline is not None or self.st.response_created:
            self._response_created()
            self.emit({"type": "response.done", "response": self._response_object(status)})
        p = self.st.pipeline
        self.emit({"type": "session.closed", "session_id": self.session_id, "frames_in": p.frames_in if p else 0,
                   "frames_out": self.st.frames_out, "cleanup_confirmed": self._cleanup_confirmed,
                   "frame_latency": p.latency_summary() if p else {"frames": 0}})

    _cleanup_confirmed: bool | None = None
    _release_task: asyncio.Future | None = None

    async def _release(self, graceful: bool) -> None:
        """End the pipeline's streams, once, however many paths (close, drop, failure) ask."""
        if self.st.pipeline is None:
            return
        if self._release_task is None:
            self._release_task = asyncio.ensure_future(self._release_once(self.st.pipeline, graceful))
        await asyncio.shield(self._release_task)

    async def _release_once(self, p: Pipeline, graceful: bool) -> None:
        self._cleanup_confirmed = await (p.close() if graceful else p.abort())
        if not self._cleanup_confirmed:
            self.ctx.metrics.cleanup_unconfirmed.inc()
        self.ctx.metrics.sessions_active.labels("realtime").dec()
        log.info("session %s released (frames in %d, out %d, latency %s, cleanup %s)", self.session_id, p.frames_in, p.frames_out,
                 p.latency_summary(), "confirmed" if self._cleanup_confirmed else "NOT confirmed")
