"""The traffic's numbers in load-result.json: callers by status, refusals by type, time to served, first
audio, and the steady window's latency (pure functions of the report rows).

    calls   {callers, status {passed, failed, killed, refused}, admitted, admitted_passed, served (admitted
             and heard audio), killed_by {what: n},
             server_error_events, refusals {total, by_type {type: n}, after_created, callers_refused,
             retries}, refused_callers_served, served_within_s, all_refused_served_in_time,
             time_to_served_ms (refused callers: first try -> first audio), first_audio_ms (first frame
             sent -> first audio delta), first_audio_after_connect_ms (the served try's connect -> first
             audio delta)}     (each {count, p50, p90, p99, max} over the callers that had one)
    window  {start_s, end_s (time.monotonic()), length_s, sessions (with a frame in it),
             frame_latency_ms (every frame sent in it, pooled), session_latency_p50_ms {count, p10,
             p50, p90, max} (each session's median over its frames in it, across sessions)}
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .load import PASSED, STATUSES
from .metrics import linear_percentile, percentiles
from .verdict import row_frame_latencies_ms


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [row[key] for row in rows if row.get(key) is not None]


def calls_summary(rows: list[dict[str, Any]], served_within_s: float) -> dict[str, Any]:
    refused = [row for row in rows if row["refusals"]]
    served = [row for row in refused if row["admitted"] and row["time_to_served_ms"] is not None]
    in_time = [row for row in served if row["time_to_served_ms"] <= served_within_s * 1000.0]
    refusals = [r for row in rows for r in row["refusals"]]
    statuses = Counter(row["status"] for row in rows)
    admitted = [row for row in rows if row["admitted"]]
    return {
        "callers": len(rows),
        "status": {status: statuses.get(status, 0) for status in STATUSES},
        "admitted": len(admitted),
        "admitted_passed": sum(row["status"] == PASSED for row in admitted),
        "served": sum(row["time_to_served_ms"] is not None for row in admitted),
        "killed_by": dict(Counter(row["killed_by"] for row in rows if row["killed_by"])),
        "server_error_events": sum(t == "server_error" for row in rows for t in row["error_types"]),
        "refusals": {"total": len(refusals), "by_type": dict(Counter(r["type"] for r in refusals)),
                     "after_created": sum(r["after_created"] for r in refusals), "callers_refused": len(refused),
                     "retries": sum(max(0, row["tries"] - 1) for row in rows)},
        "refused_callers_served": len(served),
        "served_within_s": served_within_s,
        "all_refused_served_in_time": len(in_time) == len(refused),
        "time_to_served_ms": percentiles(_values(refused, "time_to_served_ms")),
        "first_audio_ms": percentiles(_values(rows, "client_first_audio_after_stream_start_ms")),
        "first_audio_after_connect_ms": percentiles(_values(rows, "client_first_audio_after_connect_ms")),
    }


def window_summary(rows: list[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    per_session = [lat for lat in (row_frame_latencies_ms(row, window) for row in rows if row["admitted"]) if lat]
    medians = [linear_percentile(lat, 50) for lat in per_session]
    return {
        "start_s": window[0],
        "end_s": window[1],
        "length_s": round(window[1] - window[0], 3),
        "sessions": len(per_session),
        "frame_latency_ms": percentiles([ms for lat in per_session for ms in lat]),
        "session_latency_p50_ms": percentiles(medians, (10, 50, 90)),
    }
