"""Lifecycle mode (the default): admission limit, slot reuse and no leakage, with validated audio.

1. open `primary` and `secondary` (two personas): distinct session ids, honest multi-session
   capabilities; hold `capacity - 2` more idle sessions; one more is refused with
   `resource_exhausted` before any `session.created`;
2. stream paced frames into primary and secondary at once: each yields finite, non-silent,
   whole-frame 24 kHz audio plus text deltas under its own single response id;
3. close primary (`response.done` then `session.closed`), open `replacement` with a third persona
   in the freed slot: a fresh session id, its own persona echoed, a response id never seen before;
4. send secondary one malformed append: exactly one typed `invalid_request_error`, and the
   session keeps working (not poisoned);
5. stream into secondary (continuing) and replacement at once: both valid, and secondary keeps
   its response id across the slot reuse.
The first failed check stops the scenario; every opened session is still closed (bounded).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import numpy as np

from .config import FRAME_PERIOD_S, FRAME_SAMPLES, DriverConfig
from .load import (
    START_LEAD_S,
    SessionFailure,
    SessionRun,
    check_capabilities,
    close_politely,
    encoded_frames,
    paced_send,
)
from .session import (
    RawRealtimeClient,
    SessionLost,
    created_session,
    error_code_of,
    realtime_url,
    session_id_of,
    session_update,
)
from .validate import AUDIO_DELTA_TYPES, AcceptanceError, audio_stats, scan_events

EXPECTED_CAPABILITIES = {
    "implementation_level": "model_native_duplex",
    "chunk_period_ms": round(FRAME_PERIOD_S * 1000),
    "supports_multi_session": True,
    "supports_multi_session_same_replica": True,
    "supports_barge_in": False,
}


class CheckFailed(AssertionError):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


class Lifecycle:
    def __init__(self, config: DriverConfig, pcm: np.ndarray, progress=None) -> None:
        self.config = config
        self.url = realtime_url(config.url, config.model)
        self.frames = encoded_frames(pcm, config.input_format)
        self.progress = progress
        self.runs: list[SessionRun] = []
        self.passed: list[str] = []
        self.stats: dict[str, dict[str, Any]] = {}
        self.capabilities: dict[str, Any] | None = None
        self.overflow_error: dict[str, Any] | None = None
        self.replacement_retries = 0

    def require(self, ok: bool, check: str, message: str) -> None:
        if not ok:
            raise CheckFailed(check, message)
        if check not in self.passed:
            self.passed.append(check)

    def note(self, message: str) -> None:
        if self.progress is not None:
            self.progress.note(message)

    async def open(self, persona: str) -> tuple[SessionRun, dict[str, Any]]:
        run = SessionRun(len(self.runs), RawRealtimeClient(self.url, cleanup_timeout_s=self.config.cleanup_timeout_s))
        self.runs.append(run)
        await run.session.connect(self.config.timeout_s)
        update = session_update(
            model=self.config.model, voice=self.config.voice, persona=persona, input_format=self.config.input_format
        )
        first = await run.session.open(update, self.config.timeout_s)
        return run, first

    async def open_admitted(self, persona: str, role: str) -> SessionRun:
        run, first = await self.open(persona)
        self.require(first["type"] == "session.created", "admission",
                     f"{role} was not admitted (error {error_code_of(first)})")
        run.admitted, run.session_id = True, session_id_of(first)
        self.require(run.session_id is not None, "session_id", f"{role}: session.created carries no session.id")
        try:
            check_capabilities(first, run)
        except RuntimeError as exc:
            raise CheckFailed("capabilities", f"{role}: {exc}") from None
        echoed = created_session(first).get("instructions")
        self.require(echoed == persona, "persona_echo", f"{role}: session.created does not echo its own persona")
        return run

    async def stream(self, runs: list[SessionRun]) -> None:
        """Paced frames into `runs` from one shared start; then wait for coverage and drain."""
        epoch = time.monotonic() + START_LEAD_S
        await asyncio.gather(*(paced_send(r, self.frames, epoch, self.config.timeout_s) for r in runs))
        need = [len(r.sends) - self.config.max_frame_deficit for r in runs]

        def covered() -> bool:  # cheap estimate (base64 length); exact validation follows
            return all(
                sum(len(e.get("delta") or "") * 3 // 4 for e in r.session.of_type(*AUDIO_DELTA_TYPES))
                >= n * FRAME_SAMPLES * 2
                for r, n in zip(runs, need)
            )

        try:
            await runs[0].session.wait_for(covered, self.config.timeout_s, "output frame coverage")
        except TimeoutError:
            pass  # the validation below names the session and the shortfall
        await asyncio.sleep(self.config.drain_s)

    def validate(self, run: SessionRun, role: str, minimum_chunks: int) -> set[str]:
        """Strict per-packet and whole-session checks of one session's audio and text so far."""
        session = run.session
        unexpected = session.error_codes()[run.expected_errors:]
        self.require(not unexpected, "no_error_events", f"{role}: server error events {unexpected}")
        self.require(not session.protocol_faults, "protocol", f"{role}: protocol faults {session.protocol_faults}")
        scan = scan_events(session.events, session.received_at)
        self.require(not scan.invalid, "audio_packets", f"{role}: invalid audio packets {scan.invalid[:3]}")
        config = self.config
        config = replace(config, minimum_audio_chunks=minimum_chunks)
        try:
            stats = audio_stats(scan.valid, len(run.sends), config)
        except AcceptanceError as exc:
            self.stats[role] = {"session_id": run.session_id, "input_frames": len(run.sends), **exc.stats}
            raise CheckFailed(f"audio_{exc.check}", f"{role}: {exc}") from None
        self.require(True, f"{role}_audio", "")
        self.require(scan.text_deltas > 0, "text_deltas", f"{role}: no transcript/text delta events")
        ids = {p.response_id for p in scan.valid}
        self.stats[role] = {
            "session_id": run.session_id,
            "input_frames": len(run.sends),
            **stats,
            "response_ids": sorted(ids),
            "text_deltas": scan.text_deltas,
        }
        return ids

    async def close(self, run: SessionRun, role: str, streamed: bool = True) -> None:
        await close_politely(run, self.config.cleanup_timeout_s)
        self.require(run.cleanup_error is None, "close", f"{role}: {run.cleanup_error}")
        if streamed:  # its one continuous response ends with the session
            self.require(bool(run.session.of_type("response.done")), "response_done",
                         f"{role}: no response.done before session.closed")
        await run.session.close()

    async def open_replacement(self) -> SessionRun:
        """The freed slot must admit a new session. A server may still be confirming the release
        for a moment after session.closed: `resource_exhausted` is retried within cleanup_timeout_s."""
        deadline = time.monotonic() + self.config.cleanup_timeout_s
        while True:
            try:
                return await self.open_admitted(self.config.replacement_persona, "replacement")
            except CheckFailed as exc:
                run = self.runs[-1]
                refused = exc.check == "admission" and "resource_exhausted" in str(exc)
                if not refused or time.monotonic() > deadline:
                    raise
                self.replacement_retries += 1
                await run.session.close()
                await asyncio.sleep(0.2)

    async def bad_append_is_refused_once(self, run: SessionRun) -> None:
        """A malformed append (invalid base64) gets one typed error and changes nothing."""
        self.note("sending secondary one malformed append")
        before = len(run.session.errors())
        await run.session.send({"type": "input_audio_buffer.append", "audio": "not base64!"}, self.config.timeout_s)
        await run.session.wait_for(lambda: len(run.session.errors()) > before, self.config.timeout_s,
                                   "the error for a malformed append")
        await asyncio.sleep(2 * FRAME_PERIOD_S)  # room for a (wrong) second error to show up
        errors = run.session.errors()[before:]
        body = errors[0].get("error") if isinstance(errors[0].get("error"), dict) else {}
        self.require(len(errors) == 1 and body.get("type") == "invalid_request_error"
                     and isinstance(body.get("code"), str), "bad_append_typed_error",
                     f"a malformed append gave {len(errors)} error(s), first {body.get('type')}/{body.get('code')}")
        run.expected_errors = len(run.session.errors())

    async def scenario(self) -> None:
        cfg = self.config
        self.note("opening primary and secondary sessions")
        primary = await self.open_admitted(cfg.persona, "primary")
        secondary = await self.open_admitted(cfg.secondary_persona, "secondary")
        self.require(primary.session_id != secondary.session_id, "distinct_session_ids",
                     "two live sessions share a session id")
        self.capabilities = primary.capabilities
        self.require(secondary.capabilities == primary.capabilities, "capabilities",
                     "concurrent sessions report different capabilities")
        wrong = {k: (primary.capabilities or {}).get(k) for k, v in EXPECTED_CAPABILITIES.items()
                 if (primary.capabilities or {}).get(k) != v}
        self.require(not wrong, "capabilities", f"unexpected capabilities {wrong}")
        for i in range(cfg.capacity - 2):
            await self.open_admitted(cfg.persona, f"holder{i}")

        self.note(f"opening session {cfg.capacity + 1}: it must be refused")
        overflow, first = await self.open(cfg.persona)
        body = first.get("error") if isinstance(first.get("error"), dict) else {}
        self.overflow_error = {"type": body.get("type"), "code": body.get("code")}
        self.require(first["type"] == "error" and error_code_of(first) == "resource_exhausted", "admission_limit",
                     f"session {cfg.capacity + 1} was not refused with resource_exhausted ({self.overflow_error})")
        await overflow.session.close()

        self.note(f"streaming {len(self.frames)} paced frames into primary and secondary")
        await self.stream([primary, secondary])
        primary_ids = self.validate(primary, "primary", cfg.minimum_audio_chunks)
        secondary_ids = self.validate(secondary, "secondary", cfg.minimum_audio_chunks)
        self.require(not primary_ids & secondary_ids, "distinct_response_ids", "two sessions share a response id")

        self.note("closing primary and reusing its slot with another persona")
        await self.close(primary, "primary")
        replacement = await self.open_replacement()
        self.require(replacement.session_id not in (primary.session_id, secondary.session_id),
                     "fresh_session_id", "the replacement reused a session id")

        await self.bad_append_is_refused_once(secondary)

        self.note(f"streaming {len(self.frames)} more frames into secondary and replacement")
        await self.stream([secondary, replacement])
        survivor_ids = self.validate(secondary, "secondary", cfg.minimum_audio_chunks + 1)
        replacement_ids = self.validate(replacement, "replacement", 1)
        self.require(survivor_ids == secondary_ids, "survivor_response_stable",
                     "the surviving session's response changed while a slot was reused")
        self.require(not replacement_ids & (primary_ids | secondary_ids), "fresh_response_id",
                     "the replacement reused another session's response id")
        await self.close(secondary, "secondary")
        await self.close(replacement, "replacement")
        for run in self.runs:  # the idle slot holders
            if run.admitted and run.session.connected:
                await self.close(run, f"holder session {run.index}", streamed=False)


