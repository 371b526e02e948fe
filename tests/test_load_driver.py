"""The load driver against controlled Realtime servers (real `websockets` servers on 127.0.0.1).

Each fake server speaks the duplex wire correctly except for one injected fault, so each test
shows the driver catches exactly that fault. The servers run on their own thread and event loop,
so the driver under test runs exactly as from the command line (`main(argv)`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from tools.load_driver.__main__ import main
from tools.load_driver.config import FRAME_PERIOD_S, FRAME_SAMPLES, DriverConfig
from tools.load_driver.input_audio import append_event, input_signal, synth_speech
from tools.load_driver.load import RESYNC_S, run_load
from tools.load_driver.metrics import continuity_stats, distribution, linear_percentile, timing_metrics
from tools.load_driver.refusal import FALLBACK_DELAY_S, event_refusal, http_refusal
from tools.load_driver.traffic import call_length_s, hangup_s, make_plan, next_dial_s, send_phase_s
from tools.load_driver.validate import PacketError, decode_audio_packet

REPO = Path(__file__).resolve().parents[1]
CAPABILITIES = {
    "implementation_level": "model_native_duplex",
    "chunk_period_ms": 80,
    "supports_multi_session": True,
    "supports_multi_session_same_replica": True,
    "supports_barge_in": False,
    "supports_session_resume": False,
    "input_modes": ["append_audio_chunk"],
}


# -- a controlled Realtime duplex server ------------------------------------------------------


@dataclass
class Behavior:
    capacity: int = 2
    fault: str | None = None  # see FakeServer._packet / _handle
    fault_at: int = 2  # output frame index where a packet fault is injected
    delay_frames: int = 1  # output lags input by this many frames (the model's delay)
    release_delay_s: float = 0.0  # a slot frees this long after its connection ends
    stall_s: float = 0.0  # output pauses this long before output frame fault_at (then catches up)
    retry_after_s: float | None = None  # a full server's refusal names this delay (error.retry_after_s)
    http_busy: int = 0  # the first this many handshakes get HTTP 503 with Retry-After: 1


@dataclass
class FakeServer:
    behavior: Behavior
    url: str = ""
    live: int = 0
    connections: int = 0
    closed_connections: int = 0
    appends: list[int] = field(default_factory=list)
    refused: int = 0
    autostarted: int = 0  # connections opened with ?model= (the SDK open), before any client event
    busy_handshakes: int = 0
    _next_id: int = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _packet(self, rid: str, index: int, input_frame: np.ndarray) -> list[dict]:
        b, fault = self.behavior, self.behavior.fault if index == self.behavior.fault_at else None
        # Output: the input frame at half level plus a quiet tone, so it is never silent.
        t = (index * FRAME_SAMPLES + np.arange(FRAME_SAMPLES)) / 24_000
        pcm = np.clip(0.5 * input_frame + 0.1 * np.sin(2 * np.pi * 330 * t), -1, 1)
        if b.fault == "silent":
            pcm = np.zeros(FRAME_SAMPLES)
        raw = (pcm * 32767).astype("<i2").tobytes()
        event = {"type": "response.output_audio.delta", "response_id": rid, "item_id": f"item-{rid}",
                 "output_index": 0, "content_index": 0, "sample_rate_hz": 24_000,
                 "delta": base64.b64encode(raw).decode()}
        if b.fault == "legacy":
            event["type"] = "response.audio.delta"
        if fault == "bad_base64":
            event["delta"] = event["delta"][:-4] + "!!!!"
        elif fault == "misaligned":
            event["delta"] = base64.b64encode(raw[:3]).decode()
        elif fault == "wrong_rate":
            event["sample_rate_hz"] = 16_000
        elif fault == "second_response" and index >= b.fault_at:
            event["response_id"] = rid + "-b"
        text = {"type": "response.output_audio_transcript.delta", "response_id": rid, "delta": f" w{index}"}
        if fault in ("error_event", "kill"):
            return [{"type": "error", "error": {"type": "server_error", "code": "runtime_append_failed",
                                                "message": "injected"}}]
        return [] if b.fault == "no_audio" else [event, text]

    def process_request(self, connection, request):
        """HTTP 503 with Retry-After for the first `http_busy` handshakes (a full front door)."""
        if self.busy_handshakes < self.behavior.http_busy:
            self.busy_handshakes += 1
            response = connection.respond(503, "busy\n")
            response.headers["Retry-After"] = "1"
            return response
        return None

    async def _handle(self, ws) -> None:
        self.connections += 1
        admitted = False
        # The SDK open (?model= without autostart=0): the server opens a session with its defaults at once,
        # and the client's session.update then changes it (as the gateway does).
        autostart = "model=" in ws.request.path and "autostart=0" not in ws.request.path
        try:
            update = None if autostart else json.loads(await ws.recv())
            assert update is None or update["type"] == "session.update"
            if self.live >= self.behavior.capacity:
                self.refused += 1
                body = {"type": "rate_limit_error", "code": "resource_exhausted", "message": "no free session slot"}
                if self.behavior.retry_after_s is not None:
                    body["retry_after_s"] = self.behavior.retry_after_s
                await ws.send(json.dumps({"type": "error", "error": body}))
                await ws.close(1013, "try again later")
                return
            self.live += 1
            admitted = True
            self.autostarted += autostart
            sid = f"sess-{self._new_id()}"
            rid = "resp-shared" if self.behavior.fault == "shared_rid" else f"resp-{sid}"
            instructions = "defaults" if autostart else update["session"]["instructions"]
            session = {"object": "realtime.session", "id": sid, "instructions": instructions,
                       "capabilities": CAPABILITIES}
            for kind in ("session.created", "session.updated"):
                await ws.send(json.dumps({"type": kind, "session": session}))
            await ws.send(json.dumps({"type": "response.created", "response": {"id": rid}}))
            pending = np.zeros(0, np.float32)
            poisoned = False
            inputs: list[np.ndarray] = []
            self.appends.append(0)
            slot = len(self.appends) - 1
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "session.update":
                    session = {**session, "instructions": event["session"]["instructions"]}
                    await ws.send(json.dumps({"type": "session.updated", "session": session}))
                elif event["type"] == "input_audio_buffer.append":
                    try:
                        raw = base64.b64decode(event["audio"], validate=True)
                    except ValueError:  # one typed error; the session goes on
                        await ws.send(json.dumps({"type": "error", "error": {
                            "type": "invalid_request_error", "code": "bad_audio", "message": "invalid base64"}}))
                        poisoned = self.behavior.fault == "poison"
                        continue
                    if poisoned:  # broken server: a bad append poisons every later one
                        await ws.send(json.dumps({"type": "error", "error": {
                            "type": "server_error", "code": "runtime_append_failed", "message": "poisoned"}}))
                        continue
                    self.appends[slot] += 1
                    pending = np.concatenate([pending, np.frombuffer(raw, "<f4")])
                    while pending.size >= FRAME_SAMPLES:
                        inputs.append(pending[:FRAME_SAMPLES])
                        pending = pending[FRAME_SAMPLES:]
                        out = len(inputs) - 1 - self.behavior.delay_frames
                        if out == self.behavior.fault_at and self.behavior.stall_s:
                            await asyncio.sleep(self.behavior.stall_s)
                        if out == self.behavior.fault_at and self.behavior.fault == "drop":
                            await ws.close(1011, "stage failure")  # the server ends it: the caller did not ask
                            return
                        if out >= 0:
                            for reply in self._packet(rid, out, inputs[out]):
                                await ws.send(json.dumps(reply))
                elif event["type"] == "session.close":
                    if self.behavior.fault == "no_close_ack":
                        continue  # never acknowledges: the driver's cleanup must be bounded
                    await ws.send(json.dumps({"type": "response.done",
                                              "response": {"id": rid, "status": "completed"}}))
                    await ws.send(json.dumps({"type": "session.closed", "session_id": sid}))
        except ConnectionClosed:
            pass
        finally:
            self.closed_connections += 1
            if admitted:
                await asyncio.sleep(self.behavior.release_delay_s)
                self.live -= 1


@contextlib.contextmanager
def fake_server(behavior: Behavior | None = None):
    """Run a FakeServer on 127.0.0.1 on its own thread and event loop."""
    server = FakeServer(behavior or Behavior())
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: list[asyncio.Future] = []

    async def serve_forever() -> None:
        async with serve(server._handle, "127.0.0.1", 0, process_request=server.process_request) as ws_server:
            port = ws_server.sockets[0].getsockname()[1]
            server.url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1"
            stop.append(loop.create_future())
            ready.set()
            await stop[0]

    thread = threading.Thread(target=loop.run_until_complete, args=(serve_forever(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(stop[0].set_result, None)
        thread.join(10)


def eventually(condition, timeout_s: float = 3.0) -> bool:
    """The server thread sees a client's close a moment after the client returns."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def load_args(server: FakeServer, out: Path, *extra: str, sessions: int = 2, frames: int = 6) -> list[str]:
    return ["--url", server.url, "--sessions", str(sessions), "--load-frames", str(frames), "--drain-s", "0.25",
            "--output-dir", str(out), "--cleanup-timeout-s", "1", "--timeout-s", "10", "--no-progress",
            "--min-voiced-frames", "2", *extra]


