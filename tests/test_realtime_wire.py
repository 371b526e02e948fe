"""The Realtime wire's parsing and event shapes (services/gateway/realtime_wire.py), without sockets."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from services.gateway import audio
from services.gateway.realtime_wire import (
    GA_NAMES, LEGACY_NAMES, MAX_EVENT_ID_CHARS, ClientError, SessionSettings, append_operation_id,
    client_event_id, decode_append, error_event, output_deltas, parse_connect_query, parse_item_create,
    parse_session_update, refusal, response_metadata, session_object, settle_update_after_audio, truncate_end_ms)

DEFAULT = SessionSettings(voice="", instructions="hello")


def pcm16_b64(x: np.ndarray) -> str:
    return base64.b64encode((x * 32767).round().astype("<i2").tobytes()).decode()


def refused(fn, *args) -> ClientError:
    with pytest.raises(ClientError) as e:
        fn(*args)
    return e.value


def test_connect_query_model_means_autostart_unless_turned_off():
    q = parse_connect_query({"model": "m", "session_id": "s-1"}, "default")
    assert (q.session_id, q.model, q.autostart, q.legacy_event_names) == ("s-1", "m", True, False)
    assert not parse_connect_query({"model": "m", "autostart": "0"}, "d").autostart
    assert parse_connect_query({"autostart": "true"}, "d").autostart
    q = parse_connect_query({"session_id": "../bad", "model": "x" * 500, "legacy_events": "on"}, "d")
    assert q.session_id.startswith("sess_") and q.session_id != "../bad"
    assert len(q.model) == 128 and q.legacy_event_names
    assert parse_connect_query({}, "d").model == "d" and not parse_connect_query({}, "d").autostart


def test_event_id_is_echoed_only_when_short_enough():
    assert client_event_id({"event_id": "e1"}) == "e1"
    assert client_event_id({"event_id": 7}) is None and client_event_id({}) is None
    e = refused(client_event_id, {"event_id": "x" * (MAX_EVENT_ID_CHARS + 1)})
    assert (e.code, e.param) == ("bad_event", "event_id")


def test_refused_and_unknown_event_types_and_the_echo_is_cut_short():
    e = refusal("session.resume")
    assert (e.code, e.param) == ("unsupported_feature", "session.resume")
    assert refusal("input_audio_buffer.barge_in").param == "barge_in"
    e = refusal("t" * 10_000)
    assert e.code == "unknown_event" and len(e.message) < 200


def test_an_append_decodes_whole_and_a_packet_names_its_format_only_until_it_is_fixed():
    x = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    fmt, samples = decode_append({"audio": pcm16_b64(x)}, DEFAULT, False, 24_000)
    assert fmt == audio.PCM16 and samples.dtype == np.float32 and samples.size == 1000
    np.testing.assert_allclose(samples, x, atol=1 / 32768)
    f32 = {"audio": base64.b64encode(x.astype("<f4").tobytes()).decode(), "format": audio.PCM_F32LE}
    assert decode_append(f32, DEFAULT, False, 24_000)[0] == audio.PCM_F32LE  # not fixed yet: the packet decides
    assert refused(decode_append, f32, DEFAULT, True, 24_000).code == "unsupported_audio_format"
    explicit = SessionSettings(voice="", instructions="", input_format_explicit=True)
    assert refused(decode_append, f32, explicit, False, 24_000).param == "format"


@pytest.mark.parametrize("event,code,param", [
    ({"audio": "AQID BA=="}, "bad_audio", "audio"),
    ({"audio": 5}, "bad_audio", "audio"),
    ({"audio": "AAAA", "sample_rate_hz": 16_000}, "unsupported_audio_format", "sample_rate_hz"),
    ({"audio": "AAAA", "format": "mulaw"}, "unsupported_audio_format", "format"),
    ({"audio": "AAAA", "format": []}, "unsupported_audio_format", "format"),  # unhashable: typed, not TypeError
    ({"audio": "AAAA", "format": "f" * 5000}, "unsupported_audio_format", "format"),
    ({"audio": base64.b64encode(b"\0" * 3).decode()}, "bad_audio", "audio"),
    ({"audio": base64.b64encode(b"\0" * 202).decode()}, "bad_audio", "audio"),  # over max_samples (100)
])
def test_a_bad_append_is_one_typed_error(event, code, param):
    e = refused(decode_append, event, DEFAULT, False, 100)
    assert (e.code, e.param) == (code, param)
    assert len(e.message) < 300  # a client value is never echoed whole


def test_operation_ids_are_short_strings():
    assert append_operation_id({}) is None and append_operation_id({"operation_id": "op"}) == "op"
    for bad in ("", "x" * 129, 5, ["a"]):
        assert refused(append_operation_id, {"operation_id": bad}).param == "operation_id"


PRIMED = SessionSettings(voice="NATF2.pt", instructions="You are a pirate.")


def after_audio(session: dict, current: SessionSettings = PRIMED) -> SessionSettings:
    return settle_update_after_audio(session, current, parse_session_update(session, current, 4000))


def test_after_audio_a_new_persona_or_voice_is_answered_not_in_effect_and_the_primed_one_stays():
    settled = after_audio({"instructions": "You are a robot.", "audio": {"output": {"voice": "NATM1.pt"}},
                           "extra_body": {"seed": 3, "greedy": True}, "tools": []})
    assert (settled.voice, settled.instructions, settled.seed, settled.greedy) == ("NATF2.pt", "You are a pirate.", 0,
                                                                                  False)
    notes = dict(settled.not_in_effect)
    assert set(notes) == {"voice", "instructions", "extra_body.seed", "extra_body.greedy"}
    assert "primed" in notes["instructions"]
    shown = session_object("s", "m", settled, {})
    assert shown["instructions"] == "You are a pirate." and shown["not_in_effect"]["voice"] == notes["voice"]
    # A later update that does not name them keeps the notes; naming what is in effect clears one.
    later = after_audio({"tracing": None}, settled)
    assert dict(later.not_in_effect) == notes
    cleared = after_audio({"instructions": "You are a pirate.", "voice": "NATF2"}, later)
    assert set(dict(cleared.not_in_effect)) == {"extra_body.seed", "extra_body.greedy"}


def test_after_audio_the_same_settings_change_nothing_and_harmless_ones_are_noted_as_before():
    settled = after_audio({"type": "realtime", "instructions": "You are a pirate.", "voice": "NATF2.pt",
                           "turn_detection": {"type": "server_vad"}})
    assert settled.runtime_key() == PRIMED.runtime_key()
    assert dict(settled.not_in_effect) == {"turn_detection": dict(parse_session_update(
        {"turn_detection": {"type": "server_vad"}}, PRIMED, 4000).not_in_effect)["turn_detection"]}


def test_after_audio_the_wire_shape_is_refused_with_a_typed_error():
    assert refused(after_audio, {"input_audio_format": audio.PCM_F32LE}).param == "session.input_audio_format"
    e = refused(after_audio, {"extra_body": {"legacy_event_names": True}})
    assert (e.code, e.param) == ("session_locked", "session.extra_body.legacy_event_names")
    # What is refused before audio is refused after it too, as one typed error.
    assert refused(after_audio, {"voice": "../x"}).code == "invalid_voice"
    assert refused(after_audio, {"tools": [{"type": "function"}]}).code == "unsupported_feature"


def test_item_create_validates_the_message_and_normalizes_its_parts():
    item_id, role, content = parse_item_create({"item": {"type": "message", "role": "user", "id": "u_1",
                                                         "content": [{"type": "input_text", "text": "hi"}]}})
    assert (item_id, role, content) == ("u_1", "user", [{"type": "input_text", "text": "hi"}])
    assert parse_item_create({"item": {"type": "message", "role": "system", "content": []}})[0].startswith("item_")
    assert refused(parse_item_create, {"item": {"type": "function_call"}}).code == "unsupported_feature"
    for item in ({"type": "message", "role": [], "content": []},  # unhashable role
                 {"type": "message", "role": "user", "content": [{"type": []}]},  # unhashable part type
                 {"type": "message", "role": "robot", "content": []},
                 {"type": "message", "role": "user", "content": "hi"}):
        assert refused(parse_item_create, {"item": item}).param == "item"
    assert refused(parse_item_create, {"item": {"type": "message", "role": "user", "content": [],
                                                "id": "no spaces"}}).param == "item.id"


def test_truncate_wants_a_non_negative_integer_and_content_index_zero():
    assert truncate_end_ms({"audio_end_ms": 160}) == 160
    for event in ({"audio_end_ms": True}, {"audio_end_ms": -1}, {"audio_end_ms": 1.5}, {}):
        assert refused(truncate_end_ms, event).param == "audio_end_ms"
    assert refused(truncate_end_ms, {"audio_end_ms": 0, "content_index": 1}).param == "content_index"


def test_response_metadata_is_kept_only_when_a_small_object():
    assert response_metadata({"response": {"metadata": {"k": "v"}}}) == {"k": "v"}
    assert response_metadata({"response": {"metadata": {"k": "v" * 5000}}}) is None
    assert response_metadata({"response": {"metadata": "text"}}) is None and response_metadata({}) is None


def test_output_deltas_use_one_name_set_and_carry_one_frame_of_pcm16():
    pcm = np.full(audio.FRAME_SAMPLES, 0.25, np.float32)
    where = {"response_id": "r", "item_id": "i", "output_index": 0, "content_index": 0}
    for legacy, names in ((False, GA_NAMES), (True, LEGACY_NAMES)):
        audio_ev, text_ev = output_deltas(where, pcm, " hi", legacy)
        assert (audio_ev["type"], text_ev["type"]) == names
        assert audio_ev["sample_rate_hz"] == audio.SAMPLE_RATE and text_ev["delta"] == " hi"
        samples = np.frombuffer(base64.b64decode(audio_ev["delta"]), "<i2")
        assert samples.size == audio.FRAME_SAMPLES and int(samples[0]) == round(0.25 * 32767)


def test_session_object_reports_what_is_in_effect():
    f32 = SessionSettings(voice="NATF2.pt", instructions="p", input_format=audio.PCM_F32LE,
                          not_in_effect=(("tracing", "not offered by this server"),))
    obj = session_object("s1", "m", f32, {"max_sessions": 2})
    assert obj["input_audio_format"] == audio.PCM_F32LE and "format" not in obj["audio"]["input"]  # GA has no f32
    assert obj["audio"]["output"]["voice"] == "NATF2.pt"
    assert obj["not_in_effect"] == {"tracing": "not offered by this server"}
    assert obj["capabilities"] == {"max_sessions": 2} and obj["event_names"] == "ga"
    assert session_object("s1", "m", DEFAULT, {})["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    json.dumps(obj)  # serializable as is


def test_error_event_names_param_and_event_id_only_when_given():
    assert error_event("invalid_request_error", "bad_event", "m") == {
        "type": "error", "error": {"type": "invalid_request_error", "code": "bad_event", "message": "m"}}
    err = error_event("server_error", "c", "m", client_event_id="e1", param="session")["error"]
    assert (err["event_id"], err["param"]) == ("e1", "session")
