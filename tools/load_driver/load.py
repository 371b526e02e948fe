"""Paced multi-session load mode (`--sessions N`).

Every session is admitted (or refused) before any input flows; then all admitted sessions share
one input start and send one 80 ms frame per period against that absolute schedule, session g of N
offset by g/N of a period so the sends of many sessions spread over the period. A stalled
client re-anchors its own schedule instead of bursting to catch up, and the lateness against the
shared schedule is recorded, so an overloaded client is visible and not mistaken for a fast server.
After the last frame, a fixed drain window is observed; audio arriving later (during cleanup)
is excluded. A refused or failed session stays a failed row: it never leaves the denominator.

With `--procs K` this runs in K processes, each on one Shard of the sessions (see procs.py).

Test-only: TEST_LOAD_DRIVER_BURN_MS makes every send loop burn that much CPU after each send (only
in driver process TEST_LOAD_DRIVER_BURN_PROC when that is set): a real client overload for tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import FRAME_PERIOD_S, RESYNC_S, DriverConfig
from .input_audio import append_event, frame_count
from .metrics import Send, timing_metrics
from .session import (
    RealtimeSession,
    SessionLost,
    capabilities_of,
    error_code_of,
    realtime_url,
    session_id_of,
    session_update,
)
from .validate import AcceptanceError, audio_stats, scan_events

# Lead time between "all admitted" and the shared first send, so every session sleeps to it.
START_LEAD_S = 0.05


@dataclass(frozen=True)
class Shard:
    """Driver process `index` of `count` runs sessions index, index + count, ... (round robin, so
    each process's sends still spread over the whole period)."""

    index: int = 0
    count: int = 1

    def sessions(self, total: int) -> range:
        return range(self.index, total, self.count)


def phase_offset_s(index: int, total: int) -> float:
    """Session `index` of `total` sends at this offset into each 80 ms period."""
    return index * FRAME_PERIOD_S / total


def overload_burn_s(shard: Shard) -> float:
    """CPU seconds to burn after each send (test-only overload; see the module docstring)."""
    burn_ms = float(os.environ.get("TEST_LOAD_DRIVER_BURN_MS", "0"))
    only = os.environ.get("TEST_LOAD_DRIVER_BURN_PROC")
    return burn_ms / 1000.0 if only is None or int(only) == shard.index else 0.0


def burn_cpu(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


class SessionFailure(RuntimeError):
    """A local, reportable reason a session failed (our own text, never server-supplied)."""


@dataclass
class SessionRun:
    """The live state of one load session (read by the progress line while it runs)."""

    index: int
    session: RealtimeSession
    session_id: str | None = None
    admitted: bool = False
    phase: str = "admission"
    error: str | None = None
    cleanup_error: str | None = None
    capabilities: dict[str, Any] | None = None
    expected_errors: int = 0  # error events the driver provoked on purpose (lifecycle's bad append)
    phase_offset_s: float = 0.0
    driver_proc: int = 0
    sends: list[Send] = field(default_factory=list)
    stream_start_s: float | None = None
    cutoff_s: float | None = None
    closed: bool = False


def encoded_frames(pcm: np.ndarray, input_format: str) -> list[str]:
    """Each append event as JSON text, encoded once and shared by all sessions (saves client CPU)."""
    return [json.dumps(append_event(pcm, seq, input_format)) for seq in range(frame_count(pcm))]


def check_alive(session: RealtimeSession, expected_errors: int = 0) -> None:
    """Fail fast on anything that already makes the session fail."""
    if len(session.errors()) > expected_errors:
        raise SessionFailure(f"server error event ({', '.join(session.error_codes())})")
    if session.protocol_faults:
        raise SessionFailure(f"protocol fault ({session.protocol_faults[0]})")
    if not session.connected:
        raise SessionLost("connection closed by the server")


async def paced_send(
    run: SessionRun, frames: list[str], epoch: float, timeout_s: float, clock=time.monotonic, burn_s: float = 0.0
) -> None:
    """Send frame k at epoch + k * 80 ms (+ any re-anchoring after a stall; never a catch-up burst)."""
    shift = 0.0
    for seq, text in enumerate(frames):
        target = epoch + seq * FRAME_PERIOD_S + shift
        delay = target - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        check_alive(run.session, run.expected_errors)
        started = clock()
        if started - target > RESYNC_S:
            shift += started - target  # re-anchor the rest of the schedule to now
        await run.session.send_text(text, timeout_s)
        run.sends.append((epoch + seq * FRAME_PERIOD_S, target, started, clock()))
        if burn_s:
            burn_cpu(burn_s)


def check_capabilities(created: dict[str, Any], run: SessionRun) -> None:
    caps = capabilities_of(created)
    run.capabilities = caps
    if caps is None:
        raise SessionFailure("session.created has no session.capabilities")
    if caps.get("chunk_period_ms") != round(FRAME_PERIOD_S * 1000):
        raise SessionFailure("server does not advertise chunk_period_ms=80")


async def admit(run: SessionRun, url_update: dict[str, Any], config: DriverConfig) -> None:
    await run.session.connect(config.timeout_s)
    first = await run.session.open(url_update, config.timeout_s)
    if first["type"] == "error":
        raise SessionFailure(f"rejected at admission ({error_code_of(first) or 'unknown'})")
    run.session_id = session_id_of(first)
    check_capabilities(first, run)
    run.admitted = True


async def drive_session(
    run: SessionRun,
    config: DriverConfig,
    frames: list[str],
    admitted: asyncio.Future[None],
    start: asyncio.Future[float],
    burn_s: float = 0.0,
) -> None:
    """Admission -> shared start -> paced stream -> fixed drain -> bounded cleanup. Never raises
    for a session failure (it is recorded on `run`); cancellation closes the transport and propagates."""
    update = session_update(
        model=config.model, voice=config.voice, persona=config.persona, input_format=config.input_format
    )
    cancelled = False
    try:
        try:
            await admit(run, update, config)
            admitted.set_result(None)
            run.phase = "stream"
            run.stream_start_s = await asyncio.shield(start) + run.phase_offset_s
            await paced_send(run, frames, run.stream_start_s, config.timeout_s, burn_s=burn_s)
            run.phase = "drain"
            await asyncio.sleep(config.drain_s)
            run.cutoff_s = time.monotonic()
            check_alive(run.session)
        except (SessionFailure, SessionLost, TimeoutError) as exc:
            run.error = f"{run.phase}: {exc}"  # local text only
        except Exception as exc:  # noqa: BLE001 - one session's failure never touches another
            # May embed handshake or remote text: keep the phase and type only.
            run.error = f"{run.phase}: {type(exc).__name__}"
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if run.cutoff_s is None:
                run.cutoff_s = time.monotonic()
            if run.admitted and not cancelled:
                await close_politely(run, config.cleanup_timeout_s)
    finally:
        if not admitted.done():
            admitted.set_result(None)  # a failed admission must not hold the others at the barrier
        await run.session.close()


async def close_politely(run: SessionRun, cleanup_timeout_s: float) -> None:
    """session.close -> session.closed, bounded by cleanup_timeout_s; a failure fails the session."""
    if run.session.of_type("session.closed"):
        run.closed = True
        return
    try:
        await run.session.request_close(cleanup_timeout_s)
        run.closed = True
    except Exception as exc:  # noqa: BLE001 - recorded; the report then fails
        run.cleanup_error = f"cleanup: {type(exc).__name__}"


def session_row(run: SessionRun, config: DriverConfig) -> dict[str, Any]:
    """The report row of one session (also for refused and failed sessions)."""
    session = run.session
    scan = scan_events(session.events, session.received_at, run.cutoff_s)
    stats: dict[str, Any] = {}
    acceptance_check = None
    error = run.error
    if run.admitted:
        try:
            stats = audio_stats(scan.valid, len(run.sends), config)
        except AcceptanceError as exc:
            stats, acceptance_check = exc.stats, exc.check
            error = error or f"acceptance {exc.check}: {exc}"
    else:
        stats = {key: None for key in ("output_frames", "voiced_frames", "silent_frames", "frame_deficit",
                                       "frame_coverage_ratio", "audio_rms")}
        stats.update(audio_chunks=len(scan.valid), output_samples=sum(len(p.pcm) // 2 for p in scan.valid))
    timing = timing_metrics(run.sends, [p.received_at_s for p in scan.valid], [len(p.pcm) for p in scan.valid])
    if scan.invalid:
        error = error or f"invalid audio packets ({scan.invalid[0]['code']})"
    if session.errors():
        error = error or f"server error event ({', '.join(session.error_codes())})"
    first_audio = timing["client_first_audio_after_stream_start_ms"]
    if first_audio is not None and first_audio < 0:
        error = error or "audio arrived before the first input frame"
    underrun = timing["audio_underrun_s"]
    if underrun is not None and underrun > config.max_underrun_s:
        error = error or f"audio underrun {underrun:.3f} s exceeds {config.max_underrun_s} s"
    rtf = timing["client_stream_rtf"]
    if config.max_client_rtf is not None and rtf is not None and rtf > config.max_client_rtf:
        error = error or f"client_stream_rtf {rtf:.3f} exceeds {config.max_client_rtf}"
    if run.cleanup_error:
        error = f"{error}; {run.cleanup_error}" if error else run.cleanup_error
    response_ids = sorted({p.response_id for p in scan.valid})
    return {
        "index": run.index,
        "driver_proc": run.driver_proc,
        "session_id": run.session_id,
        "admitted": run.admitted,
        "ok": error is None,
        "error": error,
        "acceptance_check": acceptance_check,
        "server_error_count": len(session.errors()),
        "server_error_codes": session.error_codes(),
        "protocol_faults": list(session.protocol_faults),
        "closed": run.closed,
        "input_frames": len(run.sends),
        **stats,
        "response_ids": response_ids,
        "text_deltas": scan.text_deltas,
        "empty_audio_packets": scan.empty_packets,
        **timing,
        "phase_offset_s": run.phase_offset_s,
        "stream_start_s": run.stream_start_s,
        "observation_cutoff_s": run.cutoff_s,
        "input_timeline": [
            {"frame_index": i, "planned_at_s": p, "target_at_s": t, "send_started_at_s": s, "send_completed_at_s": c}
            for i, (p, t, s, c) in enumerate(run.sends)
        ],
        "audio_packet_timeline": [
            {"event_index": p.event_index, "received_at_s": p.received_at_s, "samples": len(p.pcm) // 2,
             "response_id": p.response_id}
            for p in scan.valid
        ],
        "invalid_audio_packets": scan.invalid,
    }


SHARED_RESPONSE_ERROR = "response id shared with another session"


def mark_shared_response_ids(rows: list[dict[str, Any]]) -> list[str]:
    """Response ids seen in more than one session; every session holding one fails (idempotent, so
    the merge of several driver processes can mark again across them)."""
    owners: dict[str, int] = {}
    for row in rows:
        for rid in row["response_ids"]:
            owners[rid] = owners.get(rid, 0) + 1
    shared = sorted(rid for rid, count in owners.items() if count > 1)
    for row in rows:
        if set(row["response_ids"]) & set(shared) and not (row["error"] or "").startswith(SHARED_RESPONSE_ERROR):
            row["ok"] = False
            row["error"] = SHARED_RESPONSE_ERROR + (f"; {row['error']}" if row["error"] else "")
    return shared


def new_run(index: int, config: DriverConfig, shard: Shard) -> SessionRun:
    session = RealtimeSession(realtime_url(config.url, config.model), cleanup_timeout_s=config.cleanup_timeout_s)
    return SessionRun(index, session, phase_offset_s=phase_offset_s(index, config.sessions or 1),
                      driver_proc=shard.index)


async def own_start() -> float:
    return time.monotonic() + START_LEAD_S


async def run_load(
    config: DriverConfig,
    pcm: np.ndarray,
    progress=None,
    shard: Shard = Shard(),
    start_at: Callable[[], Awaitable[float]] = own_start,
) -> dict[str, Any]:
    """Run this shard's paced sessions; returns the result (see report.load_result for the file layout).

    start_at is awaited once every session of the shard is admitted or refused; it returns the shared
    input start (time.monotonic(), which all processes of one host share)."""
    frames = encoded_frames(pcm, config.input_format)
    loop = asyncio.get_running_loop()
    start: asyncio.Future[float] = loop.create_future()
    runs = [new_run(i, config, shard) for i in shard.sessions(config.sessions or 0)]
    gates = [loop.create_future() for _ in runs]
    burn_s = overload_burn_s(shard)
    tasks = [asyncio.create_task(drive_session(r, config, frames, g, start, burn_s)) for r, g in zip(runs, gates)]
    if progress is not None:
        progress.watch(runs, len(frames))
    try:
        await asyncio.gather(*gates)
        start.set_result(await start_at())
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if progress is not None:
            progress.stop()
    rows = [session_row(r, config) for r in runs]
    shared = mark_shared_response_ids(rows)
    return {
        "frames_per_session": len(frames),
        "stream_start_s": start.result(),
        "capabilities": next((r.capabilities for r in runs if r.capabilities is not None), None),
        "shared_response_ids": shared,
        "driver_processes": [{"index": shard.index, "pid": os.getpid(), "sessions": [r.index for r in runs],
                              "exit_code": None, "error": None}],
        "sessions": rows,
    }
