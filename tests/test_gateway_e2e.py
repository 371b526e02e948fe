"""The gateway end to end: real encoder, talker and decoder processes, the real gateway process,
real WebSocket clients (raw, the official `openai` client, and a native /api/chat client with sphn).

One stack (capacity two) is shared by the module; every test leaves it with no session open.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.realtime_client import FRAME, RT, SR, eventually, pcm16_b64, tone
from tools.procs import REPO_ROOT, free_port
from tools.run_stack import GatewayProcess

# This machine is shared and slow: generous bounds for "a stage is stalled" and for opening.
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]


async def paced(rt: RT, x: np.ndarray, period_s: float = FRAME / SR) -> None:
    start = time.monotonic()
    for i, off in enumerate(range(0, x.size, FRAME)):
        await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[off : off + FRAME])})
        await asyncio.sleep(max(0.0, start + (i + 1) * period_s - time.monotonic()))


async def drain(rt: RT, seconds: float) -> None:
    """Keep reading (recording) events for a while."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await rt.recv(deadline - time.monotonic())
    except asyncio.TimeoutError:
        pass


def check_output(rt: RT, min_frames: int) -> None:
    audio_ev, text_ev = rt.of("response.output_audio.delta"), rt.of("response.output_audio_transcript.delta")
    assert len(audio_ev) >= min_frames, (f"{len(audio_ev)} audio deltas, expected >= {min_frames}",
                                         [e["type"] for e in rt.events], rt.of("error"))
    assert abs(len(audio_ev) - len(text_ev)) <= 1  # paired (the last pair may be mid-flight)
    assert not rt.of("response.audio.delta"), "legacy names must not be sent unasked"
    for e in audio_ev:
        assert e["sample_rate_hz"] == SR and len(base64.b64decode(e["delta"])) == FRAME * 2
    x = rt.audio()
    assert np.isfinite(x).all() and float(np.sqrt(np.mean(x**2))) > 1e-3, "output audio is silent"
    assert any(e["delta"] for e in text_ev), "no text piece at all"
    assert len({e["response_id"] for e in audio_ev + text_ev}) == 1


@pytest.fixture(scope="module")
def stack(shared_stack):
    # conftest's shared stack: the codec stages have a spare slot, so the talker is the stage that
    # refuses a third session.
    assert shared_stack.gateway_args == GATEWAY_ARGS
    return shared_stack


def stage_capacity(stack, stage: str):
    from duplex.v1 import common_pb2, decoder_pb2_grpc, encoder_pb2_grpc

    stub = {"encoder": encoder_pb2_grpc.EncoderStub, "decoder": decoder_pb2_grpc.DecoderStub}[stage]
    with grpc.insecure_channel(getattr(stack.cell_procs[0], stage).address) as ch:
        return stub(ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5)


