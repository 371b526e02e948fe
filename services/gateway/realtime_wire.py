"""The Realtime duplex wire, without sockets: what a client event means and what a server event looks like.

Every function here is pure (dicts, dataclasses and numbers in, the same out) and refuses a bad client
value with one typed `ClientError` (the `error` event's code, message and param). `RealtimeSession`
(realtime.py) holds the state these take and give back.

    parse_connect_query     the WebSocket URL's query: session id, model, autostart, legacy names
    parse_event             one text message -> an event dict
    client_event_id         the event_id an error echoes
    parse_session_update    a `session` object -> SessionSettings (lenient where harmless)
    settle_update_after_audio   the same once audio has started: what is primed stays, changes are noted
    append_operation_id, decode_append      an input_audio_buffer.append, validated whole
    truncate_end_ms, parse_item_create, response_metadata     the other client events' fields
    session_object, capabilities, error_event, output_deltas, session_closed_event   server events
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from duplex.v1 import talker_pb2
from services.common import voice_names
from services.gateway import audio
from services.gateway.bounded import brief
from services.gateway.config import DEFAULT_VOICE_ALIASES
from services.gateway.conversation import client_message_content, new_id

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
        raise ClientError("bad_event", f"{where} must be an object like {{'type': 'audio/pcm', 'rate': 24000}}",
                          where)
    kind, rate = fmt.get("type"), fmt.get("rate", audio.SAMPLE_RATE)
    if rate != audio.SAMPLE_RATE:
        raise ClientError("unsupported_audio_format",
                          f"{where}.rate {brief(rate)}: only {audio.SAMPLE_RATE} Hz is supported", where)
    if kind == "audio/pcm":
        return audio.PCM16
    raise ClientError("unsupported_audio_format",
                      f"{where}.type {brief(kind)}: only 'audio/pcm' (pcm16 LE mono) is supported", where)


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
        raise ClientError("bad_event", f"session.{brief(unknown[0])} is not a setting this server accepts",
                          "session")
    s = current
    notes = dict(current.not_in_effect)  # what earlier updates asked for stays asked for, unless set off here
    if "type" in session and session["type"] != "realtime":
        raise ClientError("bad_event", f"session.type {brief(session['type'])}: only 'realtime' is served",
                          "session.type")
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
                raise ClientError("bad_event", f"session.{key} must contain 'audio' (and may contain 'text'): "
                                  "the model always speaks", f"session.{key}")
    if "input_audio_format" in session:
        fmt = session["input_audio_format"]
        if fmt not in audio.INPUT_FORMATS:
            raise ClientError("unsupported_audio_format",
                              f"input_audio_format {brief(fmt)}: use one of {list(audio.INPUT_FORMATS)}",
                              "session.input_audio_format")
        s = replace(s, input_format=fmt, input_format_explicit=True)
    if "output_audio_format" in session and session["output_audio_format"] != audio.PCM16:
        raise ClientError("unsupported_audio_format",
                          f"output_audio_format {brief(session['output_audio_format'])}: only 'pcm16' is produced",
                          "session.output_audio_format")
    _note(notes, session, "turn_detection", _TURN_DETECTION_NOTE)
    if "audio" in session:
        s = _parse_ga_audio(session["audio"], s, notes, voice_aliases, enrolled)
    if "voice" in session:
        s = replace(s, voice=resolve_voice(session["voice"], voice_aliases, "session.voice", enrolled))
    if "instructions" in session:
        text = session["instructions"]
        if not isinstance(text, str) or len(text) > max_instructions:
            raise ClientError("bad_event", f"session.instructions must be a string of at most {max_instructions} "
                              "characters", "session.instructions")
        s = replace(s, instructions=text)
    if "extra_body" in session:
        s = _parse_extra_body(session["extra_body"], s)
    return replace(s, not_in_effect=tuple(sorted(notes.items())))


def _note(notes: dict[str, str], obj: dict, key: str, why: str, off: tuple = (None, False),
          prefix: str = "") -> None:
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
        raise ClientError("bad_event", f"session.extra_body.{brief(unknown[0])} is not a setting this server accepts",
                          f"session.extra_body.{unknown[0][:64]}")
    if body.get("auto_response", True) is not True:
        raise _unsupported("extra_body.auto_response=false", "the model answers continuously")
    for key in ("legacy_event_names", "greedy"):
        if key in body and not isinstance(body[key], bool):
            raise ClientError("bad_event", f"session.extra_body.{key} must be a boolean",
                              f"session.extra_body.{key}")
    seed = body.get("seed", s.seed)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ClientError("bad_event", "session.extra_body.seed must be a non-negative integer",
                          "session.extra_body.seed")
    return replace(s, legacy_event_names=body.get("legacy_event_names", s.legacy_event_names),
                   greedy=body.get("greedy", s.greedy), seed=seed)


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


def capabilities(pool_summary: dict, output_delay_frames: int | None = None, resume_grace_s: float = 0.0) -> dict:
    """What this deployment really does, from the polled capacity of the serving cells (and whether a
    dropped session waits `resume_grace_s` for a resume: services/gateway/resume.py)."""
    caps = {
        "implementation_level": "model_native_duplex",
        "chunk_period_ms": audio.FRAME_MS,
        "sample_rate_hz": audio.SAMPLE_RATE,
        "max_sessions": pool_summary["total_slots"],
        "supports_multi_session": pool_summary["total_slots"] > 1,
        "supports_multi_session_same_replica": pool_summary["max_cell_slots"] > 1,
        "supports_barge_in": False,
        "supports_session_resume": resume_grace_s > 0,
        "supports_say": True,  # an assistant item's text is spoken (services/gateway/say.py)
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
    if resume_grace_s > 0:
        caps["resume_grace_s"] = resume_grace_s
    return caps


# ---- the connection ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectQuery:
    session_id: str
    model: str
    autostart: bool  # open a session with the defaults at connect (else at the first session.update)
    legacy_event_names: bool


def parse_connect_query(query: Mapping[str, str], default_model: str) -> ConnectQuery:
    """`?session_id=&model=&autostart=&legacy_events=`: a bad session id gets a fresh one, a model
    name is cut to 128 characters; `model` alone means autostart (vLLM-Omni's drivers)."""
    sid = query.get("session_id", "")
    autostart = query.get("autostart", "").lower()
    return ConnectQuery(
        session_id=sid if _SESSION_ID.match(sid) else "sess_" + secrets.token_hex(8),
        model=(query.get("model") or default_model)[:128],
        autostart=("model" in query and autostart not in FALSE) or autostart in TRUE,
        legacy_event_names=query.get("legacy_events", "").lower() in TRUE,
    )


# ---- client events -----------------------------------------------------------------------------

def client_event_id(event: dict) -> str | None:
    """The event's `event_id`, which an error it causes echoes; one too long to echo is refused."""
    event_id = event.get("event_id")
    if not isinstance(event_id, str):
        return None
    if len(event_id) > MAX_EVENT_ID_CHARS:
        raise ClientError("bad_event", f"event_id has {len(event_id)} characters; at most {MAX_EVENT_ID_CHARS}",
                          "event_id")
    return event_id


_BARGE_IN = "the model handles overlapping speech itself (supports_barge_in=false)"
# Client events this server names and refuses: event type -> (feature, why).
REFUSED_EVENTS = {
    "session.resume": ("session.resume", "a session is resumed by reconnecting with ?session_id= and its "
                       "session.created resume_token as the X-Resume-Token header, not by an event"),
    "barge_in": ("barge_in", _BARGE_IN),
    "session.barge_in": ("barge_in", _BARGE_IN),
    "input_audio_buffer.barge_in": ("barge_in", _BARGE_IN),
    "output_audio_buffer.clear": ("output_audio_buffer.clear", "WebRTC only; send response.cancel"),
}


def refusal(event_type: str) -> ClientError:
    """The error for an event type this session has no handler for."""
    if event_type in REFUSED_EVENTS:
        return _unsupported(*REFUSED_EVENTS[event_type])
    return ClientError("unknown_event", f"unknown event type {brief(event_type)}", "type")


# Once audio has been appended, the talker has been primed with these; a change waits for a new session.
_PRIMED_NOTE = ("the model was primed with it before the first audio; it stays for this session (open a new "
                "session to change it)")


def settle_update_after_audio(session: dict, old: SessionSettings, new: SessionSettings) -> SessionSettings:
    """A session.update once audio has been appended (`new`: what parse_session_update made of `session`).

    What the talker was primed with (voice, instructions, sampling) stays as it is: a change is answered,
    not refused, and listed in `not_in_effect` with why, so a framework that resends its persona mid-call
    goes on (pipecat treats any `error` as fatal). The wire's shape is refused with a typed error, since
    going on would misread the client: the input audio format (its next appends) and the event names.
    Everything else settles as before audio (parse_session_update's notes)."""
    if new.input_format != old.input_format:
        raise ClientError("session_locked", f"the input audio format is {old.input_format!r} once audio has been "
                          "appended; it cannot change within a session", "session.input_audio_format")
    if new.legacy_event_names != old.legacy_event_names:
        raise ClientError("session_locked", "the event names are fixed once audio has been appended",
                          "session.extra_body.legacy_event_names")
    notes = dict(new.not_in_effect)
    body = session.get("extra_body") or {}
    output = (session.get("audio") or {}).get("output") or {}
    primed = (("voice", "voice" in session or "voice" in output, new.voice != old.voice),
              ("instructions", "instructions" in session, new.instructions != old.instructions),
              ("extra_body.seed", "seed" in body, new.seed != old.seed),
              ("extra_body.greedy", "greedy" in body, new.greedy != old.greedy))
    for key, named, changed in primed:
        if changed:
            notes[key] = _PRIMED_NOTE
        elif named:  # asked for what is in effect: an earlier note no longer applies
            notes.pop(key, None)
    return replace(old, not_in_effect=tuple(sorted(notes.items())))


def append_operation_id(event: dict) -> str | None:
    """An append's optional `operation_id` (a repeated one is ignored by the session)."""
    op = event.get("operation_id")
    if op is not None and (not isinstance(op, str) or not 0 < len(op) <= MAX_OPERATION_ID_CHARS):
        raise ClientError("bad_event", f"operation_id must be a string of 1..{MAX_OPERATION_ID_CHARS} characters, "
                          f"got {brief(op)}", "operation_id")
    return op


def decode_append(event: dict, settings: SessionSettings, audio_started: bool,
                  max_samples: int) -> tuple[str, np.ndarray]:
    """An append's audio, validated whole: (its format, float32 samples). A packet may name its own
    format until the session's is fixed (set explicitly, or by the first accepted audio)."""
    fmt = event.get("format", settings.input_format)
    if fmt != settings.input_format and (settings.input_format_explicit or audio_started):
        raise ClientError("unsupported_audio_format",
                          f"packet format {brief(fmt)} differs from the session's {settings.input_format!r}", "format")
    rate = event.get("sample_rate_hz", audio.SAMPLE_RATE)
    if rate != audio.SAMPLE_RATE:
        raise ClientError("unsupported_audio_format",
                          f"sample_rate_hz {brief(rate)}: only {audio.SAMPLE_RATE} is accepted", "sample_rate_hz")
    try:
        data = audio.b64decode_strict(event.get("audio"))
        if not isinstance(fmt, str) or fmt not in audio.INPUT_FORMATS:  # a list or a long string: never echoed whole
            raise audio.AudioError("unsupported_audio_format",
                                   f"input format {brief(fmt)} is not one of {list(audio.INPUT_FORMATS)}", "format")
        samples = audio.pcm_bytes_to_f32(data, fmt, max_samples)
    except audio.AudioError as e:
        raise ClientError(e.code, str(e), e.param) from None
    return fmt, samples


def truncate_end_ms(event: dict) -> int:
    """A conversation.item.truncate's `audio_end_ms` (its item is the session's to check)."""
    end_ms, index = event.get("audio_end_ms"), event.get("content_index", 0)
    if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
        raise ClientError("bad_event", "audio_end_ms must be a non-negative integer", "audio_end_ms")
    if index != 0:
        raise ClientError("bad_event", "content_index must be 0 (one audio part per item)", "content_index")
    return end_ms


def parse_item_create(event: dict) -> tuple[str, str, list[dict]]:
    """A conversation.item.create's message: (item id, role, content normalized to text parts)."""
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
    return item_id, item["role"], content


MAX_METADATA_CHARS = 4096


def response_metadata(event: dict) -> dict | None:
    """A response.create's `response.metadata`, if it is an object small enough to keep."""
    response = event.get("response")
    metadata = response.get("metadata") if isinstance(response, dict) else None
    if isinstance(metadata, dict) and len(json.dumps(metadata)) <= MAX_METADATA_CHARS:
        return metadata
    return None


def heartbeat_ack(event: dict) -> dict:
    ack = {"type": "session.heartbeat_ack"}
    if isinstance(event.get("event_id"), str):
        ack["client_event_id"] = event["event_id"]
    return ack


# ---- server events -----------------------------------------------------------------------------

def session_object(session_id: str, model: str, s: SessionSettings, caps: dict) -> dict:
    """What is in effect (not what was asked): the resolved voice, no VAD, no transcription, no tools."""
    pcm = {"type": "audio/pcm", "rate": audio.SAMPLE_RATE}
    # GA has no float input format: a pcm_f32le session shows it in input_audio_format only.
    audio_in = {"format": pcm} if s.input_format == audio.PCM16 else {}
    return {
        "object": "realtime.session",
        "type": "realtime",
        "id": session_id,
        "model": model,
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
        "capabilities": caps,
    }


def error_event(type_: str, code: str, message: str, client_event_id: str | None = None,
                param: str | None = None) -> dict:
    err = {"type": type_, "code": code, "message": message}
    if param:
        err["param"] = param
    if client_event_id:
        err["event_id"] = client_event_id
    return {"type": "error", "error": err}


def output_deltas(where: dict, pcm: np.ndarray, text: str, legacy: bool) -> tuple[dict, dict]:
    """One output frame's audio delta (pcm16, base64) and transcript delta, under one name set."""
    audio_name, text_name = LEGACY_NAMES if legacy else GA_NAMES
    pcm16 = audio.b64encode(audio.f32_to_pcm16_bytes(pcm))
    return ({"type": audio_name, **where, "delta": pcm16, "sample_rate_hz": audio.SAMPLE_RATE},
            {"type": text_name, **where, "delta": text})


def session_closed_event(session_id: str, frames_in: int, frames_out: int, cleanup_confirmed: bool | None,
                         frame_latency: dict, prelive_frames_dropped: int = 0) -> dict:
    """frames_in: frames that reached the model; prelive_frames_dropped: frames sent while the prompt was
    not live yet and dropped (relay.PRELIVE_FRAMES)."""
    return {"type": "session.closed", "session_id": session_id, "frames_in": frames_in, "frames_out": frames_out,
            "prelive_frames_dropped": prelive_frames_dropped, "cleanup_confirmed": cleanup_confirmed,
            "frame_latency": frame_latency}
