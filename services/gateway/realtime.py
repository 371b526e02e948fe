"""The Realtime duplex wire (vLLM-Omni `/v1/realtime?duplex=1`, OpenAI Realtime GA names).

One WebSocket = one session = one continuous stream of model output, shown to the client as
responses (conversation.py): one open from the first accepted audio on; response.cancel or a
truncate of its item ends it early (its unsent audio dropped) and the next opens at once. The pure
parts (session.update parsing, capabilities, event shapes) are module functions; `RealtimeSession`
runs one connection: a reader (client events), the relay's callbacks (output frames, stage
errors) and a writer task that drains a bounded queue to the socket.

Ordering rules kept here:
- every server event gets `event_id` and a per-connection increasing `server_event_seq` as it is sent;
- `rate_limit_error`/`resource_exhausted` comes before any `session.created`;
- a response's opening events come before its first delta; then per output frame exactly one
  audio delta and one transcript delta (GA names, or legacy names if asked, never both);
- `session.close` -> the open response's `.done` events -> `session.closed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from duplex.v1 import talker_pb2
from services.common import voice_names
from services.gateway import audio
from services.gateway.admission import RETRY_LATER, admit, release
from services.gateway.bounded import OutputQueue, RecentIds, brief
from services.gateway.config import DEFAULT_VOICE_ALIASES
from services.gateway.conversation import Conversation, client_message_content, new_id
from services.gateway.relay import OpenParams, OutputFrame, Relay, RelayError

log = logging.getLogger("gateway.realtime")
DEFAULT_ALIASES = dict(DEFAULT_VOICE_ALIASES)

_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")

GA_NAMES = ("response.output_audio.delta", "response.output_audio_transcript.delta")
LEGACY_NAMES = ("response.audio.delta", "response.audio_transcript.delta")

# Keys a client may put in `session`. The first group is applied; `_IGNORED_KEYS` are standard
# settings that SDKs always send and that cannot change what this model does (accepted, reported
# as what is in effect). Other server-owned keys (capabilities, ...) are refused.
_SESSION_KEYS = {
    "type", "model", "modalities", "output_modalities", "input_audio_format", "output_audio_format",
    "audio", "voice", "instructions", "turn_detection", "extra_body",
}
_IGNORED_KEYS = {"max_output_tokens", "tool_choice", "tracing", "tools", "id", "session_id", "object"}
_EXTRA_BODY_KEYS = {"auto_response", "legacy_event_names", "seed", "greedy"}
# Client ids the gateway echoes or remembers: longer ones are refused, not stored.
MAX_EVENT_ID_CHARS = 256
MAX_OPERATION_ID_CHARS = 128
# Client errors logged per session (at INFO); past that they are only counted (a flood is one line).
LOGGED_CLIENT_ERRORS = 20
_TURN_DETECTION_NOTE = "the model takes turns itself (full duplex); no VAD runs"
_TRANSCRIPTION_NOTE = "no user transcript: the model does not transcribe the user's audio"


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
    # What the last update asked for that is accepted but not in effect: setting -> why.
    not_in_effect: tuple[tuple[str, str], ...] = ()
    # vLLM-Omni drivers name their session in session.update (used if it comes before the open).
    requested_id: str | None = None

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


def resolve_voice(voice: object, aliases: Mapping[str, str], param: str,
                  enrolled: Callable[[str], bool] = lambda name: False) -> str:
    """A client's voice name -> the name a session opens with: a bundled basename ('NATF2.pt') or an
    enrolled name ('carol', GET /v1/voices) as is; another vendor's name ('marin') through the
    operator's alias table; any other bare name as the bundled 'NAME.pt' (LiveKit's 'NATF2').
    Whether that voice exists is the talker's answer at open."""
    if voice == "" or voice is None:
        return ""
    if isinstance(voice, str):
        if voice_names.is_bundled(voice) or (voice_names.is_enrolled(voice) and enrolled(voice)):
            return voice
        if voice.lower() in aliases:
            return aliases[voice.lower()]
        if voice_names.is_enrolled(voice) and voice_names.is_bundled(voice + ".pt"):
            return voice + ".pt"
    raise ClientError("invalid_voice", f"voice {brief(voice)} is not a voice name: a bundled basename such as "
                      "'NATF2.pt' (no path), an enrolled name (GET /v1/voices) or a configured alias", param)


