"""The raw Realtime test client and the test audio, shared by the gateway, stack and reliability
tests.

- `tone`, `pcm16_b64`, `f32_b64`: test input that is never silent, as the wire carries it;
- `check_envelope`: every server event has an event_id and a strictly increasing server_event_seq;
- `RT`: an async raw Realtime client (websockets) that records every event and checks its envelope
  and its shape against the `openai` package's typed models;
- `eventually`: wait until a condition on the servers' state holds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
from websockets.asyncio.client import connect

from tests.openai_events import validate_server_event

SR, FRAME = 24_000, 1920
AUDIO_DELTA = "response.output_audio.delta"


def tone(frames: int, f0: float = 220.0, seed: int = 0) -> np.ndarray:
    """Non-silent test speech stand-in: a gliding tone plus a little noise (float32, 24 kHz)."""
    t = np.arange(frames * FRAME) / SR
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * f0 * t * (1 + 0.5 * t)) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def pcm16_b64(x: np.ndarray) -> str:
    return base64.b64encode((np.clip(x, -1, 1) * 32767).round().astype("<i2").tobytes()).decode()


def f32_b64(x: np.ndarray) -> str:
    return base64.b64encode(np.asarray(x, "<f4").tobytes()).decode()


def check_envelope(ev: dict, last_seq: int) -> int:
    """Assert the event's envelope; returns its server_event_seq."""
    assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev
    assert ev["server_event_seq"] > last_seq, "server_event_seq must increase"
    return ev["server_event_seq"]


async def eventually(predicate, timeout: float = 20.0) -> bool:
    """Whether predicate() held within the timeout (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


class RT:
    """Async raw Realtime client: records every event, checks the envelope of each."""

    def __init__(self, ws):
        self.ws = ws
        self.events: list[dict] = []
        self.last_seq = 0
        self.legacy = False  # beta event names (the session says so in session.created)

    @classmethod
    async def connect(cls, url: str, headers: dict | None = None, **kw) -> "RT":
        return cls(await connect(url, additional_headers=headers or {}, max_size=None, open_timeout=60, **kw))

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout: float = 60.0) -> dict:
        ev = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.last_seq = check_envelope(ev, self.last_seq)
        if ev["type"] == "session.created":
            self.legacy = ev["session"].get("event_names") == "legacy"
        validate_server_event(ev, self.legacy)
        self.events.append(ev)
        return ev

    async def until(self, type_: str, timeout: float = 60.0) -> dict:
        """Read until an event of this type (an error event on the way fails the test)."""
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.recv(max(0.01, deadline - time.monotonic()))
            if ev["type"] == type_:
                return ev
            assert ev["type"] != "error", ev

    async def open(self, **session) -> dict:
        """session.update; returns the first answer (session.created, or the refusal)."""
        await self.send({"type": "session.update", "session": {"type": "realtime", **session}})
        return await self.recv(120)

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]

    @property
    def frames(self) -> int:
        return len(self.of(AUDIO_DELTA))

    async def wait_frames(self, k: int, timeout: float = 90.0) -> int:
        """Read until at least k output frames arrived or the timeout (generous: the shared
        machine may be slow); an error event fails the test. Returns the frames there are."""
        deadline = time.monotonic() + timeout
        while self.frames < k and time.monotonic() < deadline:
            try:
                ev = await self.recv(deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            assert ev["type"] != "error", ev
        return self.frames

    def audio(self) -> np.ndarray:
        """Every output audio delta so far, decoded and joined (float32)."""
        chunks = [np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in self.of(AUDIO_DELTA)]
        return (np.concatenate(chunks).astype(np.float32) / 32768) if chunks else np.zeros(0, np.float32)

    async def close(self) -> tuple[dict, dict]:
        """session.close -> response.done -> session.closed; returns (response.done, session.closed)."""
        await self.send({"type": "session.close"})
        done = await self.until("response.done", 120)
        closed = await self.until("session.closed", 60)
        await self.ws.close()
        return done, closed
