"""Shared by the framework client scripts (they run in the frameworks venv, not the main one).

Each script drives one real framework client against a running gateway and prints one JSON report
line on stdout; tests/test_frameworks.py runs the script and checks the report.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import time
import urllib.request
import wave

import numpy as np

SAMPLE_RATE = 24_000
FRAME = 1920  # 80 ms
PERIOD_S = FRAME / SAMPLE_RATE


def args(extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="the gateway's http://host:port")
    p.add_argument("--speech", required=True, help="24 kHz mono int16 WAV of speech-like input")
    p.add_argument("--scenario", default="stream")
    p.add_argument("--frames-a", type=int, default=25, help="frames streamed before the interruption")
    p.add_argument("--frames-b", type=int, default=20, help="frames streamed after it")
    p.add_argument("--delay", type=int, required=True, help="the model's output delay in frames")
    p.add_argument("--voice", default=None)
    if extra:
        extra(p)
    return p.parse_args()


def read_speech(path: str) -> np.ndarray:
    """int16 samples of the WAV (24 kHz mono)."""
    with wave.open(path, "rb") as w:
        assert w.getframerate() == SAMPLE_RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


def frames_of(pcm: np.ndarray, first: int, count: int):
    for i in range(first, first + count):
        yield pcm[i * FRAME:(i + 1) * FRAME]


async def paced(frames, push) -> int:
    """Call push(frame) every 80 ms (push may be async); returns how many frames were pushed."""
    start, n = time.monotonic(), 0
    for n, frame in enumerate(frames, 1):
        if inspect.isawaitable(done := push(frame)):
            await done
        await asyncio.sleep(max(0.0, start + n * PERIOD_S - time.monotonic()))
    return n


async def interrupt_mid_stream(pcm: np.ndarray, a: argparse.Namespace, push, interrupt, frames_out) -> int:
    """Phase B: stream `frames_b` more frames and call interrupt() (may be async) a quarter of the way
    in; returns the output frame count (frames_out()) at the interruption."""
    at = [0]

    async def push_b(frame):
        push_b.n += 1
        if push_b.n == a.frames_b // 4 + 1:
            at[0] = frames_out()
            if inspect.isawaitable(done := interrupt()):
                await done
        if inspect.isawaitable(done := push(frame)):
            await done
    push_b.n = 0
    await paced(frames_of(pcm, a.frames_a, a.frames_b), push_b)
    return at[0]


async def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def metric(url: str, name: str) -> float:
    """Sum of a gateway metric over its labels (one session runs at a time in these tests)."""
    body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def short_event(ev: dict) -> dict:
    """A server event as reported back: audio payloads cut (their type and shape stay)."""
    if isinstance(ev.get("delta"), str) and ev.get("type", "").endswith("audio.delta"):
        return {**ev, "delta": ev["delta"][:8]}
    return ev


def report(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class LiveKitOutput:
    """What a LiveKit llm.RealtimeSession gives its agent: generations, their audio and text, errors,
    reconnects (the same for both LiveKit plugins; read the way AgentSession reads them)."""

    def __init__(self, sess):
        self.samples, self.texts, self.generations, self.errors, self.reconnects = 0, [], [], [], 0
        self._tasks: set[asyncio.Task] = set()
        sess.on("error", lambda e: self.errors.append({"error": str(getattr(e.error, "body", None) or e.error)[:300],
                                                       "recoverable": e.recoverable}))
        sess.on("session_reconnected", lambda e: self._reconnected())
        sess.on("generation_created", lambda gen: self._spawn(self._read_generation(gen)))

    @property
    def frames(self) -> int:
        return self.samples // FRAME

    def _reconnected(self) -> None:
        self.reconnects += 1

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_generation(self, gen) -> None:
        self.generations.append(gen.response_id)
        async for msg in gen.message_stream:
            self._spawn(self._read_audio(msg))
            self._spawn(self._read_text(msg))

    async def _read_audio(self, msg) -> None:
        async for frame in msg.audio_stream:
            self.samples += frame.samples_per_channel

    async def _read_text(self, msg) -> None:
        async for piece in msg.text_stream:
            if str(piece):
                self.texts.append(str(piece))
