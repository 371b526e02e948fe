"""The load run's verdict: PASS, FAIL (the server missed a bound) or INVALID (the client fell behind).

INVALID, a client-side cause, when in any driver process or over all of them merged:
  - the client's own send lateness p99 exceeds CLIENT_LATENESS_P99_LIMIT_MS (metrics.own_lateness_s:
    lateness the client caused itself, not time blocked on a server that stopped reading), or
  - the client real-time factor exceeds CLIENT_RTF_LIMIT (metrics.send_rtfs: wall time of the send
    schedule, stretched by the client alone, over the audio duration sent), or
  - a driver process failed.
FAIL, when the client kept up:
  - any session failed (refused, error event, invalid audio, acceptance, shared response id, cleanup,
    output underrun over --max-underrun-s: see load.session_row; in the arrivals and burst traffic a
    caller that was refused and then served passes), or
  - the frame latency p99 over every frame of every session (in the arrivals traffic: every frame sent
    in the steady window, traffic.py) exceeds --max-frame-latency-p99-ms, or
  - the server took the input slower than real time (send schedule real-time factor over
    CLIENT_RTF_LIMIT: its backpressure held the sends back).
INVALID wins over FAIL: when the client itself fell behind, a server failure may be its consequence,
so the run proves nothing either way. All reasons are listed either way.

Every percentile here is over the pooled samples (every frame of every session concerned), never an
average of per-session or per-process percentiles.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .config import FRAME_SAMPLES, DriverConfig
from .metrics import Send, frame_latencies_ms, own_lateness_s, percentiles

CLIENT_LATENESS_P99_LIMIT_MS = 40.0
CLIENT_RTF_LIMIT = 1.02

PASS, FAIL, INVALID = "PASS", "FAIL", "INVALID"


def row_sends(row: dict[str, Any]) -> list[Send]:
    return [(s["planned_at_s"], s["target_at_s"], s["send_started_at_s"], s["send_completed_at_s"])
            for s in row["input_timeline"]]


def row_frame_latencies_ms(row: dict[str, Any], window: tuple[float, float] | None = None) -> list[float]:
    """Each frame's latency (metrics.frame_latencies_ms); with a window (time.monotonic()), only the
    frames whose send started in it."""
    packets = row["audio_packet_timeline"]
    starts = [s["send_started_at_s"] for s in row["input_timeline"]]
    latencies = frame_latencies_ms(starts, [p["received_at_s"] for p in packets], [p["samples"] for p in packets])
    if window is None:
        return latencies
    return [ms for start, ms in zip(starts, latencies) if window[0] <= start <= window[1]]


def _frame_weighted(rows: list[dict[str, Any]], key: str) -> float | None:
    """The pooled real-time factor: total wall time over total audio, i.e. per-session factors
    weighted by the frames each sent."""
    pairs = [(row[key], row["input_frames"]) for row in rows if row[key] is not None]
    frames = sum(n for _, n in pairs)
    return sum(rtf * n for rtf, n in pairs) / frames if frames else None


def client_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The client's own timing over these sessions' frames, pooled."""
    own_ms = [late * 1000.0 for row in rows for late in own_lateness_s(row_sends(row))]
    blocked_ms = [(s["send_completed_at_s"] - s["send_started_at_s"]) * 1000.0
                  for row in rows for s in row["input_timeline"]]
    return {
        "sessions": len(rows),
        "frames_sent": len(own_ms),
        "own_send_lateness_ms": percentiles(own_ms),
        "send_blocked_ms": percentiles(blocked_ms),
        "client_send_rtf": _frame_weighted(rows, "client_send_rtf"),
        "send_schedule_rtf": _frame_weighted(rows, "send_schedule_rtf"),
    }


