"""The gateway's pure protocol layer: audio validation, framing, session.update rules, capabilities, Opus."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import sphn
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway import audio
from services.gateway.config import CellAddress, GatewayConfig, parse_cells
from services.gateway.realtime_wire import ClientError, SessionSettings, capabilities, parse_session_update

DEFAULT = SessionSettings(voice="", instructions="hello")


# ---- audio -----------------------------------------------------------------

def test_strict_base64_refuses_whitespace_urlsafe_and_non_strings():
    good = base64.b64encode(b"\x01\x02\x03\x04").decode()
    assert audio.b64decode_strict(good) == b"\x01\x02\x03\x04"
    for bad in ["AQID BA==", "AQIDBA", "AQ-_", "AQIDBA==\n", 123, None, "é"]:
        with pytest.raises(audio.AudioError) as e:
            audio.b64decode_strict(bad)
        assert e.value.code == "bad_audio"


@pytest.mark.parametrize(
    "data,fmt,code",
    [
        (b"", audio.PCM16, "bad_audio"),
        (b"\x00\x00\x00", audio.PCM16, "bad_audio"),  # 1.5 samples
        (b"\x00" * 6, audio.PCM_F32LE, "bad_audio"),  # 1.5 samples
        (np.array([0.1, np.nan], "<f4").tobytes(), audio.PCM_F32LE, "bad_audio"),
        (np.array([np.inf], "<f4").tobytes(), audio.PCM_F32LE, "bad_audio"),
        (b"\x00\x00", "mulaw", "unsupported_audio_format"),
        (b"\x00\x00" * 11, audio.PCM16, "bad_audio"),  # over the per-packet bound of 10
    ],
)
def test_bad_pcm_is_refused_with_its_code(data, fmt, code):
    with pytest.raises(audio.AudioError) as e:
        audio.pcm_bytes_to_f32(data, fmt, max_samples=10)
    assert e.value.code == code


def test_pcm16_and_f32_conversions_round_trip():
    x = np.array([0.0, 0.5, -0.5, 0.999, -1.0], dtype=np.float32)
    f32 = audio.pcm_bytes_to_f32(x.astype("<f4").tobytes(), audio.PCM_F32LE, 100)
    np.testing.assert_array_equal(f32, x)
    back = audio.pcm_bytes_to_f32(audio.f32_to_pcm16_bytes(x), audio.PCM16, 100)
    np.testing.assert_allclose(back, x, atol=2 / 32768)
    # Out-of-range and non-finite output is clipped / zeroed, never wrapped.
    clipped = np.frombuffer(audio.f32_to_pcm16_bytes(np.array([2.0, -3.0, np.nan], np.float32)), "<i2")
    assert clipped.tolist() == [32767, -32767, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=12))
def test_frame_assembler_regroups_any_packet_sizes_losslessly(sizes):
    rng = np.random.default_rng(len(sizes))
    packets = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    asm = audio.FrameAssembler()
    frames = [f for p in packets for f in asm.push(p)]
    total = sum(sizes)
    assert len(frames) == total // audio.FRAME_SAMPLES
    assert asm.pending_samples == total % audio.FRAME_SAMPLES
    last = asm.flush()
    assert (last is None) == (total % audio.FRAME_SAMPLES == 0)
    out = np.concatenate(frames + ([last] if last is not None else []))
    np.testing.assert_array_equal(out[:total], np.concatenate(packets))
    assert not out[total:].any()  # only the final residual is zero-padded
    assert asm.flush() is None


def test_frame_assembler_clear_drops_only_the_residual():
    asm = audio.FrameAssembler()
    assert len(asm.push(np.ones(2000, np.float32))) == 1
    assert asm.clear() == 80
    assert asm.flush() is None


def test_sphn_opus_round_trip_at_24khz():
    t = np.arange(audio.FRAME_SAMPLES * 10) / audio.SAMPLE_RATE
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    w, r = sphn.OpusStreamWriter(audio.SAMPLE_RATE), sphn.OpusStreamReader(audio.SAMPLE_RATE)
    out = [r.append_bytes(w.append_pcm(x[i : i + audio.FRAME_SAMPLES])) for i in range(0, x.size, audio.FRAME_SAMPLES)]
    y = np.concatenate(out)
    assert y.size >= audio.FRAME_SAMPLES * 8 and np.isfinite(y).all()
    assert np.sqrt(np.mean(y[audio.FRAME_SAMPLES :] ** 2)) > 0.1  # the tone survives the codec


# ---- session.update ----------------------------------------------------------

def test_ga_session_update_sets_pcm16_voice_and_persona():
    s = parse_session_update(
        {
            "type": "realtime",
            "model": "m",
            "output_modalities": ["audio"],
            "instructions": "You are a pirate.",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "NATF2.pt"}},
        },
        DEFAULT,
        100,
    )
    assert (s.input_format, s.voice, s.instructions, s.input_format_explicit) == (
        "pcm16", "NATF2.pt", "You are a pirate.", True)


def test_beta_session_update_sets_f32_and_extra_body():
    s = parse_session_update(
        {"input_audio_format": "pcm_f32le", "output_audio_format": "pcm16", "voice": "NATM1.pt", "turn_detection": None,
         "modalities": ["audio", "text"],
         "extra_body": {"auto_response": True, "legacy_event_names": True, "seed": 7, "greedy": True}},
        DEFAULT,
        100,
    )
    assert (s.input_format, s.voice, s.legacy_event_names, s.seed, s.greedy) == ("pcm_f32le", "NATM1.pt", True, 7, True)
    assert s.sampling().seed == 7 and s.sampling().greedy


@pytest.mark.parametrize(
    "session,code",
    [
        ("nope", "bad_event"),
        ({"tools": [{"type": "function", "name": "f"}]}, "unsupported_feature"),
        ({"tools": {}}, "bad_event"),
        ({"capabilities": {}}, "bad_event"),  # server-owned
        ({"id": "../x"}, "bad_event"),
        ({"type": "transcription"}, "bad_event"),
        ({"input_audio_format": "g711_ulaw"}, "unsupported_audio_format"),
        ({"output_audio_format": "pcm_f32le"}, "unsupported_audio_format"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "unsupported_audio_format"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "unsupported_audio_format"),
        ({"audio": {"output": {"speed": 1.2}}}, "unsupported_feature"),
        ({"audio": {"output": {"speed": "fast"}}}, "unsupported_feature"),
        ({"audio": {"input": {"echo": True}}}, "bad_event"),
        ({"voice": "../etc/passwd.pt"}, "invalid_voice"),
        ({"voice": "not a voice"}, "invalid_voice"),
        ({"voice": 3}, "invalid_voice"),
        ({"voice": "/abs/NATF2.pt"}, "invalid_voice"),
        ({"instructions": "x" * 101}, "bad_event"),
        ({"instructions": 5}, "bad_event"),
        ({"modalities": ["text"]}, "bad_event"),
        ({"extra_body": {"auto_response": False}}, "unsupported_feature"),
        ({"extra_body": {"tools": 1}}, "bad_event"),
        ({"extra_body": {"seed": -1}}, "bad_event"),
    ],
)
def test_bad_session_update_is_refused_whole(session, code):
    with pytest.raises(ClientError) as e:
        parse_session_update(session, DEFAULT, 100)
    assert e.value.code == code


def test_standard_fields_sdks_always_send_are_accepted_and_reported_not_in_effect():
    # livekit-plugins-openai 1.8.9's first session.update, as sent.
    livekit = {
        "type": "realtime", "model": "gpt-realtime", "output_modalities": ["audio"], "max_output_tokens": "inf",
        "tool_choice": "auto", "tracing": None,
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "noise_reduction": None,
                            "transcription": {"model": "gpt-4o-mini-transcribe"},
                            "turn_detection": {"type": "semantic_vad", "create_response": True, "eagerness": "auto",
                                               "interrupt_response": True}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0, "voice": "marin"}},
    }
    s = parse_session_update(livekit, DEFAULT, 100)
    assert s.voice == "NATF2.pt"  # through the default alias table
    assert set(dict(s.not_in_effect)) == {"max_output_tokens", "tool_choice", "audio.input.transcription",
                                          "audio.input.turn_detection"}
    # A later update keeps what earlier ones asked for, unless it turns it off.
    later = parse_session_update({"instructions": "Hi.", "audio": {"input": {"turn_detection": None}}}, s, 100)
    assert set(dict(later.not_in_effect)) == {"max_output_tokens", "tool_choice", "audio.input.transcription"}
    # pipecat with a context aggregator; vLLM-Omni naming its session; a bare bundled voice name.
    s = parse_session_update({"type": "realtime", "tools": [], "instructions": "Be brief.", "session_id": "omni-1",
                              "turn_detection": {"type": "server_vad"}, "voice": "NATM1"}, DEFAULT, 100)
    assert (s.voice, s.instructions, s.requested_id) == ("NATM1.pt", "Be brief.", "omni-1")
    assert dict(s.not_in_effect) == {"turn_detection": "the model takes turns itself (full duplex); no VAD runs"}
    # The operator's table replaces the default one.
    assert parse_session_update({"voice": "Alloy"}, DEFAULT, 100, {"alloy": "VARF0.pt"}).voice == "VARF0.pt"
    with pytest.raises(ClientError):
        parse_session_update({"voice": "al loy"}, DEFAULT, 100, {})


def test_voice_alias_flag_replaces_the_table():
    cfg = GatewayConfig.from_args(["--cells", "a:1,b:2,c:3", "--voice-aliases", "marin=VARF0.pt, cedar=NATM1.pt"])
    assert cfg.voice_aliases == (("marin", "VARF0.pt"), ("cedar", "NATM1.pt"))
    assert GatewayConfig.from_args(["--cells", "a:1,b:2,c:3", "--voice-aliases", ""]).voice_aliases == ()
    assert dict(GatewayConfig.from_args(["--cells", "a:1,b:2,c:3"]).voice_aliases)["alloy"] == "NATF2.pt"
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--cells", "a:1,b:2,c:3", "--voice-aliases", "marin"])


def test_capabilities_follow_configured_capacity():
    one = capabilities({"total_slots": 1, "max_cell_slots": 1})
    assert not one["supports_multi_session"] and not one["supports_multi_session_same_replica"]
    two_cells = capabilities({"total_slots": 2, "max_cell_slots": 1})
    assert two_cells["supports_multi_session"] and not two_cells["supports_multi_session_same_replica"]
    c = capabilities({"total_slots": 4, "max_cell_slots": 2}, output_delay_frames=2)
    assert c["supports_multi_session_same_replica"] and c["max_sessions"] == 4 and c["output_delay_frames"] == 2
    assert c["implementation_level"] == "model_native_duplex" and c["chunk_period_ms"] == 80
    assert c["supports_barge_in"] is False and c["supports_session_resume"] is False and "resume_grace_s" not in c
    assert c["input_modes"] == ["append_audio_chunk"]
    resumable = capabilities({"total_slots": 4, "max_cell_slots": 2}, resume_grace_s=15.0)
    assert resumable["supports_session_resume"] is True and resumable["resume_grace_s"] == 15.0


# ---- config ------------------------------------------------------------------

def test_cells_parse_and_refuse_malformed():
    cells = parse_cells("a:1,b:2,c:3; 10.0.0.1:50051,10.0.0.1:50052,10.0.0.1:50053")
    assert cells == (CellAddress("a:1", "b:2", "c:3"),
                     CellAddress("10.0.0.1:50051", "10.0.0.1:50052", "10.0.0.1:50053"))
    for bad in ["a:1,b:2", "a:1,b:2,c", "a:1,b:2,c:99999"]:
        with pytest.raises(ValueError):
            parse_cells(bad)


def test_config_from_args_reads_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    c = GatewayConfig.from_args(["--cells", "a:1,b:2,c:3", "--api-key-env", "MY_KEY", "--port", "0"])
    assert c.api_key == "s3cret" and c.port == 0 and len(c.cells) == 1
    assert GatewayConfig.from_args(["--cells", "a:1,b:2,c:3", "--api-key-env", "UNSET_VAR_X"]).api_key is None


async def test_cells_from_dns_name_use_the_configured_ports():
    from services.gateway.cells import CellPool

    pool = CellPool(GatewayConfig(cells_dns="localhost", dns_ports=(1111, 2222, 3333)))
    await pool._refresh_dns()
    try:
        addrs = {c.address for c in pool.cells.values()}
        assert CellAddress("127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333") in addrs
        # Nothing answers there: no cell is serving, so none is a candidate and health is false.
        await pool.poll_once()
        assert pool.candidates() == [] and not pool.healthy()
    finally:
        await pool.stop()


async def test_a_lost_stage_link_fails_the_session_at_once_as_that_stages_failure():
    """A cell whose stages nobody serves (real gRPC links to ports with no server): the open fails
    typed and at once, attributed to a stage, not after the open timeout, and the broken link is
    replaced by a new one for the next open."""
    import time

    from duplex.v1 import talker_pb2
    from services.gateway.cells import _make_cell
    from services.gateway.relay import OpenParams, Relay, RelayError
    from tests.relay_listener import RelayRecorder
    from tools.procs import free_port

    cell = _make_cell(CellAddress(*(f"127.0.0.1:{free_port()}" for _ in range(3))))
    params = OpenParams("s-1", "", "persona", talker_pb2.Sampling())
    try:
        t0 = time.monotonic()
        with pytest.raises(RelayError) as e:
            await Relay.open_on(cell, params, RelayRecorder(), open_timeout_s=30, stall_timeout_s=5,
                                cleanup_timeout_s=5)
        assert time.monotonic() - t0 < 10
        assert e.value.code == "runtime_open_failed" and e.value.stage in ("encoder", "talker", "decoder")
        assert "link lost" in e.value.message
        first = cell.link
        with pytest.raises(RelayError):
            await Relay.open_on(cell, params, RelayRecorder(), open_timeout_s=30, stall_timeout_s=5,
                                cleanup_timeout_s=5)
        assert cell.link is not first or first is None
    finally:
        await cell.close()


# ---- the conversation record (GA item lifecycle) -----------------------------------------------

def test_conversation_lifecycle_validates_and_truncate_cuts_at_a_frame():
    from services.gateway.conversation import MAX_ITEMS, MAX_TRANSCRIPT_CHARS, Conversation
    from tests.openai_events import validate_server_event

    for legacy in (False, True):
        c = Conversation("sess_1", legacy=legacy)
        events = c.start({"client_event_id": "x"})
        for text in ["Hel", "", "lo", " there", ""]:
            where = c.delta_fields(text)
        item = where["item_id"]
        events.append(c.truncate(item, 160))  # the client heard two frames (160 ms)
        assert c.items[item].transcript == "Hel" and events[-1]["audio_end_ms"] == 160
        events += c.finish("cancelled")
        events += c.start()
        events += c.add_client_item("item_user1", "user", [{"type": "input_text", "text": "hi"}])
        events += c.finish("failed", error={"type": "server_error", "code": "runtime_stream_failed"})
        for ev in events:
            validate_server_event({"event_id": "e", **ev}, legacy)
        done = [e for e in events if e["type"] == "response.done"]
        assert [d["response"]["status"] for d in done] == ["cancelled", "failed"]
        assert done[0]["response"]["output"][0]["content"][0]["transcript"] == "Hel"
        assert done[0]["response"]["metadata"] == {"client_event_id": "x"}
    # Bounded: long transcripts stop growing (frames still count), old items are forgotten.
    c = Conversation("sess_2")
    c.start()
    for _ in range(MAX_TRANSCRIPT_CHARS):
        c.delta_fields("word ")
    assert len(c.current.item.transcript) <= MAX_TRANSCRIPT_CHARS and c.current.item.frames == MAX_TRANSCRIPT_CHARS
    for _ in range(2 * MAX_ITEMS):
        c.finish("completed")
        c.start()
    assert len(c.items) == MAX_ITEMS and c.current.item.id in c.items


def test_every_gateway_flag_reads_its_environment_variable_and_the_command_line_wins(monkeypatch):
    from services.gateway.config import GatewayConfig

    monkeypatch.setenv("GATEWAY_CELLS", "a:1,b:2,c:3")
    monkeypatch.setenv("GATEWAY_OPEN_TIMEOUT", "12.5")
    monkeypatch.setenv("GATEWAY_MAX_CONNECTIONS", "77")
    monkeypatch.setenv("GATEWAY_CELLS_DNS", "cells")
    cfg = GatewayConfig.from_args([])
    assert (cfg.open_timeout_s, cfg.max_connections, cfg.cells_dns) == (12.5, 77, "cells")
    assert cfg.cells[0].encoder == "a:1"
    assert GatewayConfig.from_args(["--open-timeout", "3"]).open_timeout_s == 3.0
    monkeypatch.setenv("GATEWAY_MAX_CONNECTIONS", "many")
    with pytest.raises(SystemExit):  # a bad value is a clear exit, as a bad flag is
        GatewayConfig.from_args([])