def http_get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def metric(stack, name: str) -> float:
    _, body, _ = http_get(stack.gateway.http_url + "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_two_paced_sessions_third_refused_and_slot_reuse_without_leakage(stack):
    url = stack.gateway.ws_url
    a, b = await RT.connect(url), await RT.connect(url)
    ca, cb = await a.open(instructions="You are Alice.", voice="NATF2.pt"), await b.open(instructions="You are Bob.")
    for created, persona in ((ca, "You are Alice."), (cb, "You are Bob.")):
        assert created["type"] == "session.created", created
        caps = created["session"]["capabilities"]
        assert caps["implementation_level"] == "model_native_duplex" and caps["chunk_period_ms"] == 80
        assert caps["supports_multi_session"] and caps["supports_multi_session_same_replica"]
        assert caps["max_sessions"] == 2
        assert created["session"]["instructions"] == persona
    assert ca["session"]["voice"] == "NATF2.pt"
    await a.until("session.updated"), await b.until("session.updated")

    # Capacity two: a third session is refused before any session.created, and nothing is opened.
    c = await RT.connect(url)
    await c.send({"type": "session.update", "session": {"type": "realtime"}})
    err = await c.recv(60)
    assert err["type"] == "error"
    assert (err["error"]["type"], err["error"]["code"]) == ("rate_limit_error", "resource_exhausted")
    with pytest.raises(ConnectionClosed):
        while True:
            assert (await c.recv(30))["type"] != "session.created"
    # Nothing half-opened: the encoder and decoder streams the talker's refusal left are closed again.
    for stage in ("encoder", "decoder"):
        assert stage_capacity(stack, stage).active_streams == 2, stage

    n = 12
    await asyncio.gather(paced(a, tone(n, 220)), paced(b, tone(n, 330, seed=1)))
    await asyncio.gather(a.wait_frames(n - 2), b.wait_frames(n - 2))
    done, closed = await a.close()
    assert done["response"]["status"] == "completed" and closed["cleanup_confirmed"] is True
    check_output(a, min_frames=n // 2)
    ids_a = {e["response_id"] for e in a.of("response.output_audio.delta")}
    b_frames_before = len(b.of("response.output_audio.delta"))

    # The freed slot takes a replacement with another persona and voice; b keeps going meanwhile.
    d = await RT.connect(url)
    deadline = time.monotonic() + 10
    while True:
        created = await d.open(instructions="You are Dora.", voice="NATM1.pt")
        if created["type"] == "session.created" or time.monotonic() > deadline:
            break
        d = await RT.connect(url)  # the stage may still be confirming a's release
    assert created["type"] == "session.created", created
    assert created["session"]["instructions"] == "You are Dora." and created["session"]["voice"] == "NATM1.pt"
    await asyncio.gather(paced(d, tone(n, 440, seed=2)), paced(b, tone(n, 330, seed=3)))
    await asyncio.gather(d.wait_frames(n - 2), b.wait_frames(2 * n - 2))
    check_output(d, min_frames=n // 2)
    assert len(b.of("response.output_audio.delta")) > b_frames_before + n // 2, "b stalled while a closed and d opened"
    ids_d = {e["response_id"] for e in d.of("response.output_audio.delta")}
    assert ids_a.isdisjoint(ids_d) and len(ids_d) == 1
    await d.close()
    await b.close()
    check_output(b, min_frames=n)


async def test_malformed_input_gets_one_typed_error_and_the_next_append_works(stack):
    rt = await RT.connect(stack.gateway.ws_url)
    assert (await rt.open(input_audio_format="pcm_f32le"))["type"] == "session.created"
    await rt.until("session.updated")
    good = tone(1)
    f32 = lambda x: base64.b64encode(x.astype("<f4").tobytes()).decode()  # noqa: E731
    append, update = {"type": "input_audio_buffer.append"}, {"type": "session.update"}
    bad = [
        ("not json", "invalid_json"),
        (json.dumps([1, 2]), "bad_event"),
        (json.dumps({"type": "no.such.event"}), "unknown_event"),
        (json.dumps({"type": "input_audio_buffer.append"}), "bad_audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "!!notbase64"}), "bad_audio"),
        (json.dumps({**append, "audio": base64.b64encode(b"\x00" * 7).decode()}), "bad_audio"),
        (json.dumps({**append, "audio": f32(np.array([0.1, np.nan] * 960, np.float32))}), "bad_audio"),
        (json.dumps({**append, "audio": f32(good), "sample_rate_hz": 16000}), "unsupported_audio_format"),
        (json.dumps({**append, "audio": f32(good), "format": "pcm16"}), "unsupported_audio_format"),
        (json.dumps({"type": "session.update", "session": {"voice": "../../etc/x.pt"}}), "invalid_voice"),
        (json.dumps({**update, "session": {"audio": {"output": {"speed": 1.5}}}}), "unsupported_feature"),
        (json.dumps({**update, "session": {"tools": [{"type": "function", "name": "f"}]}}), "unsupported_feature"),
        (json.dumps({"type": "session.resume"}), "unsupported_feature"),
        (json.dumps({"type": "barge_in"}), "unsupported_feature"),
        (json.dumps({"type": "conversation.item.truncate", "item_id": "item_nope", "audio_end_ms": 0}),
         "invalid_item_id"),
    ]
    for i, (message, code) in enumerate(bad):
        await rt.ws.send(message.replace('"type": "input_audio_buffer.append"',
                                         f'"type": "input_audio_buffer.append", "event_id": "c{i}"'))
        ev = await rt.recv(30)
        while ev["type"] != "error":
            ev = await rt.recv(30)  # output of earlier good appends may come first
        assert ev["type"] == "error" and ev["error"]["code"] == code, (message[:80], ev)
        assert ev["error"]["type"] == "invalid_request_error"
        if "input_audio_buffer.append" in message:
            assert ev["error"]["event_id"] == f"c{i}"  # the error names the client event
        # The next good append works: it is accepted silently and output keeps coming.
        await rt.send({"type": "input_audio_buffer.append", "audio": f32(good)})
    # Heartbeat is answered; a half packet stays pending (no frame) until more arrives.
    await rt.send({"type": "session.heartbeat", "event_id": "hb1"})
    ack = await rt.until("session.heartbeat_ack", 30)  # (fails on any further error event)
    assert ack["client_event_id"] == "hb1"
    await rt.wait_frames(len(bad) - 1)
    errors = rt.of("error")
    assert len(errors) == len(bad), errors  # exactly one error per bad message, none for the good ones
    done, closed = await rt.close()
    # 1 + len(bad) good frames went in; output never outnumbers input.
    out = len(rt.of("response.output_audio.delta"))
    assert 1 <= out <= len(bad) + 1
    assert closed["cleanup_confirmed"] is True


async def test_openai_client_speaks_ga_events_with_bearer_key(stack):
    openai = pytest.importorskip("openai")
    # A second gateway on the same cells, with an operator-configured key.
    spec = stack.cell_procs[0].spec
    gw = GatewayProcess(spec, args=GATEWAY_ARGS + ["--api-key-env", "TEST_GW_KEY"],
                        env={"TEST_GW_KEY": "k-123"}).start()
    try:
        # Wrong key: refused at the HTTP upgrade with 401.
        with pytest.raises(InvalidStatus) as e:
            await connect(gw.ws_url, additional_headers={"Authorization": "Bearer wrong"})
        assert e.value.response.status_code == 401
        client = openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="k-123")
        async with client.realtime.connect(model="personaplex", extra_query={"duplex": "1"}) as conn:
            await conn.session.update(session={"type": "realtime", "instructions": "You are a helpful pirate.",
                                               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
            x = tone(8)
            audio_chunks, texts, types = [], [], []

            async def send():
                for off in range(0, x.size, FRAME):
                    await conn.input_audio_buffer.append(audio=pcm16_b64(x[off : off + FRAME]))
                    await asyncio.sleep(0.08)

            sender = asyncio.create_task(send())
            async for ev in conn:
                types.append(ev.type)
                if ev.type == "response.output_audio.delta":
                    audio_chunks.append(np.frombuffer(base64.b64decode(ev.delta), "<i2"))
                elif ev.type == "response.output_audio_transcript.delta":
                    texts.append(ev.delta)
                    if len(texts) >= 4:  # after a whole audio+text pair (the rest is read after close)
                        break
                elif ev.type == "error":
                    pytest.fail(f"error event: {ev}")
            await sender
            await conn.send({"type": "session.close"})
            async for ev in conn:
                types.append(ev.type)
                if ev.type == "session.closed":
                    break
        assert types[0] == "session.created" and "response.created" in types and "response.done" in types
        y = np.concatenate(audio_chunks).astype(np.float32) / 32768
        assert np.isfinite(y).all() and np.sqrt(np.mean(y**2)) > 1e-3 and len(texts) == len(audio_chunks)
    finally:
        gw.stop()


async def test_native_api_chat_with_ogg_opus(stack):
    url = f"ws://{stack.gateway.host}:{stack.gateway.port}/api/chat?voice_prompt=NATF2.pt&text_prompt=You%20are%20kind."
    async with connect(url, max_size=None) as ws:
        first = await asyncio.wait_for(ws.recv(), 120)
        assert first == b"\x00"  # handshake once the prefill is done
        writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
        x = tone(10)
        pcm_out, text = [], []

        async def send():
            for off in range(0, x.size, FRAME):
                await ws.send(b"\x01" + writer.append_pcm(x[off : off + FRAME]))
                await asyncio.sleep(0.08)

        sender = asyncio.create_task(send())
        deadline = time.monotonic() + 60
        while sum(p.size for p in pcm_out) < 4 * FRAME and time.monotonic() < deadline:
            msg = await asyncio.wait_for(ws.recv(), 60)
            assert isinstance(msg, bytes) and msg[0] in (1, 2), msg[:40]
            if msg[0] == 1:
                pcm_out.append(reader.append_bytes(msg[1:]))
            else:
                text.append(msg[1:].decode())
        await sender
        y = np.concatenate(pcm_out)
        assert y.size >= 4 * FRAME and np.isfinite(y).all() and np.sqrt(np.mean(y**2)) > 1e-3
        assert text and all(t for t in text)
    # Refusals are HTTP answers to the upgrade: 400 for what a retry cannot fix (a malformed or an
    # unknown voice), 503 + Retry-After while every slot is taken.
    for voice in ("../x.pt", "NOPE.pt"):
        with pytest.raises(InvalidStatus) as e:
            await connect(url.replace("NATF2.pt", voice))
        assert e.value.response.status_code == 400
        assert json.loads(e.value.response.body)["error"]["code"] == "invalid_voice"
    async with connect(url, max_size=None) as a, connect(url, max_size=None) as b:
        assert await asyncio.wait_for(a.recv(), 120) == b"\x00" and await asyncio.wait_for(b.recv(), 120) == b"\x00"
        with pytest.raises(InvalidStatus) as e:
            await connect(url)
        assert e.value.response.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
        assert json.loads(e.value.response.body)["error"]["code"] == "resource_exhausted"
        # A client that closes and reconnects at once (LiveKit's plugin does, to change the persona)
        # gets its own slot back: admission waits for the slot being released.
        await a.close()
        async with connect(url, max_size=None) as c:
            assert await asyncio.wait_for(c.recv(), 120) == b"\x00"


async def test_health_metrics_static_and_routing(stack):
    base = stack.gateway.http_url
    status, body, ctype = http_get(base + "/health")
    assert status == 200 and json.loads(body)["serving_cells"] == 1 and ctype == "application/json"
    status, body, ctype = http_get(base + "/metrics")
    assert status == 200 and b"gateway_frame_latency_seconds_bucket" in body and ctype.startswith("text/plain")
    assert http_get(base + "/nope")[0] == 404
    assert http_get(base + "/../pyproject.toml")[0] == 404
    assert http_get(base + "/v1/realtime")[0] == 426  # a WebSocket endpoint, not a page
    status, body, ctype = http_get(base + "/")
    if status == 200:  # the browser page (another engineer's files) is served as HTML
        assert ctype.startswith("text/html")
    with pytest.raises(InvalidStatus) as e:
        await connect(stack.gateway.ws_url.replace("duplex=1", "duplex=0"))
    assert e.value.response.status_code == 400


async def test_legacy_event_names_only_on_request_and_never_both(stack):
    rt = await RT.connect(stack.gateway.ws_url.replace("duplex=1", "duplex=true&legacy_events=1"))
    created = await rt.open()
    assert created["type"] == "session.created" and created["session"]["event_names"] == "legacy"
    await paced(rt, tone(4))
    deadline = time.monotonic() + 90
    while len(rt.of("response.audio_transcript.delta")) < 2 and time.monotonic() < deadline:
        assert (await rt.recv(90))["type"] != "error"
    await rt.close()
    assert len(rt.of("response.audio.delta")) >= 2 and len(rt.of("response.audio_transcript.delta")) >= 2
    assert not rt.of("response.output_audio.delta") and not rt.of("response.output_audio_transcript.delta")


async def test_socket_drop_ends_the_session_in_all_three_stages(stack):
    from duplex.v1 import common_pb2, talker_pb2_grpc

    def talker_active() -> int:
        with grpc.insecure_channel(stack.cell_procs[0].talker.address) as ch:
            return talker_pb2_grpc.TalkerStub(ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5).active_streams

    rt = await RT.connect(stack.gateway.ws_url)
    assert (await rt.open())["type"] == "session.created"
    await paced(rt, tone(3))
    assert talker_active() == 1 and stage_capacity(stack, "encoder").active_streams == 1
    rt.ws.transport.abort()  # no close frame: the TCP connection just goes away
    # The session pauses for a resume first (the 15 s default grace, docs/resume.md), then ends.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        counts = (talker_active(), stage_capacity(stack, "encoder").active_streams,
                  stage_capacity(stack, "decoder").active_streams)
        if counts == (0, 0, 0):
            break
        await asyncio.sleep(0.2)
    assert counts == (0, 0, 0), counts
    assert metric(stack, "gateway_sessions_active") == 0


@pytest.mark.parametrize("early", [True, False])
async def test_the_relay_pairs_early_outputs_with_their_input_frames(stack, early):
    """With early outputs the talker sends output k at its step's end, before the client's frame k when
    frames come slower than the clock: the relay delivers each output only once its frame was sent
    (from inside send_frame), N outputs for N frames in order, and drops the last input's surplus
    output. Without, the talker holds output k for frame k, and the outputs come after it."""
    from duplex.v1 import talker_pb2
    from services.gateway.cells import _make_cell
    from services.gateway.config import CellAddress
    from services.gateway.relay import OpenParams, Relay
    from tests.relay_listener import RelayRecorder

    class Pairing(RelayRecorder):
        def relay_output(self, f) -> None:
            delivered.append((f.seq, f.input_seq, relay.frames_in, sending))

    procs = stack.cell_procs[0]
    cell = _make_cell(CellAddress(procs.encoder.address, procs.talker.address, procs.decoder.address))
    delivered, sending = [], False
    try:
        params = OpenParams(f"early-{early}", "", "Hi.", talker_pb2.Sampling(greedy=True, seed=3), early_outputs=early)
        relay = await Relay.open_on(cell, params, Pairing(), open_timeout_s=120, stall_timeout_s=30,
                                    cleanup_timeout_s=20)
        frames = tone(15).reshape(-1, FRAME)  # one per 0.25 s: output k is decoded before frame k is sent
        for frame in frames:
            await asyncio.sleep(0.25)
            sending = True
            await relay.send_frame(frame)
            sending = False
        await asyncio.sleep(0.5)  # the last input's step runs and its output reaches the relay
        assert await relay.close()
    finally:
        await cell.close()
    n = len(frames)
    assert [d[1] for d in delivered] == list(range(n)) and [d[0] for d in delivered] == list(range(n))
    assert all(input_seq < frames_in for _, input_seq, frames_in, _ in delivered), delivered
    in_send = sum(in_send for *_, in_send in delivered)
    assert in_send >= n - 2 if early else in_send == 0, delivered
    assert relay.frames_out == n


async def test_no_serving_cell_means_503_and_a_typed_open_failure():
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))  # nothing listens there
    gw = GatewayProcess(dead, args=["--poll-interval", "0.2"])
    # Not gw.start(): that waits for a healthy gateway, and this one must never become healthy.
    gw.proc = subprocess.Popen(gw.cmd, cwd=REPO_ROOT, env=gw.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while (h := gw.health()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert h is not None and h[0] == 503 and h[1]["serving_cells"] == 0
        rt = await RT.connect(gw.ws_url + "&model=personaplex")  # autostart: the session opens at connect
        ev = await rt.recv(30)
        assert ev["type"] == "error"
        assert (ev["error"]["type"], ev["error"]["code"]) == ("server_error", "runtime_open_failed")
        with pytest.raises(ConnectionClosed):
            await rt.recv(30)
    finally:
        gw.stop()


async def test_a_client_that_never_reads_is_cut_off_and_others_go_on(stack):
    # A gateway with a small per-session output bound, on the same cells.
    small = ["--output-queue-events", "8", "--send-buffer-bytes", "8192"]
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + small).start()
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((gw.host, gw.port))
        stuck = RT(await connect(gw.ws_url, sock=sock, max_queue=1))
        assert (await stuck.open())["type"] == "session.created"
        good = await RT.connect(gw.ws_url)
        first = await good.open()
        assert first["type"] == "session.created", first

        async def cutoffs() -> float:
            _, body, _ = http_get(gw.http_url + "/metrics")
            return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                       if line.startswith("gateway_slow_client_cutoffs_total"))

        x = tone(1)
        deadline = time.monotonic() + 120
        while await cutoffs() < 1 and time.monotonic() < deadline:
            for rt in (stuck, good):
                try:
                    await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x)})
                except ConnectionClosed:
                    pass
            await drain(good, 0.08)  # the good client reads; the stuck one never does
        assert await cutoffs() == 1
        n = len(good.of("response.output_audio.delta"))
        await paced(good, tone(4))
        await good.wait_frames(n + 3)
        await good.close()
    finally:
        gw.stop()


