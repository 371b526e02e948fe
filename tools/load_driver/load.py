"""Paced multi-session load mode (`--sessions N`): the `together` traffic, and what every pattern shares
(a call's state, the paced send, the report row and its status). calls.py runs the other patterns.

Together: every session is admitted (or refused) before any input flows; then all admitted sessions share
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
from .refusal import Refusal, event_refusal
from .session import (
    OPEN_ANSWER,
    RawRealtimeClient,
    SessionLost,
    capabilities_of,
    error_code_of,
    realtime_url,
    session_id_of,
    session_update,
)
from .traffic import send_phase_s
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


# A call's status in its report row: admitted and every check passed; admitted and a check failed;
# admitted and ended by the server (a server_error event, or a close the caller did not ask for);
# never admitted after typed retry-laters (refusal.py); never admitted for another reason is failed.
PASSED, FAILED, KILLED, REFUSED = "passed", "failed", "killed", "refused"
STATUSES = (PASSED, FAILED, KILLED, REFUSED)


@dataclass
class SessionRun:
    """The live state of one load session, a call (read by the progress line while it runs). A refused
    call dials again on a fresh `session`; the row reports the last one."""

    index: int
    session: RawRealtimeClient
    line: int = 0  # the caller's line (arrivals: a line's callers follow each other; else = index)
    call: int = 0  # the call's number on its line
    dialed_at_s: float | None = None  # when the traffic plan had it dial (time.monotonic())
    first_try_s: float | None = None  # its first connect
    tries: int = 0
    refusals: list[Refusal] = field(default_factory=list)
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


def check_alive(session: RawRealtimeClient, expected_errors: int = 0) -> None:
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


def refusal_of(run: SessionRun) -> Refusal | None:
    """The typed retry-later that ended the call's current try, if one did (refusal.py)."""
    s = run.session
    return event_refusal(s.events, s.received_at, s.close_code, s.closed_at)


def call_update(config: DriverConfig) -> dict[str, Any]:
    return session_update(model=config.model, voice=config.voice, persona=config.persona,
                          input_format=config.input_format)


async def open_call(run: SessionRun, config: DriverConfig) -> None:
    """Connect and open the session in the configured style (session.OPEN_ANSWER); SessionFailure when the
    open's answer is an error."""
    session = run.session
    run.tries += 1
    run.first_try_s = run.first_try_s or time.monotonic()
    await session.connect(config.timeout_s)
    first = await session.open(call_update(config), config.timeout_s, OPEN_ANSWER[config.open])
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
    cancelled = False
    try:
        try:
            await open_call(run, config)
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
            if not run.admitted and (refusal := refusal_of(run)) is not None:
                run.refusals.append(refusal)  # together never retries: the row says it was refused
            await end_call(run, config, cancelled)
    finally:
        if not admitted.done():
            admitted.set_result(None)  # a failed admission must not hold the others at the barrier
        await run.session.close()


async def end_call(run: SessionRun, config: DriverConfig, cancelled: bool) -> None:
    """However a call ended: its observation ends now (if the drain did not end it), and an admitted
    session is closed politely, unless the driver is being cancelled (then only the transport closes)."""
    if run.cutoff_s is None:
        run.cutoff_s = time.monotonic()
    if run.admitted and not cancelled:
        await close_politely(run, config.cleanup_timeout_s)


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


def killed_by(session: RawRealtimeClient) -> str | None:
    """What ended an admitted session on the server's side: its first server_error's code, or the
    close it did not ask for; None when it was not ended so."""
    for event in session.errors():
        body = event.get("error")
        if isinstance(body, dict) and body.get("type") == "server_error":
            return f"server_error:{error_code_of(event) or 'unknown'}"
    if session.ended_by_server:
        return f"close:{session.close_code}"
    return None


def call_status(run: SessionRun, error: str | None) -> str:
    if not run.admitted:
        return REFUSED if run.refusals else FAILED
    if killed_by(run.session) is not None:
        return KILLED
    return PASSED if error is None else FAILED


def _since_ms(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else (later - earlier) * 1000.0


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
    first_audio_at = scan.valid[0].received_at_s if scan.valid and run.admitted else None
    status = call_status(run, error)
    return {
        "index": run.index,
        "driver_proc": run.driver_proc,
        "session_id": run.session_id,
        "admitted": run.admitted,
        "ok": status == PASSED,
        "status": status,
        "error": error,
        "killed_by": killed_by(session) if status == KILLED else None,
        "close_code": session.close_code,
        "line": run.line,
        "call": run.call,
        "dialed_at_s": run.dialed_at_s,
        "first_try_at_s": run.first_try_s,
        "connect_at_s": session.connect_started_at,
        "tries": run.tries,
        "refusals": [r.as_row() for r in run.refusals],
        # Dial (its first try) -> first audio of the try that was served; connect of that try -> first audio.
        "time_to_served_ms": _since_ms(first_audio_at, run.first_try_s),
        "client_first_audio_after_connect_ms": _since_ms(first_audio_at, session.connect_started_at),
        "acceptance_check": acceptance_check,
        "server_error_count": len(session.errors()),
        "server_error_codes": session.error_codes(),
        "error_types": session.error_types(),
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
            row["status"] = FAILED if row["status"] == PASSED else row["status"]
            row["error"] = SHARED_RESPONSE_ERROR + (f"; {row['error']}" if row["error"] else "")
    return shared


def new_session(config: DriverConfig) -> RawRealtimeClient:
    return RawRealtimeClient(realtime_url(config.url, config.model, config.open),
                           cleanup_timeout_s=config.cleanup_timeout_s)


def new_run(index: int, config: DriverConfig, shard: Shard, line: int | None = None, call: int = 0) -> SessionRun:
    """Call `call` of `line` (a together session: line = index, call 0), with its send phase."""
    line = index if line is None else line
    return SessionRun(index, new_session(config), line=line, call=call,
                      phase_offset_s=send_phase_s(config, line, call), driver_proc=shard.index)


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
        await wind_down(tasks, progress)
    return shard_result(config, runs, len(frames), start.result(), shard, [r.index for r in runs])


async def wind_down(tasks: list[asyncio.Task], progress) -> None:
    """Cancel what still runs (each closes its transport), wait for all of it, stop the progress line."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if progress is not None:
        progress.stop()


def shard_result(config: DriverConfig, runs: list[SessionRun], frames: int, start: float, shard: Shard,
                 sessions: list[int]) -> dict[str, Any]:
    """A shard's result: its rows (by index), shared response ids, and its process (`sessions`: what it ran)."""
    rows = sorted((session_row(r, config) for r in runs), key=lambda row: row["index"])
    return {
        "frames_per_session": frames,
        "stream_start_s": start,
        "capabilities": next((r.capabilities for r in runs if r.capabilities is not None), None),
        "shared_response_ids": mark_shared_response_ids(rows),
        "driver_processes": [{"index": shard.index, "pid": os.getpid(), "sessions": sessions, "exit_code": None,
                              "error": None}],
        "sessions": rows,
    }
