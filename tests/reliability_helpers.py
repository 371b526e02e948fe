"""Small shared pieces of the reliability suite (tests/test_reliability_*.py).

- audio and the async client come from tests/realtime_client.py (`tone`, `pcm16_b64`, `f32_b64`,
  `RT`), re-exported here;
- `SyncRT`: the same over websockets' sync client, for hypothesis (which runs sync tests);
- `Feeder`: a background thread holding one paced session open and counting its output,
  the "other session that must keep going" of every test here;
- what "nothing leaked" is read from: every stage's GetCapacity (`stage_counts`), the
  gateway's /metrics gauges (`gateway_metric`), and a process's RSS (`rss_mb`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as sync_connect

from duplex.v1 import common_pb2, decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from tests.openai_events import validate_server_event
from tests.realtime_client import FRAME, RT, SR, check_envelope, f32_b64, pcm16_b64, tone  # noqa: F401 (re-exported)

# Continuous output: the response's opening events, then its deltas.
OUTPUT_EVENTS = ("response.created", "conversation.item.added", "response.output_item.added",
                 "response.content_part.added",
                 "response.output_audio.delta", "response.output_audio_transcript.delta")
_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "talker": talker_pb2_grpc.TalkerStub,
          "decoder": decoder_pb2_grpc.DecoderStub}


def append(x: np.ndarray, fmt: str = "pcm16") -> dict:
    return {"type": "input_audio_buffer.append", "audio": pcm16_b64(x) if fmt == "pcm16" else f32_b64(x)}


# ---- what "nothing leaked" reads ------------------------------------------------------------

def capacity(address: str, stage: str):
    with grpc.insecure_channel(address) as ch:
        return _STUBS[stage](ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5)


def stage_counts(stack, cells=None, stages=("encoder", "talker", "decoder")) -> dict:
    """{(cell, stage): (free_slots, active_streams)} for the given stages of the given cells (default all)."""
    out = {}
    for i, cell in enumerate(stack.cell_procs):
        if cells is not None and i not in cells:
            continue
        for stage in stages:
            c = capacity(getattr(cell, stage).address, stage)
            out[(i, stage)] = (c.free_slots, c.active_streams)
    return out


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def gateway_metric(gateway, name: str) -> float:
    """Sum of all samples of one metric (every label set) at the gateway's /metrics."""
    _, body = http_get(gateway.http_url + "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def leak_baseline(stack) -> tuple[dict, float]:
    """What "nothing leaked" compares with: every stage's slot counts and the gateway's active gauge."""
    return stage_counts(stack), gateway_metric(stack.gateway, "gateway_sessions_active")


def assert_nothing_leaked(stack, baseline: tuple[dict, float]) -> None:
    """Slot counts and the active gauge back at `baseline` (within 30 s: cleanup is asynchronous)."""
    counts, active = baseline
    now = wait_until(lambda: stage_counts(stack) == counts
                     and gateway_metric(stack.gateway, "gateway_sessions_active") == active, 30)

    assert now, (stage_counts(stack), counts, gateway_metric(stack.gateway, "gateway_sessions_active"), active)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_until(predicate, timeout: float = 20.0, period: float = 0.1):
    """Poll `predicate` until it returns something truthy; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(period)


async def async_wait_until(predicate, timeout: float = 20.0, period: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(period)


# ---- clients --------------------------------------------------------------------------------

class SyncRT:
    """The same client on websockets' sync API (hypothesis tests are sync functions)."""

    def __init__(self, url: str, **kw):
        self.ws = sync_connect(url, max_size=None, open_timeout=60, legacy=True, **kw)
        self.events: list[dict] = []
        self.last_seq = 0
        self.legacy = False

    def send(self, event: dict | str | bytes) -> None:
        self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    def recv(self, timeout: float = 30.0) -> dict:
        ev = json.loads(self.ws.recv(timeout))
        self.last_seq = check_envelope(ev, self.last_seq)
        if ev["type"] == "session.created":
            self.legacy = ev["session"].get("event_names") == "legacy"
        validate_server_event(ev, self.legacy)
        self.events.append(ev)
        return ev

    def next_reply(self, timeout: float = 30.0) -> dict:
        """The next event that is not continuous output (output of earlier appends may come first)."""
        while (ev := self.recv(timeout))["type"] in OUTPUT_EVENTS:
            pass
        return ev

    @property
    def frames(self) -> int:
        return sum(e["type"] == "response.output_audio.delta" for e in self.events)

    def close(self) -> None:
        self.ws.close()


@contextlib.contextmanager
def steady_feeder(stack, instructions: str = "You are steady."):
    """A paced bystander session for a whole module: talking before the first test, still talking
    after the last (every attack's neighbour)."""
    f = Feeder(stack.gateway.ws_url, instructions=instructions)
    f.check_alive(2, timeout=60)
    yield f
    assert f.stop()["frames_out"] > 0


class Feeder:
    """One session paced at real time in a background thread, counting its output frames.

    The "untouched session" of a test: `frames` must keep increasing while the test does
    its damage elsewhere; `check_alive` asserts it did since the last call. Stop with
    `stop()`, which closes the session with session.close and returns its session.closed.
    """

    def __init__(self, url: str, period_s: float = FRAME / SR, **session):
        self.rt = SyncRT(url)
        self.rt.send({"type": "session.update", "session": {"type": "realtime", **session}})
        created = self.rt.recv(120)
        assert created["type"] == "session.created", created
        self.period_s = period_s
        self.sent = 0
        self.errors: list[dict] = []
        self.error_at: list[float] = []  # time.monotonic() of each error event
        self.closed: int | None = None  # the close code, once the server closed the socket
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last_checked = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def frames(self) -> int:
        with self._lock:
            return self.rt.frames

    def _run(self) -> None:
        x = tone(1, 300)
        next_at = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_at and not self.errors:  # a failed session gets no more input
                    self.rt.send(append(x))
                    self.sent += 1
                    next_at += self.period_s
                try:
                    ev = json.loads(self.rt.ws.recv(max(0.001, next_at - time.monotonic())))
                except TimeoutError:
                    continue
                with self._lock:
                    self.rt.events.append(ev)
                if ev["type"] == "error":
                    self.error_at.append(time.monotonic())
                    self.errors.append(ev)
        except ConnectionClosed as e:
            self.closed = e.rcvd.code if e.rcvd is not None else -1

    def check_alive(self, min_new: int = 1, timeout: float = 30.0) -> int:
        """Assert at least `min_new` output frames arrived since the last check (waiting up to timeout)."""
        target = self._last_checked + min_new
        wait_until(lambda: self.frames >= target or self.errors, timeout)
        assert not self.errors, self.errors
        assert self.frames >= target, f"the untouched session stalled: {self.frames} frames, expected >= {target}"
        self._last_checked = self.frames
        return self.frames

    def wait_failed(self, timeout: float = 30.0) -> tuple[dict, float]:
        """For a session whose stage was hurt: its first error event and when it arrived."""
        assert wait_until(lambda: self.errors, timeout), f"no error event within {timeout}s"
        return self.errors[0], self.error_at[0]

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        assert not self.errors, self.errors
        self.rt.send({"type": "session.close"})
        deadline = time.monotonic() + 60
        while (ev := self.rt.recv(max(0.1, deadline - time.monotonic())))["type"] != "session.closed":
            assert ev["type"] != "error", ev
        self.rt.close()
        assert ev["frames_out"] <= ev["frames_in"] == self.sent, ev
        return ev