async def test_talker_refusals_reach_the_client_as_typed_codes(stack):
    """Settings only the talker can judge (a well-formed but unbundled voice, a persona longer than
    the model's window) come back typed through the stage's `error-kind`, not guessed from text."""
    long_persona = " ".join(["You are patient and kind."] * 120)  # < 4000 chars, > 256 frames of tokens
    for session, code in (({"voice": "NOPE0.pt"}, "invalid_voice"),
                          ({"instructions": long_persona}, "invalid_instructions")):
        rt = await RT.connect(stack.gateway.ws_url)
        ev = await rt.open(**session)
        assert ev["type"] == "error" and ev["error"]["code"] == code, (session.keys(), ev)
        assert ev["error"]["type"] == "invalid_request_error"
        await rt.ws.close()
    # Nothing was half-opened: a good session still gets in.
    rt = await RT.connect(stack.gateway.ws_url)
    assert (await rt.open(instructions="You are fine."))["type"] == "session.created"
    await rt.close()


async def test_cancel_and_truncate_keep_the_session_and_the_lifecycle_is_ga(stack):
    """response.cancel and conversation.item.truncate end the current response (queued audio dropped)
    and the next one starts at once on the same session; commit and response.create are silent
    no-ops. Every event validates against the openai typed models (RT checks each)."""
    rt = await RT.connect(stack.gateway.ws_url)
    await rt.open(voice="marin", tools=[], tool_choice="auto", max_output_tokens="inf",
                  audio={"input": {"turn_detection": {"type": "semantic_vad"}, "transcription": {"model": "whisper-1"}},
                         "output": {"speed": 1.0}})
    updated = await rt.until("session.updated")
    assert updated["session"]["voice"] == "NATF2.pt" and updated["session"]["audio"]["input"]["transcription"] is None
    assert set(updated["session"]["not_in_effect"]) == {"audio.input.turn_detection", "audio.input.transcription",
                                                        "max_output_tokens", "tool_choice"}
    feed = asyncio.create_task(paced(rt, tone(40)))
    try:
        await rt.wait_frames(3)
        first = rt.of("response.created")[0]["response"]["id"]
        types = [e["type"] for e in rt.events]
        order = ("response.created", "conversation.item.added", "response.output_item.added",
                 "response.content_part.added", "response.output_audio.delta")
        assert [types.index(t) for t in order] == sorted(types.index(t) for t in order)
        await rt.send({"type": "input_audio_buffer.commit"})
        await rt.send({"type": "response.create", "response": {}})
        await rt.send({"type": "response.cancel"})
        done = await rt.until("response.done")
        assert done["response"]["id"] == first and done["response"]["status"] == "cancelled"
        assert done["response"]["output"][0]["status"] == "incomplete"
        second = (await rt.until("response.created"))["response"]["id"]
        frames = rt.frames
        await rt.wait_frames(frames + 2)
        deltas = rt.of("response.output_audio.delta")[frames:]
        assert deltas and {d["response_id"] for d in deltas} == {second}  # audio continues, in the new response
        # The client heard 80 ms of the second response's item: truncated there, and a third response starts.
        item = deltas[0]["item_id"]
        await rt.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 80})
        truncated = await rt.until("conversation.item.truncated")
        assert (truncated["item_id"], truncated["audio_end_ms"]) == (item, 80)
        done = await rt.until("response.done")
        assert done["response"]["id"] == second and done["response"]["status"] == "cancelled"
        await rt.until("response.created")
        await rt.wait_frames(rt.frames + 2)
    finally:
        await feed
    done, closed = await rt.close()
    assert done["response"]["status"] == "completed" and closed["cleanup_confirmed"] is True
    assert not rt.of("error")
    # Every response's events come in the GA order, and no delta is outside its response.
    open_ids: set[str] = set()
    for e in rt.events:
        if e["type"] == "response.created":
            open_ids.add(e["response"]["id"])
        elif e["type"] == "response.done":
            open_ids.remove(e["response"]["id"])
        elif e["type"] in ("response.output_audio.delta", "response.output_audio_transcript.delta"):
            assert open_ids == {e["response_id"]}
    assert not open_ids


