"""What a person sees: the live progress line, the summary table, load-result.json, the PNG timeline."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .config import FRAME_PERIOD_S, SAMPLE_RATE_HZ, UNDERRUN_THRESHOLD_S, DriverConfig
from .metrics import frame_latencies_ms, linear_percentile, own_lateness_s
from .traffic import ARRIVALS, TOGETHER, Plan, make_plan
from .traffic_stats import calls_summary, window_summary
from .validate import AUDIO_DELTA_TYPES
from .verdict import CLIENT_LATENESS_P99_LIMIT_MS, CLIENT_RTF_LIMIT, PASS, judge, row_sends

RESULT_NAME = "load-result.json"
LIFECYCLE_RESULT_NAME = "lifecycle-result.json"
PLOT_NAME = "load-timeline.png"


def public_url(url: str) -> str:
    """The server address without credentials or query (no handshake secrets in the report)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# -- live progress (stderr) ---------------------------------------------------------------


class Progress:
    """A one-line live status on stderr: rewritten in place on a terminal, a line every 5 s otherwise."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()

    def note(self, message: str) -> None:
        if self.enabled:
            self._clear()
            print(f"[load_driver] {message}", file=self.stream, flush=True)

    def watch(self, runs: list, frames_per_session: int) -> None:
        self.watch_counts(lambda: progress_counts(runs, frames_per_session))

    def watch_counts(self, counts: Callable[[], dict[str, Any]]) -> None:
        """Render `counts()` (progress_counts' layout) every period until stop()."""
        if self.enabled:
            self._t0 = time.monotonic()
            self._task = asyncio.create_task(self._loop(counts))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
            self._clear()

    def _clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    async def _loop(self, counts: Callable[[], dict[str, Any]]) -> None:
        period = 0.5 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            line = self.render(counts())
            self.stream.write(f"\r\x1b[K{line}" if self.tty else f"{line}\n")
            self.stream.flush()

    def render(self, counts: dict[str, Any]) -> str:
        return (
            f"[load_driver] t={time.monotonic() - self._t0:6.1f}s  admitted {counts['admitted']}/{counts['sessions']}  "
            f"sent {counts['sent']}/{counts['frames']} frames  audio deltas {counts['audio']}  "
            f"failed {counts['failed']}  phase {','.join(counts['phases'])}"
        )


def progress_counts(runs: list, frames_per_session: int) -> dict[str, Any]:
    """What the progress line shows of these load sessions (load.SessionRun)."""
    return {
        "sessions": len(runs),
        "admitted": sum(r.admitted for r in runs),
        "failed": sum(r.error is not None for r in runs),
        "sent": sum(len(r.sends) for r in runs),
        "frames": frames_per_session * len(runs),
        "audio": sum(sum(e["type"] in AUDIO_DELTA_TYPES for e in r.session.events) for r in runs),
        "phases": sorted({r.phase for r in runs}),
    }


def merge_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The progress counts of several driver processes as one."""
    merged: dict[str, Any] = {key: sum(part[key] for part in parts)
                              for key in ("sessions", "admitted", "failed", "sent", "frames", "audio")}
    merged["phases"] = sorted({phase for part in parts for phase in part["phases"]})
    return merged


# -- load-result.json ---------------------------------------------------------------------


def ensure_writable(config: DriverConfig, name: str) -> Path | None:
    """Refuse up front (before any connection) to overwrite a previous run's result."""
    if config.output_dir is None:
        return None
    path = config.output_dir / name
    if path.exists():
        raise FileExistsError(f"{path} exists: use a new --output-dir for every run")
    return path


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("x", encoding="utf-8") as stream:  # "x": never overwrite, even in a race
        json.dump(result, stream, ensure_ascii=False, indent=2, allow_nan=False)
        stream.write("\n")


def _worst(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float | None:
    values = [row[key][sub] if sub else row[key] for row in rows]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def traffic_block(config: DriverConfig, plan: Plan) -> dict[str, Any]:
    """The traffic as configured and planned (traffic.py), seconds from the shared start."""
    block: dict[str, Any] = {"pattern": config.traffic, "open": config.open, "seed": config.traffic_seed,
                             "ramp_end_s": round(plan.ramp_end_s, 3), "end_s": round(plan.end_s, 3)}
    if config.traffic == TOGETHER:
        return block
    if config.traffic == ARRIVALS:
        block.update(arrivals=config.arrivals, arrival_rate_per_s=config.arrival_rate, hold_s=config.hold_s,
                     settle_s=config.settle_s, redial_gap_s=config.redial_gap_s)
    else:
        block.update(burst_window_s=config.burst_window_s, hold_s=config.hold_s)
    block["call_length"] = ({"distribution": "min + exponential", "mean_s": config.call_mean_s,
                             "min_s": config.call_min_s} if config.call_mean_s else "until the end")
    block["retry"] = {"max_tries": config.max_tries, "for_s": config.retry_for_s}
    return block


def load_result(config: DriverConfig, identity: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    rows = run["sessions"]
    plan = make_plan(config)
    start = run["stream_start_s"]
    window = (start + plan.window_s[0], start + plan.window_s[1])
    judged = judge(rows, run["driver_processes"], config, window if config.traffic == ARRIVALS else None)
    passed = judged["verdict"] == PASS
    return {
        "schema_version": 3,
        "mode": "paced_multi_session",
        "verdict": judged["verdict"],
        "passed": passed,
        "ok": passed,
        "reasons": judged["reasons"],
        "summary": judged["summary"],
        "traffic": traffic_block(config, plan),
        "calls": calls_summary(rows, config.retry_for_s),
        "window": window_summary(rows, window),
        "driver_procs": len(run["driver_processes"]),
        "driver_processes": run["driver_processes"],
        "client": judged["client"],
        "bounds": {
            "max_underrun_s": config.max_underrun_s,
            "max_frame_latency_p99_ms": config.max_frame_latency_p99_ms,
            "client_own_send_lateness_p99_ms": CLIENT_LATENESS_P99_LIMIT_MS,
            "client_send_rtf": CLIENT_RTF_LIMIT,
        },
        "requested_sessions": config.sessions,
        "admitted_sessions": sum(row["admitted"] for row in rows),
        "passed_sessions": sum(row["ok"] for row in rows),
        "failed_sessions": [row["index"] for row in rows if not row["ok"]],
        "url": public_url(config.url),
        "model": config.model,
        "input": {**identity, "load_frames": config.load_frames, "format": config.input_format},
        "frame_period_s": FRAME_PERIOD_S,
        "sample_rate_hz": SAMPLE_RATE_HZ,
        "drain_s": config.drain_s,
        "timeout_s": config.timeout_s,
        "cleanup_timeout_s": config.cleanup_timeout_s,
        "underrun_threshold_s": UNDERRUN_THRESHOLD_S,
        "client_pacing_warning_threshold_ms": FRAME_PERIOD_S * 1000,
        "client_pacing_warning_sessions": [row["index"] for row in rows if row["client_pacing_warning"]],
        "max_client_rtf": config.max_client_rtf,
        "acceptance": {
            "max_frame_deficit": config.max_frame_deficit,
            "min_voiced_frames": config.min_voiced_frames,
            "minimum_audio_chunks": config.minimum_audio_chunks,
            "voiced_frame_rms_threshold": config.voiced_frame_rms_threshold,
        },
        "shared_response_ids": run["shared_response_ids"],
        "capabilities": run["capabilities"],
        "reported_server": {"revision": config.server_revision, "hardware": config.server_hardware},
        "worst": {
            "client_first_audio_after_stream_start_ms": _worst(rows, "client_first_audio_after_stream_start_ms"),
            "client_stream_rtf": _worst(rows, "client_stream_rtf"),
            "client_audio_packet_interval_p99_ms": _worst(rows, "client_audio_packet_interval_ms", "p99"),
            "client_send_lateness_p99_ms": _worst(rows, "client_send_lateness_ms", "p99"),
            "client_own_send_lateness_p99_ms": _worst(rows, "client_own_send_lateness_ms", "p99"),
            "frame_latency_p99_ms": _worst(rows, "frame_latency_ms", "p99"),
            "audio_underrun_s": _worst(rows, "audio_underrun_s"),
        },
        "stream_start_s": run["stream_start_s"],
        "measurement_origin": (
            "client time.monotonic() seconds; admission excluded; streaming and the fixed drain window "
            "retained; audio arriving during cleanup excluded"
        ),
        "interval_definition": "nonempty valid audio packet arrivals, not server ticks or per-frame inference latency",
        "sessions": rows,
    }


# -- summary table (stdout) ---------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summary_table(result: dict[str, Any]) -> str:
    header = ("#", "proc", "session", "status", "in", "out", "voiced", "first ms", "lat p99", "ivl p99", "own late p99",
              "underrun s", "error")
    lines = [header]
    for row in result["sessions"]:
        lines.append((
            _fmt(row["index"]),
            _fmt(row["driver_proc"]),
            _fmt(row["session_id"])[:20],
            _fmt(row["status"]),
            _fmt(row["input_frames"]),
            _fmt(row["output_frames"]),
            _fmt(row["voiced_frames"]),
            _fmt(row["client_first_audio_after_stream_start_ms"]),
            _fmt(row["frame_latency_ms"]["p99"]),
            _fmt(row["client_audio_packet_interval_ms"]["p99"]),
            _fmt(row["client_own_send_lateness_ms"]["p99"]),
            _fmt(row["audio_underrun_s"], 3),
            _fmt(row["error"])[:70],
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    summary = result["summary"]
    latency, first = summary["frame_latency_ms"], summary["first_audio_ms"]
    text.append(
        f"frame latency p50/p99 {_fmt(latency['p50'])}/{_fmt(latency['p99'])} ms; first audio p50/p99 "
        f"{_fmt(first['p50'])}/{_fmt(first['p99'])} ms; worst underrun {_fmt(summary['underrun_s']['max'], 3)} s; "
        f"client own lateness p99 {_fmt(summary['client_own_send_lateness_p99_ms'])} ms, real-time factor "
        f"{_fmt(summary['client_send_rtf'], 3)}; {result['driver_procs']} driver process(es)"
    )
    calls = result["calls"]
    refusals = calls["refusals"]
    text.append(
        f"{result['traffic']['pattern']} traffic, {result['traffic']['open']} open: {calls['callers']} callers "
        f"{calls['status']}; refusals {refusals['total']} {refusals['by_type']} ({refusals['after_created']} after "
        f"session.created), {refusals['callers_refused']} callers refused, {calls['refused_callers_served']} of them "
        f"served; window {result['window']['length_s']:.1f} s"
    )
    text.append(
        f"{result['verdict']}: {result['passed_sessions']}/{len(result['sessions'])} sessions passed "
        f"({result['admitted_sessions']} admitted); shared response ids: {len(result['shared_response_ids'])}"
    )
    text.extend(f"  - {reason}" for reason in result["reasons"])
    return "\n".join(text)


# -- PNG timeline ---------------------------------------------------------------------------

BAND_QS = (50, 90, 99)


def _bands(times: np.ndarray, values: np.ndarray, edges: np.ndarray) -> dict[str, list[float]]:
    """p50/p90/p99/max of the values whose time falls in each bin (NaN for an empty bin)."""
    bins = np.digitize(times, edges[1:-1])  # bin i holds edges[i] <= t < edges[i + 1]
    bands: dict[str, list[float]] = {f"p{q}": [] for q in BAND_QS} | {"max": []}
    for i in range(len(edges) - 1):
        chosen = values[bins == i].tolist()
        for q in BAND_QS:
            bands[f"p{q}"].append(linear_percentile(chosen, q) if chosen else float("nan"))
        bands["max"].append(max(chosen) if chosen else float("nan"))
    return bands


def _backlog_s(starts: np.ndarray, arrivals: np.ndarray, received_s: np.ndarray, at: np.ndarray) -> np.ndarray:
    """One session's input audio sent minus output audio received, by each time in `at`."""
    sent_s = np.searchsorted(starts, at, side="right") * FRAME_PERIOD_S
    return sent_s - np.concatenate([[0.0], received_s])[np.searchsorted(arrivals, at, side="right")]


def timeline_bands(result: dict[str, Any], bin_s: float | None = None) -> dict[str, Any]:
    """Percentile bands per time bin (seconds since the shared input start), pooled over sessions:
    frame latency by output arrival, the client's own send lateness by send time, and each session's
    output backlog (input audio sent - output audio received) at the end of each bin."""
    t0 = result["stream_start_s"]
    latency_at, latency_ms, late_at, late_ms, backlog_rows = [], [], [], [], []
    for row in (r for r in result["sessions"] if r["admitted"] and r["input_timeline"]):
        sends = row_sends(row)
        starts = np.array([s[2] for s in sends]) - t0
        packets = row["audio_packet_timeline"]
        arrivals = np.array([p["received_at_s"] for p in packets]) - t0
        samples = np.array([p["samples"] for p in packets])
        lat = frame_latencies_ms(starts.tolist(), arrivals.tolist(), samples.tolist())
        latency_at += [start + ms / 1000.0 for start, ms in zip(starts, lat)]
        latency_ms += lat
        late_at += starts.tolist()
        late_ms += [late * 1000.0 for late in own_lateness_s(sends)]
        backlog_rows.append((starts, arrivals, np.cumsum(samples) / SAMPLE_RATE_HZ))
    end = max([*latency_at, *late_at, FRAME_PERIOD_S])
    bin_s = bin_s or max(0.25, end / 200)
    edges = np.arange(0.0, end + bin_s, bin_s)
    backlog = np.array([_backlog_s(*arrays, edges[1:]) for arrays in backlog_rows]).reshape(-1, len(edges) - 1)
    return {
        "t_s": ((edges[:-1] + edges[1:]) / 2).tolist(),
        "bin_s": bin_s,
        "frame_latency_ms": _bands(np.array(latency_at), np.array(latency_ms), edges),
        "own_send_lateness_ms": _bands(np.array(late_at), np.array(late_ms), edges),
        "output_backlog_s": {
            **{f"p{q}": (np.percentile(backlog, q, axis=0) if len(backlog) else np.full(len(edges) - 1, np.nan))
               .tolist() for q in BAND_QS},
            "max": (backlog.max(axis=0) if len(backlog) else np.full(len(edges) - 1, np.nan)).tolist(),
        },
    }


def _draw_bands(ax, t: list[float], bands: dict[str, list[float]], unit: str, color: str) -> None:
    ax.fill_between(t, bands["p50"], bands["p90"], color=color, alpha=0.45, linewidth=0, label="p50-p90")
    ax.fill_between(t, bands["p90"], bands["p99"], color=color, alpha=0.2, linewidth=0, label="p90-p99")
    ax.plot(t, bands["p50"], color=color, linewidth=1.2, label="p50")
    ax.plot(t, bands["max"], color=color, linewidth=0.7, linestyle=":", label="max")
    ax.set_ylabel(unit)


def plot_timeline(result: dict[str, Any], path: Path) -> list[list[str]]:
    """Three panels of percentile bands against seconds since the shared input start: frame latency,
    output backlog per session, the client's own send lateness. Readable at any session count (the
    legend never lists sessions); returns each panel's legend labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = timeline_bands(result)
    t = bands["t_s"]
    fig, (latency, backlog, lateness) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    _draw_bands(latency, t, bands["frame_latency_ms"], "frame latency (ms)", "C0")
    latency.axhline(result["bounds"]["max_frame_latency_p99_ms"], color="red", linestyle="--", linewidth=0.8,
                    label="p99 bound")
    _draw_bands(backlog, t, bands["output_backlog_s"], "input sent - output received (s)", "C2")
    _draw_bands(lateness, t, bands["own_send_lateness_ms"], "client own send lateness (ms)", "C1")
    lateness.axhline(CLIENT_LATENESS_P99_LIMIT_MS, color="red", linestyle="--", linewidth=0.8,
                     label="p99 validity bound")
    lateness.set_xlabel(f"seconds since shared input start ({bands['bin_s']:.2f} s bins, client monotonic clock)")
    latency.set_title(f"{result['requested_sessions']} paced sessions over {result['driver_procs']} driver "
                      f"process(es): {result['verdict']} ({result['passed_sessions']} passed)")
    labels = []
    for ax in (latency, backlog, lateness):
        ax.legend(fontsize="small", loc="upper left", ncol=5)
        labels.append(ax.get_legend_handles_labels()[1])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels
