"""Voice enrollment on the gateway (services/gateway/voices.py) against the real local stack: auth, size
and duration caps, hostile names, bad audio, concurrent uploads of one name, delete while a session
uses the voice, the enrolled voice in use from the Realtime wire and from /api/chat, and the talkers'
recordings pruned by a DELETE or a replacing PUT (services/gateway/recordings.py), a talker that
cannot be reached included.

One stack (one cell of two sessions) with --voice-upload and an API key; a second gateway on the
same cell without --voice-upload, and a third that also knows two cells whose talkers never answer.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import socket
import time
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
import sphn
from websockets.asyncio.client import connect

from duplex.v1 import talker_pb2_grpc
from services.gateway.config import GatewayConfig
from tests.realtime_client import FRAME, RT, SR, pcm16_b64, tone
from tests.test_voice_forget import Talk, metric, metric_at
from tools.procs import free_port
from tools.run_stack import GatewayProcess, Stack

KEY = "enroll-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]


def wav_bytes(seconds: float, rate: int = 24_000, seed: int = 0, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    g = np.random.default_rng(seed)
    x = amplitude * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) * np.sin(2 * np.pi * (150 + 50 * seed) * t)
    x = x + 0.01 * g.standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def request(gw, method: str, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=60)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


async def call(gw, *args, **kw) -> tuple[int, dict]:
    return await asyncio.to_thread(request, gw, *args, **kw)


def code_of(reply: dict) -> str:
    return reply.get("error", {}).get("code", "")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    voices, cache = tmp_path_factory.mktemp("enrolled"), tmp_path_factory.mktemp("recorded")
    args = GATEWAY_ARGS + ["--voice-upload", "--voices-dir", str(voices), "--api-key-env", "TEST_GW_KEY"]
    with Stack(tiny_checkpoint, sessions=2, codec_args=["--slots", "3"], gateway_args=args,
               gateway_env={"TEST_GW_KEY": KEY}, talker_args=["--voice-cache-dir", str(cache)]) as s:
        yield s


async def test_enrollment_needs_the_key_and_lists_bundled_and_enrolled_voices(stack):
    gw = stack.gateway
    assert (await call(gw, "PUT", "/v1/voices/alice", wav_bytes(2.5), key=None))[0] == 401
    assert (await call(gw, "PUT", "/v1/voices/alice", wav_bytes(2.5), key="wrong"))[0] == 401
    assert (await call(gw, "DELETE", "/v1/voices/alice", key=None))[0] == 401
    status, reply = await call(gw, "PUT", "/v1/voices/alice", wav_bytes(2.5))
    assert status == 201 and reply == {"name": "alice", "kind": "enrolled", "seconds": 2.5}
    assert (await call(gw, "PUT", "/v1/voices/alice", wav_bytes(2.6, seed=1)))[0] == 200  # replaced
    status, listing = await call(gw, "GET", "/v1/voices", key=None)  # the list is open, like the page
    assert status == 200 and listing["upload"] is True
    kinds = {v["name"]: (v["kind"], v["seconds"]) for v in listing["data"]}
    assert kinds["alice"] == ("enrolled", 2.6)
    assert {"NATF2.pt", "NATM1.pt", "VARF0.pt"} <= {n for n, (k, _) in kinds.items() if k == "bundled"}
    assert all(s > 0 for _, s in kinds.values())
    assert (await call(gw, "DELETE", "/v1/voices/alice"))[0] == 200
    assert (await call(gw, "DELETE", "/v1/voices/alice"))[0] == 404
    assert "alice" not in {v["name"] for v in (await call(gw, "GET", "/v1/voices"))[1]["data"]}


@pytest.mark.parametrize("name,status,code", [
    ("NATF2.pt", 403, "bundled_voice"), ("NATF2", 403, "bundled_voice"), ("..", 400, "invalid_voice_name"),
    ("a.b", 400, "invalid_voice_name"), ("x" * 65, 400, "invalid_voice_name"), ("%2e%2e", 400, "invalid_voice_name"),
    ("a%2Fb", 400, "invalid_voice_name"), ("a/b", 400, "invalid_voice_name"), ("", 400, "invalid_voice_name"),
])
async def test_hostile_and_bundled_names_are_refused(stack, name, status, code):
    got, reply = await call(stack.gateway, "PUT", f"/v1/voices/{name}", wav_bytes(2.5))
    assert (got, code_of(reply)) == (status, code), reply
    if name.endswith(".pt"):
        assert (await call(stack.gateway, "DELETE", f"/v1/voices/{name}"))[0] == 403


@pytest.mark.parametrize("body,status,code", [
    (b"", 400, "empty_audio"), (b"hello, not audio", 400, "not_audio"),
    ("silent", 400, "silent"), ("short", 400, "too_short"), ("long", 413, "too_long"),
])
async def test_bad_audio_gets_a_typed_4xx_and_stores_nothing(stack, body, status, code):
    if body == "silent":
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(24_000)
            w.writeframes(b"\x00\x00" * 72_000)
        body = buf.getvalue()
    elif body == "short":
        body = wav_bytes(1.0)
    elif body == "long":
        body = wav_bytes(31.0, rate=8_000)
    got, reply = await call(stack.gateway, "PUT", "/v1/voices/bad", body)
    assert (got, code_of(reply)) == (status, code), reply
    assert "bad" not in {v["name"] for v in (await call(stack.gateway, "GET", "/v1/voices"))[1]["data"]}


async def test_an_upload_over_the_byte_cap_is_refused_before_its_body_is_read(stack):
    gw = stack.gateway
    with socket.create_connection((gw.host, gw.port), timeout=30) as s:
        s.sendall(f"PUT /v1/voices/huge HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {64 * 1024 * 1024}\r\n\r\n".encode())
        head = s.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 413") and "voice_too_large" in head


async def test_concurrent_uploads_of_one_name_leave_one_whole_voice(stack):
    gw = stack.gateway
    bodies = [wav_bytes(2.0 + 0.5 * i, seed=i) for i in range(4)]
    results = await asyncio.gather(*(call(gw, "PUT", "/v1/voices/bob", b) for b in bodies * 2))
    assert all(status in (200, 201) for status, _ in results)
    listing = {v["name"]: v["seconds"] for v in (await call(gw, "GET", "/v1/voices"))[1]["data"]}
    assert listing["bob"] in (2.0, 2.5, 3.0, 3.5)  # exactly one upload, whole
    leftovers = [p.name for p in stack_voices_dir(stack).iterdir() if p.name.startswith(".")]
    assert leftovers == []
    assert (await call(gw, "DELETE", "/v1/voices/bob"))[0] == 200


def stack_voices_dir(stack):
    from pathlib import Path

    args = stack.gateway_args
    return Path(args[args.index("--voices-dir") + 1])


async def test_an_enrolled_voice_talks_on_both_protocols_and_survives_its_deletion(stack):
    gw = stack.gateway
    assert (await call(gw, "PUT", "/v1/voices/carol", wav_bytes(2.0, seed=5)))[0] == 201
    rt = await RT.connect(gw.ws_url, headers=AUTH)
    created = await rt.open(voice="carol", instructions="You are kind.")
    assert created["type"] == "session.created", created
    assert created["session"]["voice"] == "carol"
    x = tone(30)
    for i in range(10):
        await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i * FRAME:(i + 1) * FRAME])})
        await asyncio.sleep(0.08)
    assert await rt.wait_frames(5) >= 5
    # deleted while the session uses it: the session goes on, new sessions cannot pick it
    assert (await call(gw, "DELETE", "/v1/voices/carol"))[0] == 200
    for i in range(10, 30):
        await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i * FRAME:(i + 1) * FRAME])})
        await asyncio.sleep(0.08)
    delay = created["session"]["capabilities"]["output_delay_frames"]
    assert await rt.wait_frames(30 - delay) == 30 - delay
    _, closed = await rt.close()
    assert closed["frames_in"] == 30 and closed["frames_out"] == 30 - delay
    late = await RT.connect(gw.ws_url, headers=AUTH)
    refused = await late.open(voice="carol")
    assert refused["type"] == "error" and refused["error"]["code"] == "invalid_voice", refused
    await late.ws.close()

    # the native protocol, by name
    assert (await call(gw, "PUT", "/v1/voices/dave", wav_bytes(2.2, seed=6)))[0] == 201
    url = f"ws://{gw.host}:{gw.port}/api/chat?voice_prompt=dave&text_prompt=Hi."
    # max_queue=None: the output still arriving when this client stops reading is queued, not left in the
    # socket, so the gateway's close frame reaches it (a full 16-message queue stops the reads: the close
    # handshake then waits websockets' 10 s close_timeout and ends 1006).
    async with connect(url, max_size=None, max_queue=None, additional_headers=AUTH) as ws:
        assert await asyncio.wait_for(ws.recv(), 120) == b"\x00"
        writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
        pcm = []
        deadline = time.monotonic() + 60
        for i in range(12):
            await ws.send(b"\x01" + writer.append_pcm(x[i * FRAME:(i + 1) * FRAME]))
            await asyncio.sleep(0.08)
        while sum(p.size for p in pcm) < 2 * FRAME and time.monotonic() < deadline:
            msg = await asyncio.wait_for(ws.recv(), 60)
            if msg[0] == 1:
                pcm.append(reader.append_bytes(msg[1:]))
        assert sum(p.size for p in pcm) >= 2 * FRAME
    assert (await call(gw, "DELETE", "/v1/voices/dave"))[0] == 200


async def test_without_voice_upload_the_routes_refuse_and_the_list_still_answers(stack):
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--api-key-env", "TEST_GW_KEY"],
                        env={"TEST_GW_KEY": KEY}).start()
    try:
        status, reply = await call(gw, "PUT", "/v1/voices/erin", wav_bytes(2.5))
        assert (status, code_of(reply)) == (403, "voice_upload_disabled")
        status, listing = await call(gw, "GET", "/v1/voices")
        assert status == 200 and listing["upload"] is False and any(v["name"] == "NATF2.pt" for v in listing["data"])
    finally:
        gw.stop()
    with pytest.raises(SystemExit):  # upload without an API key is a configuration error
        GatewayConfig.from_args(["--voice-upload", "--api-key-env", "NO_SUCH_KEY_VAR"])


# ---- the talkers' recordings of a deleted voice -------------------------------------------------

def recordings_held(stack) -> int:
    return int(metric(stack.cell_procs[0].talker, "duplex_talker_voice_recordings"))


def recording_files(stack) -> int:
    args = stack.talker_args
    return len(list(Path(args[args.index("--voice-cache-dir") + 1]).glob("enrolled-*.pt")))


async def talk_with(gw, voice: str, frames: int = 6) -> None:
    """A short Realtime session with `voice`: its talker records the voice's audio (if it has not)."""
    rt = await RT.connect(gw.ws_url, headers=AUTH)
    created = await rt.open(voice=voice, instructions="Hi.")
    assert created["type"] == "session.created", created
    x = tone(frames)
    for i in range(frames):
        await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i * FRAME:(i + 1) * FRAME])})
        await asyncio.sleep(0.08)
    assert await rt.wait_frames(2) >= 2
    await rt.close()


async def test_delete_and_replace_prune_the_talkers_recording_of_the_voice(stack):
    """A session records the enrolled voice on the talker (a recording in memory, a file on disk). A PUT
    that replaces the voice makes the talker forget the old audio's recording; a DELETE forgets the
    new one's and its answer says so for each talker ("forgotten", or "not_held" where none was
    made). Enrolled and used again, the voice is recorded again."""
    gw, talker = stack.gateway, stack.cell_procs[0].talker
    assert (await call(gw, "PUT", "/v1/voices/gina", wav_bytes(2.0, seed=7)))[0] == 201
    held0, files0 = recordings_held(stack), recording_files(stack)
    await talk_with(gw, "gina")
    assert (recordings_held(stack), recording_files(stack)) == (held0 + 1, files0 + 1)
    assert (await call(gw, "PUT", "/v1/voices/gina", wav_bytes(2.4, seed=8)))[0] == 200  # replaced
    assert (recordings_held(stack), recording_files(stack)) == (held0, files0)
    await talk_with(gw, "gina")
    assert recordings_held(stack) == held0 + 1
    status, reply = await call(gw, "DELETE", "/v1/voices/gina")
    assert status == 200 and reply == {"name": "gina", "deleted": True,
                                       "recordings": [{"talker": talker.address, "outcome": "forgotten"}]}
    assert (recordings_held(stack), recording_files(stack)) == (held0, files0)
    assert (await call(gw, "PUT", "/v1/voices/gina", wav_bytes(2.4, seed=8)))[0] == 201  # the same audio again
    await talk_with(gw, "gina")
    assert (recordings_held(stack), recording_files(stack)) == (held0 + 1, files0 + 1)  # recorded again
    status, reply = await call(gw, "DELETE", "/v1/voices/gina")
    assert reply["recordings"] == [{"talker": talker.address, "outcome": "forgotten"}]
    assert (await call(gw, "PUT", "/v1/voices/gina", wav_bytes(2.0, seed=9)))[0] == 201
    status, reply = await call(gw, "DELETE", "/v1/voices/gina")  # never used: nothing was recorded
    assert reply["recordings"] == [{"talker": talker.address, "outcome": "not_held"}]


async def test_a_voice_deleted_while_a_session_starts_with_it_keeps_its_recording_until_the_prompt_is_in(stack):
    """A session that has shipped the voice's audio but whose prompt is not in its slot yet (a held open,
    as an SDK's early connect makes) keeps the recording through a DELETE: the answer is "deferred",
    the session's prompt then starts and it talks, and the recording goes at its ready."""
    gw, talker = stack.gateway, stack.cell_procs[0].talker
    assert (await call(gw, "PUT", "/v1/voices/hank", wav_bytes(2.2, seed=10)))[0] == 201
    audio = (stack_voices_dir(stack) / "hank.f32").read_bytes()  # what the gateway ships with an open
    with grpc.insecure_channel(talker.address) as ch:
        held = Talk(talker_pb2_grpc.TalkerStub(ch), "starting-with-hank", audio, hold_ms=20_000)
        assert await asyncio.to_thread(held.first) == "held"
        before = recordings_held(stack)
        status, reply = await call(gw, "DELETE", "/v1/voices/hank")
        assert status == 200 and reply["recordings"] == [{"talker": talker.address, "outcome": "deferred"}]
        assert recordings_held(stack) == before
        assert await asyncio.to_thread(held.talk, 4) == ["ready"] + ["output"] * 4
    deadline = time.monotonic() + 10
    while recordings_held(stack) != before - 1:
        assert time.monotonic() < deadline, "the recording outlived its last session's ready"
        await asyncio.sleep(0.05)