async def run_lifecycle(config: DriverConfig, pcm: np.ndarray, progress=None) -> dict[str, Any]:
    life = Lifecycle(config, pcm, progress)
    failed_check, error = None, None
    try:
        await life.scenario()
    except CheckFailed as exc:
        failed_check, error = exc.check, str(exc)
    except TimeoutError as exc:  # local text: what was awaited
        failed_check, error = "timeout", str(exc)
    except SessionLost as exc:
        failed_check, error = "connection", str(exc)
    except SessionFailure as exc:
        failed_check, error = "protocol", str(exc)
    except Exception as exc:  # noqa: BLE001 - may carry remote text: type only
        failed_check, error = "connection", type(exc).__name__
    finally:
        for run in life.runs:  # bounded cleanup of whatever is still open, even after a failure
            if run.admitted and run.session.connected and failed_check is not None:
                await close_politely(run, config.cleanup_timeout_s)
            await run.session.close()
    return {
        "schema_version": 1,
        "mode": "lifecycle",
        "ok": failed_check is None,
        "failed_check": failed_check,
        "error": error,
        "passed_checks": life.passed,
        "capacity": config.capacity,
        "frames_per_phase": len(life.frames),
        "capabilities": life.capabilities,
        "overflow_error": life.overflow_error,
        "replacement_admission_retries": life.replacement_retries,
        "sessions": life.stats,
    }