async def test_a_vllm_omni_driver_names_its_session_in_session_update(stack):
    """vLLM-Omni's lifecycle driver sends session_id in its first session.update and waits for
    session.created: the session opens under that name."""
    rt = await RT.connect(stack.gateway.ws_url)
    created = await rt.open(session_id="omni-driver-1", model="personaplex")
    assert created["type"] == "session.created" and created["session"]["id"] == "omni-driver-1"
    _, closed = await rt.close()
    assert closed["session_id"] == "omni-driver-1"


async def test_mid_call_persona_update_retrieve_and_one_interruption_in_two_events(stack):
    """After audio: a session.update with another persona and voice is answered session.updated (the
    primed ones stay, the change listed under not_in_effect), never an error, and audio goes on;
    conversation.item.retrieve answers the item, or OpenAI's typed error for an unknown one; a
    truncate followed by an id-less cancel (the Agents SDK's interrupt) ends one response, not two."""
    rt = await RT.connect(stack.gateway.ws_url)
    await rt.open(voice="NATF2.pt", instructions="You are a pirate.")
    await rt.until("session.updated")
    feed = asyncio.create_task(paced(rt, tone(60)))
    try:
        await rt.wait_frames(3)
        await rt.send({"type": "session.update", "session": {"type": "realtime", "instructions": "You are a robot.",
                                                             "audio": {"output": {"voice": "NATM1.pt"}}}})
        updated = (await rt.until("session.updated"))["session"]
        assert (updated["instructions"], updated["voice"]) == ("You are a pirate.", "NATF2.pt")
        assert {"instructions", "voice"} <= set(updated["not_in_effect"]), updated["not_in_effect"]
        frames = await rt.wait_frames(rt.frames + 3)
        item = rt.of("response.output_audio.delta")[-1]["item_id"]
        await rt.send({"type": "conversation.item.retrieve", "item_id": item})
        retrieved = await rt.until("conversation.item.retrieved")
        assert retrieved["item"]["id"] == item and retrieved["item"]["role"] == "assistant"
        await rt.send({"type": "conversation.item.retrieve", "item_id": "item_nope", "event_id": "ev_r"})
        while (error := await rt.recv())["type"] != "error":
            pass
        error = error["error"]
        assert (error["type"], error["code"], error["param"], error["event_id"]) == (
            "invalid_request_error", "item_retrieve_invalid_item_id", "item_id", "ev_r")
        # One interruption, two events, sent back to back.
        first = rt.of("response.created")[0]["response"]["id"]
        await rt.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
                       "audio_end_ms": 80})
        await rt.send({"type": "response.cancel"})
        await rt.until("conversation.item.truncated")
        second = (await rt.until("response.created"))["response"]["id"]
        await rt.wait_frames(rt.frames + 6)
        done = rt.of("response.done")
        assert [(d["response"]["id"], d["response"]["status"]) for d in done] == [(first, "cancelled")], done
        assert second in {d["response_id"] for d in rt.of("response.output_audio.delta")[frames:]}
    finally:
        await feed
    await rt.close()
    assert [e["error"]["code"] for e in rt.of("error")] == ["item_retrieve_invalid_item_id"]