def run_driver(server: FakeServer, tmp_path: Path, *extra: str, rerun_invalid: bool = True, **kw) -> tuple[int, dict]:
    """`main` on tmp_path/run. A run the client itself invalidated (this shared machine stalled the
    driver past its 40 ms lateness bound) says nothing about the server: it is rerun, at most twice."""
    out = tmp_path / "run"
    for _ in range(3 if rerun_invalid else 1):
        shutil.rmtree(out, ignore_errors=True)
        code = main(load_args(server, out, *extra, **kw))
        result = json.loads((out / "load-result.json").read_text())
        if result["verdict"] != "INVALID":
            break
    return code, result


# -- load mode against correct and faulty servers ---------------------------------------------


def test_load_mode_passes_against_a_correct_server(tmp_path, capsys):
    with fake_server() as server:
        code, result = run_driver(server, tmp_path, "--server-revision", "abc123", "--server-hardware", "cpu",
                                  "--plot")
    assert code == 0, result
    assert result["ok"] and result["passed_sessions"] == 2 and result["requested_sessions"] == 2
    assert result["reported_server"] == {"revision": "abc123", "hardware": "cpu"}
    assert result["shared_response_ids"] == [] and result["client_pacing_warning_sessions"] == []
    assert "?" not in result["url"]
    for row in result["sessions"]:
        assert row["input_frames"] == 6 and row["output_frames"] == 5 and row["frame_deficit"] == 1
        assert row["frame_coverage_ratio"] == pytest.approx(5 / 6)
        assert row["audio_chunks"] == 5 and row["voiced_frames"] == 5 and row["silent_frames"] == 0
        assert row["audio_rms"] > 0.01 and row["text_deltas"] == 5
        assert len(row["response_ids"]) == 1 and row["closed"]
        assert row["client_audio_packet_interval_ms"]["count"] == 4
        assert 0 < row["client_first_audio_after_stream_start_ms"] < 1000
        # 6 frames paced over ~0.4 s yield 0.4 s of audio: the client RTF is ~1.
        assert 0.7 < row["client_stream_rtf"] < 1.6
        assert row["audio_continuity_ok"] is True and row["audio_underrun_event_count"] is not None
        # Per-session timelines on the monotonic clock, on one shared schedule, session i of 2 offset i/2 period.
        sends = row["input_timeline"]
        assert [s["frame_index"] for s in sends] == list(range(6))
        assert row["phase_offset_s"] == pytest.approx(row["index"] * FRAME_PERIOD_S / 2)
        assert sends[0]["planned_at_s"] == result["stream_start_s"] + row["phase_offset_s"]
        assert all(s["send_started_at_s"] >= s["planned_at_s"] for s in sends)
        assert len(row["audio_packet_timeline"]) == 5 and "delta" not in json.dumps(row["audio_packet_timeline"])
    a, b = result["sessions"]
    assert a["response_ids"] != b["response_ids"] and a["session_id"] != b["session_id"]
    assert (tmp_path / "run" / "load-timeline.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "PASS: 2/2 sessions passed" in table


def test_legacy_audio_event_name_is_real_audio(tmp_path):
    with fake_server(Behavior(fault="legacy")) as server:
        code, result = run_driver(server, tmp_path, sessions=1)
    assert code == 0 and result["sessions"][0]["output_frames"] == 5


@pytest.mark.parametrize(
    "fault, code",
    [("bad_base64", "invalid_audio_base64"), ("misaligned", "unaligned_pcm16_packet"),
     ("wrong_rate", "invalid_audio_sample_rate")],
)
def test_one_malformed_packet_fails_the_session(tmp_path, fault, code):
    with fake_server(Behavior(fault=fault)) as server:
        exit_code, result = run_driver(server, tmp_path, sessions=1)
    row = result["sessions"][0]
    assert exit_code == 1 and not result["ok"] and not row["ok"]
    assert [p["code"] for p in row["invalid_audio_packets"]] == [code]
    assert row["invalid_audio_packets"][0]["event_index"] >= 0
    # The rejected packet adds neither samples nor intervals: 4 of the 5 packets remain.
    assert row["audio_chunks"] == 4 and row["client_audio_packet_interval_ms"]["count"] == 3
    assert row["closed"]  # cleanup still ran


def test_shared_response_ids_fail_every_holder(tmp_path):
    with fake_server(Behavior(fault="shared_rid")) as server:
        code, result = run_driver(server, tmp_path)
    assert code == 1 and result["shared_response_ids"] == ["resp-shared"]
    assert [row["ok"] for row in result["sessions"]] == [False, False]
    assert all("shared" in row["error"] for row in result["sessions"])


def test_two_response_ids_in_one_session_fail(tmp_path):
    with fake_server(Behavior(fault="second_response")) as server:
        code, result = run_driver(server, tmp_path, sessions=1)
    assert code == 1 and result["sessions"][0]["acceptance_check"] == "response_identity"


def test_missing_audio_gives_missing_metrics_not_zero(tmp_path):
    with fake_server(Behavior(fault="no_audio")) as server:
        code, result = run_driver(server, tmp_path, sessions=1)
    row = result["sessions"][0]
    assert code == 1 and row["acceptance_check"] == "pcm16_output"
    for key in ("client_first_audio_after_stream_start_ms", "client_stream_rtf", "audio_underrun_s",
                "audio_underrun_event_count", "audio_continuity_ok", "frame_deficit", "output_frames",
                "audio_rms", "frame_coverage_ratio"):
        assert row[key] is None, key
    assert row["client_audio_packet_interval_ms"] == {"count": 0, "median": None, "p99": None, "max": None,
                                                       "argmax_index": None}
    assert row["audio_chunks"] == 0 and row["input_frames"] == 6


def test_silent_audio_fails_with_stats_kept(tmp_path):
    with fake_server(Behavior(fault="silent")) as server:
        code, result = run_driver(server, tmp_path, sessions=1)
    row = result["sessions"][0]
    assert code == 1 and row["acceptance_check"] == "audio_rms"
    assert row["audio_rms"] == 0.0 and row["audio_chunks"] == 5


def test_server_error_event_fails_the_session_and_is_reported(tmp_path):
    with fake_server(Behavior(fault="error_event")) as server:
        code, result = run_driver(server, tmp_path, sessions=1)
    row = result["sessions"][0]
    assert code == 1 and row["server_error_codes"] == ["runtime_append_failed"]
    assert row["error"].startswith("stream: server error event") and row["closed"]


def test_unacknowledged_close_is_a_bounded_cleanup_failure(tmp_path):
    with fake_server(Behavior(fault="no_close_ack")) as server:
        started = time.monotonic()
        code, result = run_driver(server, tmp_path, sessions=2)
        elapsed = time.monotonic() - started
        assert eventually(lambda: server.live == 0)  # the driver still closed the transports
    # 0.5 s of streaming and drain, then at most one 1 s cleanup budget (sessions close in parallel).
    assert code == 1 and elapsed < 3.5, elapsed
    for row in result["sessions"]:
        assert row["error"] == "cleanup: TimeoutError" and not row["closed"]
        assert row["output_frames"] == 5  # audio validation itself passed


def test_refused_session_stays_in_the_denominator(tmp_path):
    with fake_server(Behavior(capacity=1)) as server:
        code, result = run_driver(server, tmp_path, sessions=2)
    assert code == 1 and not result["ok"]
    assert result["requested_sessions"] == 2 and result["admitted_sessions"] == 1 and result["passed_sessions"] == 1
    refused = [row for row in result["sessions"] if not row["admitted"]]
    assert len(refused) == 1 and refused[0]["error"] == "admission: rejected at admission (resource_exhausted)"
    assert refused[0]["client_stream_rtf"] is None and refused[0]["input_frames"] == 0
    assert result["failed_sessions"] == [refused[0]["index"]]


def test_existing_result_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "load-result.json").write_text("previous evidence")
    with fake_server() as server:
        code = main(load_args(server, out))
        assert server.connections == 0  # refused before connecting
    assert code == 2 and (out / "load-result.json").read_text() == "previous evidence"
    assert "refusing to overwrite" in capsys.readouterr().err