def _client_reasons(scope: str, stats: dict[str, Any]) -> Iterable[str]:
    p99 = stats["own_send_lateness_ms"]["p99"]
    if p99 is not None and p99 > CLIENT_LATENESS_P99_LIMIT_MS:
        yield f"client ({scope}): own send lateness p99 {p99:.1f} ms > {CLIENT_LATENESS_P99_LIMIT_MS:g} ms"
    rtf = stats["client_send_rtf"]
    if rtf is not None and rtf > CLIENT_RTF_LIMIT:
        yield f"client ({scope}): real-time factor {rtf:.3f} > {CLIENT_RTF_LIMIT}"


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def judge(rows: list[dict[str, Any]], processes: list[dict[str, Any]], config: DriverConfig,
          window: tuple[float, float] | None = None) -> dict[str, Any]:
    """verdict, reasons, client stats (merged and per driver process) and the run's summary numbers;
    the frame latency over the frames sent in `window` when one is given."""
    merged = client_stats(rows)
    per_process = [{"index": proc["index"], **client_stats([r for r in rows if r["driver_proc"] == proc["index"]])}
                   for proc in processes]
    invalid = list(_client_reasons("merged", merged))
    for stats in per_process:
        invalid += _client_reasons(f"driver process {stats['index']}", stats)
    invalid += [f"client: driver process {proc['index']} failed: {proc['error']}" for proc in processes
                if proc["error"]]

    frame_latency = percentiles([ms for row in rows for ms in row_frame_latencies_ms(row, window)])
    failed = [row for row in rows if not row["ok"]]
    fail = []
    if failed:
        examples = sorted({_cut(row["error"] or "failed") for row in failed})[:3]
        fail.append(f"sessions: {len(failed)} of {len(rows)} failed ({'; '.join(examples)})")
    starved = [row for row in rows if (row["audio_underrun_s"] or 0.0) > config.max_underrun_s]
    if starved:
        worst = max(row["audio_underrun_s"] for row in starved)
        fail.append(f"underrun: {len(starved)} sessions starved over {config.max_underrun_s} s (worst {worst:.3f} s)")
    if frame_latency["p99"] is not None and frame_latency["p99"] > config.max_frame_latency_p99_ms:
        fail.append(f"frame latency: p99 {frame_latency['p99']:.0f} ms > {config.max_frame_latency_p99_ms:g} ms")
    schedule_rtf = merged["send_schedule_rtf"]
    client_rtf = merged["client_send_rtf"]
    if schedule_rtf is not None and schedule_rtf > CLIENT_RTF_LIMIT and (client_rtf or 0.0) <= CLIENT_RTF_LIMIT:
        fail.append(f"server backpressure: input accepted at real-time factor {schedule_rtf:.3f} > {CLIENT_RTF_LIMIT}")
    if not rows:
        fail.append("sessions: none")

    verdict = INVALID if invalid else FAIL if fail else PASS
    admitted = [row for row in rows if row["admitted"]]
    deficits = [row["frame_deficit"] for row in admitted if row["frame_deficit"] is not None]
    underruns = [row["audio_underrun_s"] for row in admitted if row["audio_underrun_s"] is not None]
    return {
        "verdict": verdict,
        "reasons": invalid + fail,
        "client": {"merged": merged, "per_process": per_process},
        "summary": {
            "sessions": len(rows),
            "admitted": len(admitted),
            "passed_sessions": sum(row["ok"] for row in rows),
            "passed": verdict == PASS,
            "verdict": verdict,
            "driver_procs": len(processes),
            "frame_latency_ms": frame_latency,
            "first_audio_ms": percentiles([row["client_first_audio_after_stream_start_ms"] for row in admitted
                                           if row["client_first_audio_after_stream_start_ms"] is not None]),
            "frame_deficit": {"max": max(deficits, default=None), "total": sum(deficits),
                              "missing_frames_pct": _missing_pct(admitted)},
            "underrun_s": percentiles(underruns),
            "client_own_send_lateness_p99_ms": merged["own_send_lateness_ms"]["p99"],
            "client_send_rtf": merged["client_send_rtf"],
            "send_schedule_rtf": merged["send_schedule_rtf"],
        },
    }


def _missing_pct(rows: list[dict[str, Any]]) -> float | None:
    """Input frames without an output frame, over every admitted session, in percent."""
    sent = sum(row["input_frames"] for row in rows)
    received = sum(min(row["input_frames"], row["output_samples"] // FRAME_SAMPLES) for row in rows)
    return 100.0 * (sent - received) / sent if sent else None