async def test_the_log_names_the_client_a_trusted_proxy_forwarded_for(stack):
    """X-Forwarded-For names the client in the gateway's log only when the peer is a --trusted-proxies
    address; from anyone else the header is ignored and the peer is logged."""
    forged = {"X-Forwarded-For": "198.51.100.7"}
    proxied = GatewayProcess(stack.cell_procs[0].spec, args=[*GATEWAY_ARGS, "--trusted-proxies", "127.0.0.0/8"])
    proxied.start()
    try:
        for gw in (proxied, stack.gateway):
            rt = await RT.connect(gw.ws_url, headers=forged)
            await rt.open()
            await rt.close()
        assert await eventually(lambda: "from 198.51.100.7" in proxied.log_tail(20_000), 10), proxied.log_tail()
    finally:
        proxied.stop()
    lines = [line for line in stack.gateway.log_tail(200_000).splitlines() if "/v1/realtime sess" in line]
    assert lines and lines[-1].endswith("from 127.0.0.1"), lines[-3:]


@pytest.mark.drains_shared_stack
async def test_zz_draining_cell_gets_no_new_session(stack):
    """Last in the session (conftest orders it so): it drains the shared cell's encoder (for good)."""
    from duplex.v1 import common_pb2, encoder_pb2_grpc

    with grpc.insecure_channel(stack.cell_procs[0].encoder.address) as ch:
        encoder_pb2_grpc.EncoderStub(ch).Drain(common_pb2.DrainRequest(deadline_s=0), timeout=10,
                                               metadata=(("authorization", f"Bearer {stack.admin_token}"),))
    await asyncio.sleep(1.0)  # the next capacity poll sees `draining`
    status, body, _ = http_get(stack.gateway.http_url + "/health")
    health = json.loads(body)
    assert status == 503 and health["status"] == "draining" and health["cell_detail"][0]["draining"] is True
    assert http_get(stack.gateway.http_url + "/health/live")[0] == 200  # alive, only not ready
    rt = await RT.connect(stack.gateway.ws_url)
    ev = await rt.open()
    # A retry-later refusal that says why, not resource_exhausted (which invites retrying at once).
    assert ev["type"] == "error" and ev["error"]["code"] == "server_shutting_down", ev
    with pytest.raises(ConnectionClosed) as closed:
        await rt.recv(30)
    assert closed.value.rcvd.code == 1013
    assert stage_capacity(stack, "encoder").active_streams == 0