def parse_session_update(session: object, current: SessionSettings, max_instructions: int,
                         voice_aliases: Mapping[str, str] = DEFAULT_ALIASES,
                         enrolled: Callable[[str], bool] = lambda name: False) -> SessionSettings:
    """Validate a `session` object whole and return the settings it asks for (nothing is changed on error).

    Lenient about what is harmless (standard fields SDKs always send are accepted and reported as not
    in effect), strict about what would change behaviour and cannot be honoured (tools, a speed other
    than 1.0, an unknown voice, another audio format). enrolled(name): whether a bare voice name is
    an enrolled voice (services/gateway/voices.py)."""
    if not isinstance(session, dict):
        raise ClientError("bad_event", "'session' must be an object", "session")
    unknown = sorted(set(session) - _SESSION_KEYS - _IGNORED_KEYS, key=str)
    if unknown:
        raise ClientError("bad_event", f"session.{brief(unknown[0])} is not a setting this server accepts", "session")
    s = current
    notes = dict(current.not_in_effect)  # what earlier updates asked for stays asked for, unless set off here
    if "type" in session and session["type"] != "realtime":
        raise ClientError("bad_event", f"session.type {brief(session['type'])}: only 'realtime' is served", "session.type")
    if session.get("object", "realtime.session") != "realtime.session":
        raise ClientError("bad_event", "session.object must be 'realtime.session'", "session.object")
    tools = session.get("tools", [])
    if not isinstance(tools, list):
        raise ClientError("bad_event", "session.tools must be a list", "session.tools")
    if tools:
        raise _unsupported("session.tools", "this model cannot call tools; send tools: [] or leave it out")
    for key in ("id", "session_id"):
        if key in session:
            sid = session[key]
            if not isinstance(sid, str) or not _SESSION_ID.match(sid):
                raise ClientError("bad_event", f"session.{key} must be 1-64 characters of A-Za-z0-9_-.",
                                  f"session.{key}")
            s = replace(s, requested_id=sid)
    _note(notes, session, "max_output_tokens", "the response is continuous; it ends with the session", off=())
    _note(notes, session, "tool_choice", "no tools are offered", off=(None, "none"))
    _note(notes, session, "tracing", "not offered by this server")
    for key in ("modalities", "output_modalities"):
        if key in session:
            mods = session[key]
            if not isinstance(mods, list) or "audio" not in mods or not set(map(str, mods)) <= {"audio", "text"}:
                raise ClientError("bad_event", f"session.{key} must contain 'audio' (and may contain 'text'): the model always speaks", f"session.{key}")
    if "input_audio_format" in session:
        fmt = session["input_audio_format"]
        if fmt not in audio.INPUT_FORMATS:
            raise ClientError("unsupported_audio_format", f"input_audio_format {brief(fmt)}: use one of {list(audio.INPUT_FORMATS)}", "session.input_audio_format")
        s = replace(s, input_format=fmt, input_format_explicit=True)
    if "output_audio_format" in session and session["output_audio_format"] != audio.PCM16:
        raise ClientError("unsupported_audio_format", f"output_audio_format {brief(session['output_audio_format'])}: only 'pcm16' is produced", "session.output_audio_format")
    _note(notes, session, "turn_detection", _TURN_DETECTION_NOTE)
    if "audio" in session:
        s = _parse_ga_audio(session["audio"], s, notes, voice_aliases, enrolled)
    if "voice" in session:
        s = replace(s, voice=resolve_voice(session["voice"], voice_aliases, "session.voice", enrolled))
    if "instructions" in session:
        text = session["instructions"]
        if not isinstance(text, str) or len(text) > max_instructions:
            raise ClientError("bad_event", f"session.instructions must be a string of at most {max_instructions} characters", "session.instructions")
        s = replace(s, instructions=text)
    if "extra_body" in session:
        s = _parse_extra_body(session["extra_body"], s)
    return replace(s, not_in_effect=tuple(sorted(notes.items())))