def test_load_frames_bound_the_input_and_the_wav_is_not_looped(tmp_path):
    wav = tmp_path / "in.wav"
    import wave

    with wave.open(str(wav), "wb") as w:  # 16 kHz stereo, 0.2 s: resampled to 24 kHz mono = 2.5 frames
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(16_000)
        tone = (8000 * np.sin(np.arange(3200) / 10)).astype("<i2")
        w.writeframes(np.repeat(tone, 2).tobytes())
    with fake_server(Behavior(delay_frames=0)) as server:
        code, result = run_driver(server, tmp_path, "--input-wav", str(wav), "--min-voiced-frames", "1",
                                  sessions=1, frames=50)
        assert set(server.appends) == {3}
    assert code == 0, result["sessions"][0]["error"]
    assert result["input"]["source"] == "wav" and result["input"]["frames"] == 3
    assert result["sessions"][0]["input_frames"] == 3 and result["sessions"][0]["output_frames"] == 3


def test_bad_options_are_refused_before_connecting(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--sessions", "0", "--no-progress"])
    assert exc.value.code == 2 and "--sessions" in capsys.readouterr().err


# -- pacing -----------------------------------------------------------------------------------


async def test_pacing_after_a_client_stall_never_bursts(tmp_path):
    """The client's event loop freezes for 350 ms mid-stream: the frames after it keep 80 ms
    spacing (no catch-up burst), and the lateness against the shared schedule shows the stall."""
    config = DriverConfig(sessions=1, load_frames=12, drain_s=0.1, cleanup_timeout_s=1, progress=False,
                          min_voiced_frames=1)
    pcm, _ = input_signal(None, 12, seed=0)

    async def stall(server: FakeServer) -> None:
        while not server.appends or server.appends[0] < 3:  # mid-stream
            await asyncio.sleep(0.01)
        time.sleep(0.35)  # blocks the whole loop, like an overloaded client

    with fake_server() as server:
        config = replace(config, url=server.url)
        stall_task = asyncio.create_task(stall(server))
        result = await run_load(config, pcm)
        await stall_task
    row = result["sessions"][0]
    starts = [s[2] for s in _sends(row)]
    gaps = np.diff(starts)
    assert len(starts) == 12
    assert gaps.min() >= FRAME_PERIOD_S - RESYNC_S - 0.005, gaps  # never a burst
    assert starts[-1] - starts[0] >= 11 * FRAME_PERIOD_S + 0.25  # the stall was not caught up
    lateness = row["client_send_lateness_ms"]
    assert lateness["max"] >= 250 and lateness["p99"] > 80 and row["client_pacing_warning"] is True


async def test_pacing_without_a_stall_follows_the_absolute_schedule():
    pcm, _ = input_signal(None, 10, seed=0)
    with fake_server() as server:
        config = DriverConfig(url=server.url, sessions=2, load_frames=10, drain_s=0.1, cleanup_timeout_s=1,
                              progress=False, min_voiced_frames=1)
        result = await run_load(config, pcm)
    for row in result["sessions"]:
        planned = [s[0] for s in _sends(row)]
        assert np.allclose(np.diff(planned), FRAME_PERIOD_S)
        # One shared start for every session, each offset by its share of the period.
        assert planned[0] == result["stream_start_s"] + row["index"] * FRAME_PERIOD_S / 2
        assert all(started >= plan for plan, _, started, _ in _sends(row))  # never ahead of the schedule
        assert row["client_send_lateness_ms"]["count"] == 10


def _sends(row: dict) -> list[tuple[float, float, float, float]]:
    return [(s["planned_at_s"], s["target_at_s"], s["send_started_at_s"], s["send_completed_at_s"])
            for s in row["input_timeline"]]


# -- cancellation -----------------------------------------------------------------------------


async def test_cancellation_closes_transports_and_propagates():
    pcm, _ = input_signal(None, 200, seed=0)
    with fake_server() as server:
        config = DriverConfig(url=server.url, sessions=2, load_frames=200, cleanup_timeout_s=1, progress=False)
        task = asyncio.create_task(run_load(config, pcm))
        for _ in range(500):  # both admitted and streaming
            if server.live == 2 and min(server.appends, default=0) >= 2:
                break
            await asyncio.sleep(0.02)
        assert server.live == 2
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 5  # bounded by the 1 s cleanup budget, not the 180 s timeout
        for _ in range(150):
            if server.live == 0:
                break
            await asyncio.sleep(0.02)
        assert server.live == 0 and server.closed_connections == 2


@pytest.mark.parametrize("procs", ["1", "2"])
def test_ctrl_c_on_the_command_line_exits_130_and_closes(tmp_path, procs):
    """SIGINT to the driver alone (not its process group): with --procs 2 it interrupts its children."""
    with fake_server() as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.load_driver", "--procs", procs,
             *load_args(server, tmp_path / "run", frames=500)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            deadline = time.monotonic() + 20
            while server.live < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.live == 2
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert eventually(lambda: server.live == 0)
    assert proc.returncode == 130, err
    assert "interrupted" in err and not (tmp_path / "run" / "load-result.json").exists()


# -- lifecycle mode ---------------------------------------------------------------------------


def lifecycle_args(server: FakeServer, *extra: str) -> list[str]:
    return ["--url", server.url, "--lifecycle-frames", "5", "--drain-s", "0.1", "--cleanup-timeout-s", "1",
            "--timeout-s", "5", "--no-progress", "--min-voiced-frames", "2", *extra]


def test_lifecycle_passes_against_a_correct_two_slot_server(tmp_path, capsys):
    out = tmp_path / "life"
    with fake_server() as server:
        code = main(lifecycle_args(server, "--output-dir", str(out)))
        assert server.connections == 4 and eventually(lambda: server.live == 0)  # 2 + refused + replacement
    result = json.loads((out / "lifecycle-result.json").read_text())
    assert code == 0, result["error"]
    assert result["overflow_error"] == {"type": "rate_limit_error", "code": "resource_exhausted"}
    for check in ("admission_limit", "persona_echo", "distinct_response_ids", "fresh_session_id",
                  "bad_append_typed_error",
                  "survivor_response_stable", "fresh_response_id", "text_deltas", "response_done"):
        assert check in result["passed_checks"]
    sessions = result["sessions"]
    assert sessions["secondary"]["input_frames"] == 10 and sessions["replacement"]["input_frames"] == 5
    assert sessions["replacement"]["response_ids"] != sessions["secondary"]["response_ids"]
    assert "lifecycle: PASS" in capsys.readouterr().out


def test_lifecycle_retries_a_slot_still_being_released(tmp_path):
    out = tmp_path / "life"
    with fake_server(Behavior(release_delay_s=0.5)) as server:
        code = main(lifecycle_args(server, "--output-dir", str(out)))
    result = json.loads((out / "lifecycle-result.json").read_text())
    assert code == 0 and result["ok"], result["error"]
    assert result["replacement_admission_retries"] >= 1


def test_lifecycle_gives_up_on_a_slot_never_released(tmp_path):
    out = tmp_path / "life"
    with fake_server(Behavior(release_delay_s=3.0)) as server:  # beyond the 1 s cleanup budget
        code = main(lifecycle_args(server, "--output-dir", str(out)))
    result = json.loads((out / "lifecycle-result.json").read_text())
    assert code == 1 and result["failed_check"] == "admission" and "resource_exhausted" in result["error"]


@pytest.mark.parametrize(
    "behavior, failed_check",
    [(Behavior(capacity=3), "admission_limit"), (Behavior(fault="silent"), "audio_audio_rms"),
     (Behavior(fault="shared_rid"), "distinct_response_ids"), (Behavior(fault="misaligned"), "audio_packets"),
     (Behavior(fault="poison"), "protocol")],
)
def test_lifecycle_fails_on_a_broken_contract(behavior, failed_check, tmp_path):
    out = tmp_path / "life"
    with fake_server(behavior) as server:
        code = main(lifecycle_args(server, "--output-dir", str(out)))
        assert eventually(lambda: server.live == 0)  # every opened session was closed after the failure
    result = json.loads((out / "lifecycle-result.json").read_text())
    assert code == 1 and result["failed_check"] == failed_check, result


# -- definitions ------------------------------------------------------------------------------


def test_linear_p99_interpolates_between_ranks():
    values = [0.0] * 99 + [100.0]
    # Position 0.99 * 99 = 98.01: 1% of the way from 0 to 100. Nearest-rank would say 0.
    assert linear_percentile(values, 99) == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100, 1001):
        sample = list(rng.exponential(size=n))
        assert linear_percentile(sample, 99) == pytest.approx(float(np.quantile(sample, 0.99)))
        assert linear_percentile(sample, 50) == pytest.approx(float(np.median(sample)))


