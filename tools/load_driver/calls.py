"""The arrivals and burst traffic (traffic.py's plan): callers who dial over time, are refused and retry,
talk, hang up, and the line's next caller who dials after them.

One caller's call, try by try:
  1. it connects and opens in the configured style (load.open_call);
  2. refused (a typed retry-later before it heard any audio: refusal.py), it closes, waits the delay the
     server gave (else 1 s) and dials again: at most --max-tries times, until --retry-for-s after its
     first try and while a call of --call-min-s still fits before the end; then it gives up (refused);
  3. admitted, it streams from a random phase after its open (traffic.send_phase_s) until its hang-up
     (traffic.hangup_s), drains for --drain-s and closes politely. Its row (load.session_row) judges it.
A refusal can come after the open's answer: an SDK open streams after the autostarted session's
session.updated, and its own session.update may then lose the slot. Audio sent on a refused try is
not part of the call.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
from websockets.exceptions import InvalidStatus

from .config import FRAME_PERIOD_S, DriverConfig
from .load import (
    SessionFailure,
    SessionLost,
    SessionRun,
    Shard,
    check_alive,
    encoded_frames,
    end_call,
    new_run,
    new_session,
    open_call,
    overload_burn_s,
    own_start,
    paced_send,
    refusal_of,
    run_load,
    shard_result,
    wind_down,
)
from .refusal import Refusal, http_refusal
from .traffic import TOGETHER, Plan, hangup_s, make_plan, next_dial_s


async def _sleep_until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))


async def _talk(run: SessionRun, config: DriverConfig, plan: Plan, frames: list[str], start: float,
                burn_s: float) -> None:
    """Stream from the call's phase until its hang-up, then drain (the caller hears the rest)."""
    run.phase = "stream"
    run.stream_start_s = time.monotonic() + run.phase_offset_s
    last = start + hangup_s(config, plan, run.line, run.call, run.stream_start_s - start)
    count = min(len(frames), max(1, math.ceil((last - run.stream_start_s) / FRAME_PERIOD_S)))
    await paced_send(run, frames[:count], run.stream_start_s, config.timeout_s, burn_s=burn_s)
    run.phase = "drain"
    await asyncio.sleep(config.drain_s)
    run.cutoff_s = time.monotonic()
    check_alive(run.session)


async def one_try(run: SessionRun, config: DriverConfig, plan: Plan, frames: list[str], start: float,
                  burn_s: float) -> Refusal | None:
    """One try of a call: the refusal that ended it, or None when it was served or failed (run.error)."""
    run.phase = "admission"
    try:
        try:
            await open_call(run, config)
        except InvalidStatus as exc:
            refusal = http_refusal(exc.response.status_code, exc.response.headers, time.monotonic())
            if refusal is None:
                raise SessionFailure(f"handshake refused (HTTP {exc.response.status_code})") from None
            return refusal
        await _talk(run, config, plan, frames, start, burn_s)
    except (SessionFailure, SessionLost, TimeoutError) as exc:
        refusal = refusal_of(run)
        if refusal is not None:
            return refusal
        run.error = f"{run.phase}: {exc}"  # local text only
    except Exception as exc:  # noqa: BLE001 - one caller's failure never touches another
        run.error = f"{run.phase}: {type(exc).__name__}"  # may embed remote text: the type only
    return None


async def place_call(run: SessionRun, config: DriverConfig, plan: Plan, frames: list[str], start: float,
                     burn_s: float) -> None:
    """Every try of one call until it is served, fails or gives up; never raises for the call's failure.
    Cancellation closes the transport and propagates."""
    cancelled = False
    try:
        while True:
            refusal = await one_try(run, config, plan, frames, start, burn_s)
            if refusal is None:
                break
            run.refusals.append(refusal)
            run.admitted, run.session_id, run.sends, run.stream_start_s = False, None, [], None
            await run.session.close()
            first = run.first_try_s or time.monotonic()
            retry_at = time.monotonic() + refusal.delay_s(config.retry_for_s)
            give_up_at = min(first + config.retry_for_s, start + plan.end_s - config.call_min_s)
            if run.tries >= config.max_tries or retry_at > give_up_at:
                run.error = f"admission: refused {run.tries} time(s), last {refusal.name}; gave up"
                return
            await _sleep_until(retry_at)
            run.session = new_session(config)
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        await end_call(run, config, cancelled)
        await run.session.close()


async def drive_line(line: int, config: DriverConfig, plan: Plan, frames: list[str], start: float,
                     runs: list[SessionRun], shard: Shard, burn_s: float) -> None:
    """A line's callers, one after another: each dials at its time, calls, hangs up; the next dials after."""
    call, dial = 0, plan.first_dial_s[line]
    n = config.sessions or 1
    while dial is not None:
        run = new_run(line + call * n, config, shard, line=line, call=call)
        run.dialed_at_s = start + dial
        runs.append(run)
        await _sleep_until(run.dialed_at_s)
        await place_call(run, config, plan, frames, start, burn_s)
        dial = next_dial_s(config, plan, time.monotonic() - start)
        call += 1


async def run_calls(config: DriverConfig, pcm: np.ndarray, progress=None, shard: Shard = Shard(),
                    start_at=own_start) -> dict[str, Any]:
    """This shard's lines of the arrivals or burst traffic; the same result as load.run_load. start_at
    is awaited before anyone dials: it returns the plan's time zero (time.monotonic())."""
    frames = encoded_frames(pcm, config.input_format)
    plan = make_plan(config)
    runs: list[SessionRun] = []
    burn_s = overload_burn_s(shard)
    start = await start_at()
    tasks = [asyncio.create_task(drive_line(line, config, plan, frames, start, runs, shard, burn_s))
             for line in shard.sessions(config.sessions or 0)]
    if progress is not None:
        progress.watch(runs, len(frames))
    try:
        await asyncio.gather(*tasks)
    finally:
        await wind_down(tasks, progress)
    return shard_result(config, runs, len(frames), start, shard, sorted({r.line for r in runs}))


async def run_traffic(config: DriverConfig, pcm: np.ndarray, progress=None, shard: Shard = Shard(),
                      start_at=own_start) -> dict[str, Any]:
    """The configured traffic on this shard: load.run_load for `together`, run_calls otherwise."""
    runner = run_load if config.traffic == TOGETHER else run_calls
    return await runner(config, pcm, progress, shard=shard, start_at=start_at)
