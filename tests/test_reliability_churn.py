"""Churn, long sessions and backpressure on one real stack (one cell, six slots).

The talker runs its real 80 ms clock (a faster clock starves prompt prefills on a 2-core
machine), a 32-frame attention window (so a session runs several windows past its context),
and its default 2 s input backlog bound (25 frames).
"""

from __future__ import annotations

import asyncio
import base64
import random
import time

import numpy as np
import pytest

from tests.reliability_helpers import (FRAME, RT, Feeder, append, async_wait_until, gateway_metric, pcm16_b64, rss_mb,
                                       stage_counts, tone, wait_until)
from tools.run_stack import Stack

SLOTS, CONTEXT, TICK_S, BACKLOG_FRAMES = 6, 32, 0.08, 25
TALKER_ARGS = ["--context", str(CONTEXT), "--tick-ms", str(TICK_S * 1000), "--max-backlog-s",
               str(BACKLOG_FRAMES * TICK_S)]
# A TCP drop after the open pauses its session for the resume grace (docs/resume.md): a short one here,
# so the churn's drops still go through pause and expiry without holding the slots for 15 s each.
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20", "--resume-grace", "1"]
CHURN_CYCLES = 240
RSS_BOUND_MB = 50.0


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=SLOTS, talker_args=TALKER_ARGS, gateway_args=GATEWAY_ARGS) as s:
        yield s


@pytest.fixture
def idle(stack):
    """Every slot free before and after the test."""
    free = {k: (SLOTS, 0) for k in stage_counts(stack)}
    assert stage_counts(stack) == free
    yield free
    assert wait_until(lambda: stage_counts(stack) == free, 30), stage_counts(stack)
    assert gateway_metric(stack.gateway, "gateway_sessions_active") == 0


# ---- churn ----------------------------------------------------------------------------------------

async def _cycle(url: str, kind: str, rng: random.Random, stats: dict) -> None:
    """One open/close or abrupt-disconnect cycle of the given kind."""
    frames = rng.randint(0, 3)
    x = tone(frames or 1, 200 + 10 * rng.randint(0, 20))
    if kind == "drop_before_update":  # TCP connect + WebSocket handshake, then the socket just goes
        rt = await RT.connect(url)
        rt.ws.transport.abort()
        return
    if kind == "autostart_drop":  # ?model= opens the session at connect; drop while it opens
        rt = await RT.connect(url + "&model=personaplex")
        await asyncio.sleep(rng.random() * 0.05)
        rt.ws.transport.abort()
        return
    rt = await RT.connect(url)
    if kind == "drop_during_open":
        await rt.send({"type": "session.update", "session": {"type": "realtime"}})
        await asyncio.sleep(rng.random() * 0.05)
        rt.ws.transport.abort()
        return
    for attempt in range(100):  # a just-dropped session may still hold its slot for a moment
        ev = await rt.open()
        if ev["type"] == "session.created":
            break
        assert ev["type"] == "error" and ev["error"]["code"] == "resource_exhausted", ev
        stats["refused"] += 1
        await rt.ws.close()
        await asyncio.sleep(0.1)
        rt = await RT.connect(url)
    else:
        raise AssertionError("no slot came free")
    for i in range(frames):
        await rt.send(append(x[i * FRAME : (i + 1) * FRAME]))
    if kind == "close":
        _, closed = await rt.close()
        assert closed["frames_in"] == frames and closed["frames_out"] <= frames, closed
        assert closed["cleanup_confirmed"] is True, closed
    elif kind == "ws_close":  # a clean WebSocket close without session.close
        await rt.ws.close()
    else:  # "drop_after_open"
        rt.ws.transport.abort()