def test_interval_index_is_the_first_maximal_interval():
    # Packets at 0, 80, 300, 380, 600 ms: intervals 80, 220, 80, 220. Interval 0 ends at packet 1.
    times = [0.0, 0.08, 0.30, 0.38, 0.60]
    metrics = timing_metrics([(0.0, 0.0, 0.0, 0.0)], times, [3840] * 5)
    ivl = metrics["client_audio_packet_interval_ms"]
    assert ivl["argmax_index"] == 1 and ivl["max"] == pytest.approx(220) and ivl["count"] == 4
    assert ivl["median"] == pytest.approx(150)
    assert distribution([3, 9, 9, 1])["argmax_index"] == 1


def test_first_audio_rtf_and_lateness_definitions():
    # Sends planned at 1.00 and 1.08, started 1.01 and 1.07 (early clips to 0 lateness).
    sends = [(1.00, 1.00, 1.01, 1.015), (1.08, 1.08, 1.07, 1.075)]
    metrics = timing_metrics(sends, [1.31, 1.41], [3840, 3840])  # 2 x 80 ms of PCM16
    assert metrics["client_first_audio_after_stream_start_ms"] == pytest.approx(300)
    assert metrics["client_stream_rtf"] == pytest.approx((1.41 - 1.01) / 0.16)
    assert metrics["client_send_lateness_ms"]["max"] == pytest.approx(10)
    assert metrics["client_send_lateness_ms"]["median"] == pytest.approx(5)
    assert metrics["client_pacing_warning"] is False


def test_continuity_uses_a_100ms_underrun_threshold():
    frame = 3840  # bytes of one 80 ms PCM16 frame
    steady = continuity_stats([0.0, 0.08, 0.16], [frame] * 3)
    assert steady.max_underrun_s == 0 and steady.underrun_event_count == 0 and steady.is_continuous
    small = continuity_stats([0.0, 0.17], [frame, frame])  # starved 90 ms
    assert small.underrun_event_count == 1 and small.is_continuous
    gap = continuity_stats([0.0, 0.30, 0.31], [frame] * 3)  # starved 220 ms, then 150 ms
    assert gap.max_underrun_s == pytest.approx(0.22) and gap.underrun_event_count == 2 and not gap.is_continuous


def test_packet_validation_codes():
    ok = {"delta": base64.b64encode(b"\x01\x00\x02\x00").decode(), "sample_rate_hz": 24_000, "response_id": "r"}
    assert decode_audio_packet(ok) == b"\x01\x00\x02\x00"
    assert decode_audio_packet({"delta": ""}) == b""  # an empty delta is legal and adds nothing
    cases = {
        "missing_audio_delta": {**ok, "delta": None},
        "invalid_audio_base64": {**ok, "delta": "AQACAA"},  # missing padding
        "unaligned_pcm16_packet": {**ok, "delta": base64.b64encode(b"\x01\x00\x02").decode()},
        "invalid_audio_sample_rate": {**ok, "sample_rate_hz": 16_000},
        "missing_audio_response_id": {**ok, "response_id": ""},
    }
    for code, event in cases.items():
        with pytest.raises(PacketError) as exc:
            decode_audio_packet(event)
        assert exc.value.code == code
    with pytest.raises(PacketError):  # non-canonical: nonzero padding bits a lenient decoder drops
        decode_audio_packet({**ok, "delta": "AQACAB=="})