async def test_delete_answers_within_its_deadline_and_names_the_talkers_it_could_not_reach(stack):
    """A gateway that knows three cells: the stack's, one whose talker port has nothing listening, and
    one whose talker accepts TCP and never answers. A DELETE still answers 200 (the name is gone)
    within the forget deadline (1 s here), naming each talker's outcome: "unreachable" and
    "timed_out" for the two, counted in gateway_voice_forgets_total{outcome}."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
    dead_talker, silent_talker = f"127.0.0.1:{free_port()}", f"127.0.0.1:{silent.getsockname()[1]}"
    bogus = [f"127.0.0.1:{free_port()},{t},127.0.0.1:{free_port()}" for t in (dead_talker, silent_talker)]
    args = GATEWAY_ARGS + ["--voice-upload", "--voices-dir", str(stack_voices_dir(stack)), "--api-key-env",
                           "TEST_GW_KEY", "--voice-forget-timeout-s", "1"]
    gw = GatewayProcess(";".join([stack.cell_procs[0].spec, *bogus]), args=args, env={"TEST_GW_KEY": KEY}).start()
    try:
        assert (await call(gw, "PUT", "/v1/voices/ivy", wav_bytes(2.0, seed=11)))[0] == 201
        t0 = time.monotonic()
        status, reply = await call(gw, "DELETE", "/v1/voices/ivy")
        took = time.monotonic() - t0
        assert status == 200 and reply["deleted"] is True
        assert {r["talker"]: r["outcome"] for r in reply["recordings"]} == {
            stack.cell_procs[0].talker.address: "not_held", dead_talker: "unreachable", silent_talker: "timed_out"}
        assert took < 2.5, took
        url = gw.http_url + "/metrics"
        for outcome in ("not_held", "unreachable", "timed_out"):
            assert metric_at(url, "gateway_voice_forgets_total", outcome=outcome) == 1
        assert (await call(gw, "DELETE", "/v1/voices/ivy"))[0] == 404
    finally:
        gw.stop()
        silent.close()