async def test_hundreds_of_open_close_and_abrupt_disconnects_leak_nothing(stack, idle):
    """240 cycles on two lanes (explicit close, clean WebSocket close, TCP drop after open,
    drop while opening, drop right after an autostart connect, drop before any event), 0-3
    frames each, while two paced sessions run. Afterwards: every stage's slot counts and the
    gateway's active gauge are back where they started, no cleanup went unconfirmed, the
    gateway's RSS grew by less than 50 MB, and the running sessions kept producing output."""
    url = stack.gateway.ws_url
    runners = [Feeder(url, instructions="You keep talking."), Feeder(url, instructions="You keep listening.")]
    with_runners = {k: (SLOTS - 2, 2) for k in idle}
    assert stage_counts(stack) == with_runners
    unconfirmed = gateway_metric(stack.gateway, "gateway_cleanup_unconfirmed_total")
    kinds = ["close", "drop_after_open", "drop_during_open", "ws_close", "autostart_drop", "drop_before_update"]
    stats = {"refused": 0, **{k: 0 for k in kinds}}
    pid = stack.gateway.proc.pid

    async def lane(seed: int, cycles: int) -> None:
        rng = random.Random(seed)
        for i in range(cycles):
            kind = kinds[(i + seed) % len(kinds)]
            await _cycle(url, kind, rng, stats)
            stats[kind] += 1

    await asyncio.gather(lane(1, 10), lane(2, 10))  # warm-up: first-use allocations are not a leak
    rss0, t0 = rss_mb(pid), time.monotonic()
    for part in range(4):
        await asyncio.gather(lane(10 + part, CHURN_CYCLES // 8), lane(20 + part, CHURN_CYCLES // 8))
        for r in runners:
            await asyncio.to_thread(r.check_alive, 3)
    churn_s = time.monotonic() - t0
    settled = await async_wait_until(lambda: stage_counts(stack) == with_runners
                                     and gateway_metric(stack.gateway, "gateway_sessions_active") == 2, 30)
    assert settled, (stage_counts(stack), gateway_metric(stack.gateway, "gateway_sessions_active"))
    rss1 = rss_mb(pid)
    cycles = sum(stats[k] for k in kinds)
    print(f"\n[churn] {cycles} cycles ({stats}) in {churn_s:.1f}s; gateway RSS {rss0:.1f} -> {rss1:.1f} MB")
    assert cycles >= 200
    assert rss1 - rss0 < RSS_BOUND_MB
    assert gateway_metric(stack.gateway, "gateway_cleanup_unconfirmed_total") == unconfirmed, stack.gateway.log_tail()
    for r in runners:
        await asyncio.to_thread(r.check_alive, 3)
        closed = await asyncio.to_thread(r.stop)
        assert closed["cleanup_confirmed"] is True


# ---- long sessions ----------------------------------------------------------------------------------

async def test_a_session_runs_many_windows_past_the_talker_context(stack, idle):
    """120 frames through a talker whose attention window is 32 frames (the KV ring wraps
    several times past the 12-frame prompt): no error, every input frame past the model's delay yields exactly one
    audio delta and one transcript delta, and the audio stays finite and non-silent."""
    rt = await RT.connect(stack.gateway.ws_url)
    created = await rt.open(instructions="")
    assert created["type"] == "session.created", created
    delay = created["session"]["capabilities"]["output_delay_frames"]
    n, window = 120, 8
    x = tone(n, 210)
    sent = 0
    while sent < n:
        if sent - rt.frames < delay + window:  # stay well inside the talker's backlog bound
            await rt.send(append(x[sent * FRAME : (sent + 1) * FRAME]))
            sent += 1
            await asyncio.sleep(TICK_S)
        else:
            assert (await rt.recv(60))["type"] != "error"
    assert await rt.wait_frames(n - delay, 120) == n - delay
    _, closed = await rt.close()
    assert closed["frames_in"] == n and closed["frames_out"] == n - delay == rt.frames, closed
    assert len(rt.of("response.output_audio_transcript.delta")) == rt.frames
    y = np.concatenate([np.frombuffer(base64.b64decode(e["delta"]), "<i2")
                        for e in rt.of("response.output_audio.delta")])
    assert y.size == (n - delay) * FRAME and float(np.sqrt(np.mean((y / 32768.0) ** 2))) > 1e-3


# ---- backpressure ----------------------------------------------------------------------------------

async def test_a_burst_under_the_backlog_bound_is_paced_not_dropped(stack, idle):
    """A client that sends 16 frames at once (one packet, 1.28 s of audio, faster than real
    time, under the talker's 25-frame backlog bound): the clock works through them, every
    frame past the model's delay comes out, nothing is dropped."""
    rt = await RT.connect(stack.gateway.ws_url)
    created = await rt.open()
    delay = created["session"]["capabilities"]["output_delay_frames"]
    n = 16
    await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(n, 260))})
    assert await rt.wait_frames(n - delay, 60) == n - delay
    _, closed = await rt.close()
    assert closed["frames_in"] == n and closed["frames_out"] == n - delay, closed


async def test_a_burst_over_the_backlog_bound_is_a_typed_error_never_silent_loss(stack, idle):
    """75 frames in a burst with a 25-frame backlog bound: the documented outcome is a typed
    `server_error` naming the backlog once the talker's queue is over its bound (the session
    ends, 1011), never frames silently lost: the outputs that did come are fewer than the
    inputs. If this machine were too slow to build a backlog, everything must come out.
    A paced session on the same stage is not affected."""
    runner = Feeder(stack.gateway.ws_url, instructions="You are unaffected.")
    rt = await RT.connect(stack.gateway.ws_url)
    created = await rt.open()
    delay = created["session"]["capabilities"]["output_delay_frames"]
    n = 3 * BACKLOG_FRAMES
    x = tone(n, 270)
    for i in range(n):
        await rt.send(append(x[i * FRAME : (i + 1) * FRAME]))
    err = None
    deadline = time.monotonic() + 60
    while rt.frames < n - delay and time.monotonic() < deadline:
        ev = await rt.recv(60)
        if ev["type"] == "error":
            err = ev
            break
    if err is not None:
        print(f"\n[backpressure] typed error after {rt.frames} outputs: {err['error']}")
        assert err["error"]["type"] == "server_error" and "backlog" in err["error"]["message"], err
        assert rt.frames < n - delay
        closed = await rt.until("session.closed", 30)
        assert closed["frames_out"] == rt.frames <= closed["frames_in"] <= n, closed
    else:
        print("\n[backpressure] no backlog built up: everything came out")
        assert rt.frames == n - delay
        await rt.close()
    await asyncio.to_thread(runner.check_alive, 5)
    await asyncio.to_thread(runner.stop)