def test_synthetic_input_is_deterministic_speech_like_audio():
    a, b = synth_speech(40, seed=3), synth_speech(40, seed=3)
    assert a.dtype == np.float32 and a.size == 40 * FRAME_SAMPLES and np.array_equal(a, b)
    assert not np.array_equal(a, synth_speech(40, seed=4))
    frame_rms = np.sqrt(np.mean(a.reshape(40, FRAME_SAMPLES) ** 2, axis=1))
    assert np.isfinite(a).all() and np.abs(a).max() <= 0.31
    assert (frame_rms > 0.01).sum() >= 10 and (frame_rms < 1e-3).sum() >= 2  # voiced frames and pauses
    power = np.abs(np.fft.rfft(a)) ** 2
    freqs = np.fft.rfftfreq(a.size, 1 / 24_000)
    assert power[(freqs > 80) & (freqs < 4000)].sum() > 0.95 * power.sum()  # energy in the voice band
    event = append_event(a, 39, "pcm16")
    assert len(base64.b64decode(event["audio"])) == 2 * FRAME_SAMPLES and event["audio_end_ms"] == 3200


# -- traffic: the plan ------------------------------------------------------------------------


def traffic_config(**kw) -> DriverConfig:
    base = dict(sessions=4, traffic="arrivals", arrival_rate=2.0, hold_s=20.0, call_mean_s=8.0, call_min_s=2.0,
                settle_s=1.0, redial_gap_s=0.5, traffic_seed=7, progress=False)
    return DriverConfig(**{**base, **kw})


def test_steady_arrivals_are_evenly_spaced_and_the_window_follows_the_last():
    config = traffic_config(arrivals="steady")
    plan = make_plan(config)
    assert plan.first_dial_s == pytest.approx((0.0, 0.5, 1.0, 1.5))
    assert plan.ramp_end_s == pytest.approx(1.5) and plan.end_s == pytest.approx(21.5)
    assert plan.window_s == pytest.approx((2.5, 21.5))


def test_poisson_arrivals_are_seeded_and_keep_the_rate():
    config = traffic_config(sessions=200, arrivals="poisson", arrival_rate=4.0)
    dials = make_plan(config).first_dial_s
    assert dials == make_plan(config).first_dial_s  # every driver process computes the same plan
    assert dials != make_plan(replace(config, traffic_seed=8)).first_dial_s
    gaps = np.diff(dials)
    assert dials[0] == 0.0 and (gaps >= 0).all()
    assert 0.2 < gaps.mean() < 0.3 and gaps.std() > 0.15  # mean 1/4 s, and not evenly spaced


