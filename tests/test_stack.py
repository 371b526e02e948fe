"""`make run` as a user runs it: `python -m tools.run_stack` with two cells, then the command-line
client, frame accounting over many frames, cell routing, and one cell killed mid-session.

The stack runs with a 20 ms talker clock so a few hundred frames fit in a test.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import json
import urllib.request
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest

from duplex.v1 import common_pb2, encoder_pb2_grpc, talker_pb2_grpc
from tests.realtime_client import RT, eventually, pcm16_b64, tone
from tools.procs import REPO_ROOT, free_port

TICK_S = 0.02


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class RunStack:
    """`python -m tools.run_stack` as a subprocess, with the addresses it printed."""

    def __init__(self, checkpoint: Path):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.run_stack", "--checkpoint", str(checkpoint), "--cells", "2", "--sessions",
             "2",
             "--port", str(self.port), "--talker-tick-ms", str(TICK_S * 1000),
             "--gateway-args", "--stall-timeout 30 --open-timeout 120 --cleanup-timeout 20"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self.stages: dict[tuple[int, str], str] = {}  # (cell, stage) -> address
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("run_stack exited:\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"cell (\d+): (encoder|talker|decoder) serving on (\S+)", line)
            if m:
                self.stages[(int(m.group(1)), m.group(2))] = m.group(3)
            if "Ctrl-C stops everything" in line:
                break
        else:
            raise AssertionError("run_stack did not come up:\n" + "".join(self.lines))
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/realtime?duplex=1"

    def pid_of(self, cell: int, stage: str) -> int:
        port = self.stages[(cell, stage)].rsplit(":", 1)[1]
        for pid in _children(self.proc.pid):
            cmd = _cmdline(pid)
            if f"services.{stage} " in cmd and f" --port {port} " in cmd:
                return pid
        raise AssertionError(f"no process for cell {cell} {stage}")

    def capacity(self, cell: int, stage: str):
        stub = {"talker": talker_pb2_grpc.TalkerStub, "encoder": encoder_pb2_grpc.EncoderStub}[stage]
        with grpc.insecure_channel(self.stages[(cell, stage)]) as ch:
            return stub(ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5)


@pytest.fixture(scope="module")
def run_stack(tiny_checkpoint):
    s = RunStack(tiny_checkpoint)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGINT)
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def test_run_stack_prints_urls_and_the_client_round_trips_a_wav(run_stack, tmp_path):
    text = "".join(run_stack.lines)
    assert f"http://127.0.0.1:{run_stack.port}/" in text and run_stack.ws_url in text and "tools.client" in text
    # A 16 kHz stereo WAV: the client says it mixes down and resamples.
    src = tmp_path / "in.wav"
    t = np.arange(16000 * 2) / 16000
    x = (0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2")
    with wave.open(str(src), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.stack([x, x], 1).tobytes())
    out = tmp_path / "out.wav"
    r = subprocess.run([sys.executable, "-m", "tools.client", "--url", run_stack.ws_url, "--input", str(src),
                        "--output", str(out),
                        "--voice", "NATF2.pt", "--persona", "You are a calm guide."],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resampled from 16000 Hz to 24000 Hz" in r.stderr and "mixed down to mono" in r.stderr
    with wave.open(str(out), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        y = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    # 2 s of input = 25 frames (the last zero-padded at close); the model's delay holds back at most one.
    assert y.size >= 20 * 1920 and np.sqrt(np.mean(y**2)) > 1e-3


async def test_output_never_runs_ahead_of_input_over_hundreds_of_frames(run_stack):
    rt = await RT.connect(run_stack.ws_url)
    created = await rt.open()
    assert created["type"] == "session.created"
    delay = created["session"]["capabilities"]["output_delay_frames"]
    n, window = 240, 6  # keep at most `window` frames in flight beyond the model's delay
    x = tone(n)
    sent = 0
    max_lag = 0
    while sent < n:
        out = len(rt.of("response.output_audio.delta"))
        if sent - out < delay + window:
            await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[sent * 1920 : (sent + 1) * 1920])})
            sent += 1
            await asyncio.sleep(TICK_S)
            continue
        ev = await rt.recv(60)
        assert ev["type"] != "error", ev
        out = len(rt.of("response.output_audio.delta"))
        assert out <= sent, "output ran ahead of input"
        max_lag = max(max_lag, sent - out)
    await rt.wait_frames(n - delay, timeout=120)
    done, closed = await rt.close()
    out = len(rt.of("response.output_audio.delta"))
    # Every input frame past the model's delay produced exactly one output frame; none more.
    assert out == n - delay == closed["frames_out"], (out, n, delay, closed)
    assert max_lag <= delay + window
    assert len(rt.of("response.output_audio_transcript.delta")) == out


def _active(stack: RunStack, cell: int, stage: str = "talker") -> int:
    return stack.capacity(cell, stage).active_streams


async def test_sessions_spread_over_cells_and_a_killed_cell_fails_only_its_sessions(run_stack):
    s1, s2 = await RT.connect(run_stack.ws_url), await RT.connect(run_stack.ws_url)
    assert (await s1.open(instructions="one"))["type"] == "session.created"
    assert (await s2.open(instructions="two"))["type"] == "session.created"
    caps = s1.of("session.created")[0]["session"]["capabilities"]
    assert caps["max_sessions"] == 4 and caps["supports_multi_session_same_replica"]
    # Least loaded first: one session on each cell.
    assert _active(run_stack, 0) == 1 and _active(run_stack, 1) == 1

    stop = asyncio.Event()

    async def feed(rt: RT):
        x = tone(1)
        while not stop.is_set() and rt.ws.close_code is None:
            try:
                await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x)})
            except Exception:
                return
            await asyncio.sleep(0.08)

    feeders = [asyncio.create_task(feed(s)) for s in (s1, s2)]
    await asyncio.gather(s1.wait_frames(3), s2.wait_frames(3))

    # Kill cell 0's talker. Its session gets a typed server_error within a second; the other goes on.
    victim_pid = run_stack.pid_of(0, "talker")
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)

    async def outcome(rt: RT):
        while True:
            try:
                ev = await rt.recv(30)
            except asyncio.TimeoutError:
                return None, None
            if ev["type"] == "error":
                return ev, time.monotonic() - killed_at
            if len(rt.of("response.output_audio.delta")) >= before[id(rt)] + 12:
                return "alive", None

    before = {id(s): len(s.of("response.output_audio.delta")) for s in (s1, s2)}
    results = await asyncio.gather(outcome(s1), outcome(s2))
    failed = [(s, r) for s, r in zip((s1, s2), results) if isinstance(r[0], dict)]
    alive = [s for s, r in zip((s1, s2), results) if r[0] == "alive"]
    assert len(failed) == 1 and len(alive) == 1, results
    (victim, (err, after_s)) = failed[0]
    assert err["error"]["type"] == "server_error" and err["error"]["code"] in ("runtime_stream_failed",
                                                                               "runtime_append_failed")
    assert after_s < 1.0, f"typed error after {after_s:.2f}s"
    survivor = alive[0]
    # The dead session's streams in the surviving stages of its cell are closed too.
    assert await eventually(lambda: _active(run_stack, 0, "encoder") == 0), \
        "cell 0 encoder still holds the dead session"


    # New sessions go to the surviving cell only; with it full, the next is refused.
    await asyncio.sleep(1.0)  # one capacity poll notices the dead talker
    with urllib.request.urlopen(f"http://127.0.0.1:{run_stack.port}/health", timeout=5) as r:
        health = json.loads(r.read())
    assert r.status == 200 and health["serving_cells"] == 1 and health["total_slots"] == 2
    s3 = await RT.connect(run_stack.ws_url)
    assert (await s3.open(instructions="three"))["type"] == "session.created"
    assert _active(run_stack, 1) == 2
    s4 = await RT.connect(run_stack.ws_url)
    refused = await s4.open(instructions="four")
    assert refused["type"] == "error" and refused["error"]["code"] == "resource_exhausted"

    stop.set()
    await asyncio.gather(*feeders)
    await survivor.close()
    await s3.close()
    assert await eventually(lambda: _active(run_stack, 1) == 0), "closed sessions still hold talker slots"


def test_run_stack_stops_everything_on_ctrl_c(run_stack):
    children = _children(run_stack.proc.pid)
    assert children
    run_stack.proc.send_signal(signal.SIGINT)
    assert run_stack.proc.wait(90) == 0
    rest = run_stack.proc.stdout.read()
    assert "stopped" in rest
    for pid in children:
        assert not _cmdline(pid), f"process {pid} ({_cmdline(pid)}) outlived run_stack"