def _note(notes: dict[str, str], obj: dict, key: str, why: str, off: tuple = (None, False), prefix: str = "") -> None:
    """A setting the client names but that is not in effect: noted with why; naming it off clears the note."""
    if key in obj:
        if obj[key] in off:
            notes.pop(prefix + key, None)
        else:
            notes[prefix + key] = why


def _parse_ga_audio(a: object, s: SessionSettings, notes: dict[str, str], voice_aliases: Mapping[str, str],
                    enrolled: Callable[[str], bool]) -> SessionSettings:
    if not isinstance(a, dict) or not set(a) <= {"input", "output"}:
        raise ClientError("bad_event", "session.audio may only have 'input' and 'output'", "session.audio")
    inp, out = a.get("input") or {}, a.get("output") or {}
    if not isinstance(inp, dict) or not isinstance(out, dict):
        raise ClientError("bad_event", "session.audio.input/output must be objects", "session.audio")
    for k in sorted(set(inp) - {"format", "turn_detection", "transcription", "noise_reduction"}, key=str):
        raise ClientError("bad_event", f"session.audio.input.{brief(k)} is not a setting this server accepts",
                          "session.audio.input")
    for k in sorted(set(out) - {"format", "voice", "speed"}, key=str):
        raise ClientError("bad_event", f"session.audio.output.{brief(k)} is not a setting this server accepts",
                          "session.audio.output")
    if "format" in inp:
        fmt = _format_from_ga(inp["format"], "session.audio.input.format")
        s = replace(s, input_format=fmt, input_format_explicit=True)
    _note(notes, inp, "turn_detection", _TURN_DETECTION_NOTE, prefix="audio.input.")
    _note(notes, inp, "transcription", _TRANSCRIPTION_NOTE, prefix="audio.input.")
    _note(notes, inp, "noise_reduction", "input audio is used as sent", prefix="audio.input.")
    if "format" in out:
        _format_from_ga(out["format"], "session.audio.output.format")
    speed = out.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
        raise _unsupported("audio.output.speed", f"{brief(speed)}: the model speaks at its own pace; only 1.0")
    if "voice" in out:
        s = replace(s, voice=resolve_voice(out["voice"], voice_aliases, "session.audio.output.voice", enrolled))
    return s


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
        "supports_audio_truncate": True,
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
    relay: Relay | None = None
    audio_started: bool = False
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
        self.model = (query.get("model") or self.cfg.model)[:128]
        autostart = query.get("autostart", "").lower()
        self.autostart = ("model" in query and autostart not in FALSE) or autostart in TRUE
        legacy = query.get("legacy_events", "").lower() in TRUE
        self.st = _State(SessionSettings(voice=self.cfg.default_voice, instructions=self.cfg.default_instructions, legacy_event_names=legacy))
        self.voice_aliases = dict(self.cfg.voice_aliases)
        self.conv: Conversation | None = None  # from the first accepted audio on
        self._next_metadata: dict | None = None  # a response.create's metadata, for the first response
        self._out = OutputQueue(self.cfg.output_queue_events, self.cfg.output_queue_bytes)
        self._seq = 0  # server_event_seq of the last event sent
        self._client_errors = 0
        self._ended = asyncio.Event()
        self._close_code, self._close_reason = 1000, "session closed"
        self._bg: set[asyncio.Task] = set()
        self._slow_client = False
        self._assembler = audio.FrameAssembler()
        self._audio_at = time.monotonic()  # connect, open, or the last append: the idle clock
        self._opening = 0  # opens in flight (never idle meanwhile: a prefill may take a while)

    # ---- outbound -------------------------------------------------------------

    def emit(self, event: dict, response_id: str | None = None) -> None:
        """Queue an event; a response's deltas carry its id, so a cancel can drop them unsent."""
        try:
            self._out.put_nowait(json.dumps(event, separators=(",", ":")), tag=response_id)
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
        # The envelope is added as each event goes out, so events a cancel dropped leave no gap.
        while (msg := await self._out.get()) is not None:
            self._seq += 1
            await self.ws.send(f'{{"event_id":"event_{secrets.token_hex(6)}","server_event_seq":{self._seq},{msg[1:]}')

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
            if self._opening:
                continue
            if self.st.relay is None:
                limit, what = self.cfg.idle_connection_timeout_s, "no session was opened"
            else:
                limit, what = self.cfg.idle_session_timeout_s, "no audio was appended"
            if limit > 0 and time.monotonic() - self._audio_at > limit and not self.st.closing:
                await self._end_idle(f"{what} for {limit:g} s")
                return

    async def _end_idle(self, why: str) -> None:
        self.st.closing = True
        self.emit_error("invalid_request_error", "idle_timeout", f"{why}: the connection is closed")
        if self.st.relay is not None:
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
        except RelayError:
            pass  # already reported through the relay's on_error

    def _handlers(self):
        def refuse(feature, why):
            async def h(event):
                raise _unsupported(feature, why)
            return h

        return {
            "session.update": self._on_session_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.clear": self._on_clear,
            "session.close": self._on_close,
            "session.heartbeat": self._on_heartbeat,
            "response.cancel": self._on_cancel,
            "conversation.item.truncate": self._on_truncate,
            "conversation.item.create": self._on_item_create,
            "conversation.item.delete": self._on_item_delete,
            # Input is continuous and the response never stops: a turn's commit and a new
            # response's create have nothing to do (SDKs send them in client-side turn mode).
            "input_audio_buffer.commit": self._on_no_op,
            "response.create": self._on_response_create,
            "session.resume": refuse("session.resume", "sessions cannot be resumed (supports_session_resume=false)"),
            "barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "session.barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "input_audio_buffer.barge_in": refuse("barge_in", "the model handles overlapping speech itself (supports_barge_in=false)"),
            "output_audio_buffer.clear": refuse("output_audio_buffer.clear", "WebRTC only; send response.cancel"),
        }

    # ---- session lifecycle --------------------------------------------------

    def _session_object(self) -> dict:
        """What is in effect (not what was asked): the resolved voice, no VAD, no transcription, no tools."""
        s = self.st.settings
        pcm = {"type": "audio/pcm", "rate": audio.SAMPLE_RATE}
        # GA has no float input format: a pcm_f32le session shows it in input_audio_format only.
        audio_in = {"format": pcm} if s.input_format == audio.PCM16 else {}
        p = self.st.relay
        return {
            "object": "realtime.session",
            "type": "realtime",
            "id": self.session_id,
            "model": self.model,
            "voice": s.voice,
            "instructions": s.instructions,
            "modalities": ["audio", "text"],
            "output_modalities": ["audio"],
            "input_audio_format": s.input_format,
            "output_audio_format": audio.PCM16,
            "turn_detection": None,
            "audio": {
                "input": {**audio_in, "turn_detection": None, "transcription": None, "noise_reduction": None},
                "output": {"format": pcm, "voice": s.voice, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "none",
            "max_output_tokens": "inf",
            "tracing": None,
            "not_in_effect": dict(s.not_in_effect),
            "event_names": "legacy" if s.legacy_event_names else "ga",
            "capabilities": capabilities(self.ctx.pool.capacity_summary(), p.output_delay_frames if p else None),
        }

    async def _open(self, settings: SessionSettings, client_event_id: str | None = None) -> bool:
        """Admit the session on a cell. On refusal the error goes out before any session.created
        (naming the session.update that asked, if it carried an event_id)."""
        if settings.requested_id:
            self.session_id = settings.requested_id
        try:
            relay = await self._open_relay(settings)
        except RelayError as e:
            self.ctx.metrics.sessions_refused.labels("realtime", e.code).inc()
            self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
            if not e.client_fault:
                self._end_refused(e)
            return False
        self.st.settings = settings
        self._adopt(relay)
        self.ctx.metrics.sessions_opened.labels("realtime").inc()
        log.info("session %s open on cell %s (voice=%r, prefill %d frames in %.0f ms)", self.session_id, relay.cell.name,
                 settings.voice, relay.ready.prefill_frames, relay.ready.prefill_ms)
        self.emit({"type": "session.created", "session": self._session_object()})
        self.emit({"type": "session.updated", "session": self._session_object()})
        return True

    async def _open_relay(self, settings: SessionSettings, prefer=None, wait: bool = True) -> Relay:
        self._opening += 1
        try:
            voice, audio = await asyncio.to_thread(self.ctx.voices.for_open, settings.voice)  # enrolled: ships its audio
            params = lambda: OpenParams(f"{self.session_id}.{secrets.token_hex(4)}", voice,  # noqa: E731
                                        settings.instructions, settings.sampling(), audio)
            return await admit(self.ctx, params, prefer, wait=wait)
        finally:
            self._opening -= 1

    def _adopt(self, p: Relay) -> None:
        """The session holds `p` now: it counts in the active gauge until `_retire` or `_release` lets it go."""
        p.on_output = self._on_output
        p.on_error = self._on_relay_error
        self.st.relay = p
        self._audio_at = time.monotonic()  # the no-audio clock starts at open
        self.ctx.metrics.sessions_active.labels("realtime").inc()

    def _end_refused(self, e: RelayError) -> None:
        """No session after a refusal that is not the client's fault: close (1013 = retry later)."""
        self._close_code, self._close_reason = (1013, "try again later") if e.code in RETRY_LATER else (1011, "runtime open failed")
        self._ended.set()

    async def _on_session_update(self, event: dict) -> None:
        if self.st.closing:
            raise ClientError("bad_event", "the session is closing")
        new = parse_session_update(event.get("session"), self.st.settings, self.cfg.max_instructions_chars,
                                   self.voice_aliases, self.ctx.voices.is_enrolled)
        client_event_id = event["event_id"] if isinstance(event.get("event_id"), str) else None
        if self.st.relay is None:
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
        cell = self.st.relay.cell
        try:
            p = await self._open_relay(new, prefer=cell, wait=False)
        except RelayError as e:
            if e.code != "resource_exhausted":
                self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
                return False
            p = None
        if self.st.closing:  # the old relay failed meanwhile: the session is ending, the new one is not wanted
            if p is not None:
                await p.abort()
            return False
        await self._retire()
        if p is not None:
            self._adopt(p)
            return True
        try:  # the cell was full: its slot is ours again only if nobody takes it first
            self._adopt(await self._open_relay(new, prefer=cell))
            return True
        except RelayError as e:
            self.emit_error(e.error_type, e.code, e.message, client_event_id, param="session" if e.client_fault else None)
            self.st.closing = True
            self._emit_done_and_closed("failed")
            self._end_refused(e)
            return False

    async def _retire(self) -> None:
        """Let the current relay go (before a reopen)."""
        p, self.st.relay = self.st.relay, None
        try:
            await release(self.ctx, p, graceful=False)
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
        p = self.st.relay
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
            self.conv = Conversation(self.session_id, legacy=self.st.settings.legacy_event_names)
            self._start_response()
        for frame in self._assembler.push(samples):
            await p.send_frame(frame)
            self.ctx.metrics.frames_in.inc()

    async def _on_clear(self, event: dict) -> None:
        dropped = self._assembler.clear()
        self.emit({"type": "input_audio_buffer.cleared", "dropped_samples": dropped})

    # ---- responses and barge-in ------------------------------------------------

    def _start_response(self) -> None:
        metadata, self._next_metadata = self._next_metadata, None
        for ev in self.conv.start(metadata):
            self.emit(ev)

    def _finish_response(self, status: str, error: dict | None = None) -> None:
        for ev in self.conv.finish(status, error=error):
            self.emit(ev)

    def _barge_in(self, why: str) -> None:
        """End the current response now: its audio not yet sent is dropped, the next response starts
        at once (the model, its context and the slot go on)."""
        dropped = self._out.drop(self.conv.current.id)
        log.info("session %s: %s: response %s cancelled, %d queued events dropped", self.session_id, why,
                 self.conv.current.id, dropped)
        self._finish_response("cancelled")
        self._start_response()

    async def _on_cancel(self, event: dict) -> None:
        wanted = event.get("response_id")
        if self.conv is None or self.st.closing or (wanted is not None and wanted != self.conv.current.id):
            log.info("session %s: response.cancel with no such response in progress: nothing to do", self.session_id)
            return
        self._barge_in("response.cancel")

    async def _on_truncate(self, event: dict) -> None:
        item_id, end_ms, index = event.get("item_id"), event.get("audio_end_ms"), event.get("content_index", 0)
        if self.conv is None or not self.conv.has(item_id):
            raise ClientError("invalid_item_id", f"item_id {brief(item_id)} is not an assistant item of this session",
                              "item_id")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise ClientError("bad_event", "audio_end_ms must be a non-negative integer", "audio_end_ms")
        if index != 0:
            raise ClientError("bad_event", "content_index must be 0 (one audio part per item)", "content_index")
        if self.conv.items[item_id].role != "assistant":
            raise ClientError("invalid_item_id", "only assistant audio items can be truncated", "item_id")
        self.emit(self.conv.truncate(item_id, end_ms))
        if not self.st.closing and item_id == self.conv.current.item.id:
            self._barge_in("conversation.item.truncate")

    async def _on_response_create(self, event: dict) -> None:
        response = event.get("response")
        metadata = response.get("metadata") if isinstance(response, dict) else None
        if self.conv is None and isinstance(metadata, dict) and len(json.dumps(metadata)) <= 4096:
            self._next_metadata = metadata  # the first response (at the first audio) carries it
        log.info("session %s: response.create: the continuous response is (or will be) running", self.session_id)

    async def _on_no_op(self, event: dict) -> None:
        log.debug("session %s: %s: nothing to do (continuous input)", self.session_id, event["type"])

    async def _on_item_create(self, event: dict) -> None:
        """Context items frameworks send (history, system notes) are recorded and acknowledged. The
        model reads only audio; its persona is `instructions`."""
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type") != "message":
            raise _unsupported("conversation.item.create", "only message items (no tools are offered)")
        content = client_message_content(item.get("role"), item.get("content"))
        if content is None:
            raise ClientError("bad_event", "item must be a system, user or assistant message with a list of "
                              "text/audio parts", "item")
        item_id = item.get("id") or new_id("item")
        if not isinstance(item_id, str) or not _SESSION_ID.match(item_id):
            raise ClientError("bad_event", "item.id must be 1-64 characters of A-Za-z0-9_-.", "item.id")
        if self.conv is None:
            self.conv = Conversation(self.session_id, legacy=self.st.settings.legacy_event_names)
        if self.conv.has(item_id):
            raise ClientError("item_create_duplicate_item_id", f"item {item_id!r} already exists", "item.id")
        log.info("session %s: %s item %s recorded (text does not reach the model)", self.session_id, item["role"],
                 item_id)
        for ev in self.conv.add_client_item(item_id, item["role"], content):
            self.emit(ev)

    async def _on_item_delete(self, event: dict) -> None:
        item_id = event.get("item_id")
        if self.conv is None or not self.conv.has(item_id):
            raise ClientError("invalid_item_id", f"item_id {brief(item_id)} is not an item of this session", "item_id")
        if self.conv.current is not None and item_id == self.conv.current.item.id:
            self._barge_in("conversation.item.delete")
        self.emit(self.conv.delete(item_id))

    # ---- output -----------------------------------------------------------------

    def _on_output(self, f: OutputFrame) -> None:
        if self._ended.is_set():
            return
        if self.conv is None or self.conv.current is None:
            return  # output before any input cannot happen; after the end of the response nothing is sent
        audio_name, text_name = LEGACY_NAMES if self.st.settings.legacy_event_names else GA_NAMES
        common = self.conv.delta_fields(f.text)
        rid = common["response_id"]
        pcm16 = audio.b64encode(audio.f32_to_pcm16_bytes(f.pcm))
        self.emit({"type": audio_name, **common, "delta": pcm16, "sample_rate_hz": audio.SAMPLE_RATE}, rid)
        self.emit({"type": text_name, **common, "delta": f.text}, rid)
        self.st.frames_out += 1
        self.ctx.metrics.frames_out.inc()
        self.ctx.metrics.frame_latency.observe(f.latency_s)

    def _on_relay_error(self, err: RelayError) -> None:
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
        err = self.st.relay.failed if self.st.relay else None
        self._emit_done_and_closed("failed", {"type": err.error_type, "code": err.code} if err else None)
        self._close_code, self._close_reason = 1011, "stage failure"
        self._ended.set()

    # ---- close ------------------------------------------------------------------

    async def _on_close(self, event: dict) -> None:
        if self.st.closing:
            return
        self.st.closing = True
        p = self.st.relay
        if p is not None and p.failed is None:
            last = self._assembler.flush()
            if last is not None:
                try:
                    await p.send_frame(last)
                    self.ctx.metrics.frames_in.inc()
                except RelayError:
                    pass
        await self._release(graceful=True)
        if p is not None and p.failed is not None:
            err = p.failed
            self.emit_error(err.error_type, err.code, err.message)
            self._emit_done_and_closed("failed", {"type": err.error_type, "code": err.code})
        else:
            self._emit_done_and_closed("completed")
        self._ended.set()

    def _emit_done_and_closed(self, status: str, error: dict | None = None) -> None:
        if self.st.relay is not None and self.conv is None:  # opened, no audio yet: an empty response
            self.conv = Conversation(self.session_id, legacy=self.st.settings.legacy_event_names)
            self._start_response()
        if self.conv is not None and self.conv.current is not None:
            self._finish_response(status, error)
        p = self.st.relay
        self.emit({"type": "session.closed", "session_id": self.session_id, "frames_in": p.frames_in if p else 0,
                   "frames_out": self.st.frames_out, "cleanup_confirmed": self._cleanup_confirmed,
                   "frame_latency": p.latency_summary() if p else {"frames": 0}})

    _cleanup_confirmed: bool | None = None
    _release_task: asyncio.Future | None = None

    async def _release(self, graceful: bool) -> None:
        """End the relay's streams, once, however many paths (close, drop, failure) ask."""
        if self.st.relay is None:
            return
        if self._release_task is None:
            self._release_task = asyncio.ensure_future(self._release_once(self.st.relay, graceful))
        await asyncio.shield(self._release_task)

    async def _release_once(self, p: Relay, graceful: bool) -> None:
        self._cleanup_confirmed = await release(self.ctx, p, graceful)
        self.ctx.metrics.sessions_active.labels("realtime").dec()
        log.info("session %s released (frames in %d, out %d, latency %s, cleanup %s)", self.session_id, p.frames_in, p.frames_out,
                 p.latency_summary(), "confirmed" if self._cleanup_confirmed else "NOT confirmed")