def test_burst_callers_dial_within_the_window():
    config = traffic_config(sessions=50, traffic="burst", burst_window_s=2.0, hold_s=10.0)
    plan = make_plan(config)
    assert all(0.0 <= t <= 2.0 for t in plan.first_dial_s) and max(plan.first_dial_s) > 1.5
    assert plan.window_s == (0.0, 12.0) and plan.end_s == 12.0
    assert next_dial_s(config, plan, 5.0) is None  # one call each


def test_call_lengths_have_the_floor_and_the_mean():
    config = traffic_config(call_mean_s=8.0, call_min_s=2.0)
    lengths = [call_length_s(config, line, call) for line in range(50) for call in range(40)]
    assert min(lengths) >= 2.0 and 7.5 < np.mean(lengths) < 8.5
    assert call_length_s(replace(config, call_mean_s=0.0), 0, 0) is None  # no churn: until the end


def test_a_ramp_call_counts_from_the_ramp_end_and_a_later_one_from_its_first_frame():
    config = traffic_config(arrivals="steady")
    plan = make_plan(config)
    length = call_length_s(config, 0, 0)
    assert hangup_s(config, plan, 0, 0, 0.1) == pytest.approx(min(plan.end_s, plan.ramp_end_s + length))
    later = call_length_s(config, 0, 1)
    assert hangup_s(config, plan, 0, 1, 3.0) == pytest.approx(min(plan.end_s, 3.0 + later))
    assert hangup_s(config, plan, 0, 1, plan.end_s - 0.5) == plan.end_s  # every call ends by the end
    assert next_dial_s(config, plan, 4.0) == pytest.approx(4.5)
    assert next_dial_s(config, plan, plan.end_s - 2.0) is None  # no room left for a call of the floor


def test_send_phases_are_random_per_call_but_seeded():
    config = traffic_config()
    phases = [send_phase_s(config, line, call) for line in range(20) for call in range(5)]
    assert all(0.0 <= p < FRAME_PERIOD_S for p in phases) and len(set(phases)) == len(phases)
    assert phases[0] == send_phase_s(config, 0, 0)
    together = replace(config, traffic="together")
    assert [send_phase_s(together, g, 0) for g in range(4)] == pytest.approx([g * FRAME_PERIOD_S / 4 for g in range(4)])


# -- traffic: refusals ------------------------------------------------------------------------


def test_a_typed_retry_later_before_any_audio_is_a_refusal():
    busy = {"type": "error", "error": {"type": "server_error", "code": "server_busy", "retry_after_s": 2.5}}
    refusal = event_refusal([busy], [1.0], 1013, 1.1)
    assert (refusal.name, refusal.after_created, refusal.retry_after_s, refusal.at_s) == ("error:server_busy",
                                                                                        False, 2.5, 1.0)
    assert refusal.delay_s(30.0) == 2.5 and refusal.delay_s(1.0) == 1.0  # the server's delay, bounded
    created = {"type": "session.created", "session": {}}
    full = {"type": "error", "error": {"type": "rate_limit_error", "code": "resource_exhausted"}}
    late = event_refusal([created, full], [1.0, 2.0], None, None)
    assert late.after_created and late.delay_s(30.0) == FALLBACK_DELAY_S  # no delay given: 1 s
    hinted = {"type": "error", "error": {"type": "server_error", "code": "server_busy",
                                         "message": "the prefill queue is long: retry in 1.5 s"}}
    assert event_refusal([hinted], [1.0], 1013, 1.1).retry_after_s == 1.5  # the stages' hint in the message
    assert event_refusal([created], [1.0], 1013, 3.0).name == "close:1013"
    audio = {"type": "response.output_audio.delta", "delta": ""}
    assert event_refusal([created, audio, full], [1.0, 1.5, 2.0], 1013, 3.0) is None  # it had been served
    other = {"type": "error", "error": {"type": "invalid_request_error", "code": "bad_voice"}}
    assert event_refusal([other], [1.0], 1000, 1.1) is None
    assert http_refusal(503, {"Retry-After": "3"}, 5.0).retry_after_s == 3.0
    assert http_refusal(503, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, 5.0).retry_after_s is None
    assert http_refusal(403, {}, 5.0) is None


# -- traffic: against a server ------------------------------------------------------------------

TRAFFIC_ARGS = ["--drain-s", "0.2", "--cleanup-timeout-s", "1", "--timeout-s", "10", "--no-progress",
                "--min-voiced-frames", "2", "--traffic-seed", "3"]


def run_traffic_driver(server: FakeServer, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    """`main` with the traffic flags; a run the client itself invalidated is rerun, at most twice."""
    out = tmp_path / "run"
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        code = main(["--url", server.url, "--output-dir", str(out), *TRAFFIC_ARGS, *extra])
        result = json.loads((out / "load-result.json").read_text())
        if result["verdict"] != "INVALID":
            break
    return code, result


def test_arrivals_with_the_sdk_open_and_churn(tmp_path):
    """Two lines dialled at 5/s open the SDK way and stream once their own open is done; calls of
    0.5-0.8 s hang up and the lines dial again, so more calls than lines are made, each passing."""
    with fake_server(Behavior(capacity=2)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--sessions", "2", "--traffic", "arrivals", "--open", "sdk", "--arrivals", "steady",
            "--arrival-rate", "5", "--hold-s", "2.5", "--settle-s", "0.3", "--call-mean-s", "0.8",
            "--call-min-s", "0.5", "--redial-gap-s", "0.1")
        assert server.autostarted == server.connections >= 3
    rows = result["sessions"]
    assert code == 0, [(r["status"], r["error"]) for r in rows]
    assert result["traffic"]["pattern"] == "arrivals" and result["traffic"]["open"] == "sdk"
    assert len(rows) >= 3 and {r["line"] for r in rows} == {0, 1} and max(r["call"] for r in rows) >= 1
    assert all(r["status"] == "passed" and r["tries"] == 1 and r["refusals"] == [] for r in rows)
    for row in rows:  # each streamed from its own open, at a random phase
        assert row["stream_start_s"] >= row["connect_at_s"] and row["dialed_at_s"] <= row["connect_at_s"]
        assert row["client_first_audio_after_connect_ms"] > row["client_first_audio_after_stream_start_ms"] > 0
    first = [r for r in rows if r["call"] == 0]
    assert first[1]["dialed_at_s"] - first[0]["dialed_at_s"] == pytest.approx(0.2)
    calls = result["calls"]
    assert calls["status"] == {"passed": len(rows), "failed": 0, "killed": 0, "refused": 0}
    assert calls["first_audio_ms"]["count"] == len(rows) and calls["refusals"]["total"] == 0
    window = result["window"]
    assert window["start_s"] == pytest.approx(result["stream_start_s"] + 0.2 + 0.3)
    assert window["length_s"] == pytest.approx(2.5 - 0.3) and window["sessions"] >= 2
    assert window["frame_latency_ms"]["count"] > 0 and window["session_latency_p50_ms"]["p50"] > 0
    assert result["summary"]["frame_latency_ms"] == window["frame_latency_ms"]  # the verdict reads the window


def test_a_burst_beyond_the_slots_is_refused_then_served(tmp_path):
    """Three callers within 0.2 s on one slot: two get resource_exhausted (before session.created) with the
    server's delay, retry after it, and are served once the calls before them hang up."""
    with fake_server(Behavior(capacity=1, retry_after_s=0.3)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--sessions", "3", "--traffic", "burst", "--burst-window-s", "0.2", "--hold-s", "6",
            "--call-mean-s", "0.5", "--call-min-s", "0.5")
        assert server.refused >= 2
    rows = result["sessions"]
    assert code == 0, [(r["status"], r["error"]) for r in rows]
    assert [r["status"] for r in rows] == ["passed"] * 3
    refused = [r for r in rows if r["refusals"]]
    assert len(refused) >= 2 and all(r["tries"] == len(r["refusals"]) + 1 for r in rows)
    for row in refused:
        assert {f["type"] for f in row["refusals"]} == {"error:resource_exhausted"}
        assert all(not f["after_created"] and f["retry_after_s"] == 0.3 for f in row["refusals"])
        gaps = np.diff([f["at_s"] for f in row["refusals"]] + [row["connect_at_s"]])
        assert (gaps >= 0.3).all()  # each retry waited the delay the server gave
        assert row["time_to_served_ms"] > 300
    calls = result["calls"]
    assert calls["refusals"]["callers_refused"] == len(refused) == calls["refused_callers_served"]
    assert calls["refusals"]["by_type"] == {"error:resource_exhausted": calls["refusals"]["total"]}
    assert calls["all_refused_served_in_time"] and calls["time_to_served_ms"]["count"] == len(refused)


def test_http_503_with_retry_after_is_retried(tmp_path):
    with fake_server(Behavior(http_busy=1)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--sessions", "1", "--traffic", "burst", "--burst-window-s", "0.1", "--hold-s", "2",
            "--call-min-s", "0.5", "--open", "sdk")
    (row,) = result["sessions"]
    assert code == 0 and row["status"] == "passed" and row["tries"] == 2
    assert [(f["type"], f["retry_after_s"]) for f in row["refusals"]] == [("http:503", 1.0)]
    assert row["time_to_served_ms"] >= 1000


def test_a_caller_refused_to_the_end_gives_up(tmp_path):
    with fake_server(Behavior(capacity=0)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--sessions", "1", "--traffic", "burst", "--burst-window-s", "0.1", "--hold-s", "3",
            "--call-min-s", "0.5", "--max-tries", "3")
        assert server.connections == 3
    (row,) = result["sessions"]
    assert code == 1 and row["status"] == "refused" and not row["admitted"] and row["tries"] == 3
    assert "gave up" in row["error"] and result["calls"]["all_refused_served_in_time"] is False


@pytest.mark.parametrize("fault, killed_by", [("kill", "server_error:runtime_append_failed"), ("drop", "close:1011")])
def test_a_session_the_server_ends_is_killed_not_failed(tmp_path, fault, killed_by):
    with fake_server(Behavior(fault=fault)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--sessions", "1", "--traffic", "burst", "--burst-window-s", "0.1", "--hold-s", "2",
            "--call-min-s", "0.5")
    (row,) = result["sessions"]
    assert code == 1 and row["admitted"] and row["status"] == "killed" and row["killed_by"] == killed_by
    assert result["calls"]["status"]["killed"] == 1 and result["calls"]["killed_by"] == {killed_by: 1}
