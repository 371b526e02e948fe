"""What a person sees: the live progress line, the summary table, load-result.json, the PNG timeline."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from .config import FRAME_PERIOD_S, SAMPLE_RATE_HZ, UNDERRUN_THRESHOLD_S, DriverConfig
from .validate import AUDIO_DELTA_TYPES

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
        if self.enabled:
            self._t0 = time.monotonic()
            self._task = asyncio.create_task(self._loop(runs, frames_per_session))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
            self._clear()

    def _clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    async def _loop(self, runs: list, frames_per_session: int) -> None:
        period = 0.5 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            line = self.render(runs, frames_per_session)
            self.stream.write(f"\r\x1b[K{line}" if self.tty else f"{line}\n")
            self.stream.flush()

    def render(self, runs: list, frames_per_session: int) -> str:
        admitted = sum(r.admitted for r in runs)
        failed = sum(r.error is not None for r in runs)
        sent = sum(len(r.sends) for r in runs)
        audio = sum(sum(e["type"] in AUDIO_DELTA_TYPES for e in r.session.events) for r in runs)
        phases = sorted({r.phase for r in runs})
        return (
            f"[load_driver] t={time.monotonic() - self._t0:6.1f}s  admitted {admitted}/{len(runs)}  "
            f"sent {sent}/{frames_per_session * len(runs)} frames  audio deltas {audio}  "
            f"failed {failed}  phase {','.join(phases)}"
        )


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


def load_result(config: DriverConfig, identity: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    rows = run["sessions"]
    return {
        "schema_version": 1,
        "mode": "paced_multi_session",
        "ok": bool(rows) and all(row["ok"] for row in rows),
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
    header = ("#", "session", "ok", "in", "out", "voiced", "first ms", "rtf", "ivl p99", "late p99", "underrun s",
              "error")
    lines = [header]
    for row in result["sessions"]:
        lines.append((
            _fmt(row["index"]),
            _fmt(row["session_id"])[:20],
            _fmt(row["ok"]),
            _fmt(row["input_frames"]),
            _fmt(row["output_frames"]),
            _fmt(row["voiced_frames"]),
            _fmt(row["client_first_audio_after_stream_start_ms"]),
            _fmt(row["client_stream_rtf"], 3),
            _fmt(row["client_audio_packet_interval_ms"]["p99"]),
            _fmt(row["client_send_lateness_ms"]["p99"]),
            _fmt(row["audio_underrun_s"], 3),
            _fmt(row["error"])[:70],
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    verdict = "PASS" if result["ok"] else "FAIL"
    text.append(
        f"{verdict}: {result['passed_sessions']}/{result['requested_sessions']} sessions passed "
        f"({result['admitted_sessions']} admitted); pacing warnings: {result['client_pacing_warning_sessions']}; "
        f"shared response ids: {len(result['shared_response_ids'])}"
    )
    return "\n".join(text)


# -- PNG timeline ---------------------------------------------------------------------------


def plot_timeline(result: dict[str, Any], path: Path) -> None:
    """Per session, against seconds since the shared input start: audio received vs input sent
    (top) and send lateness (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["stream_start_s"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for row in result["sessions"]:
        label, color = f"#{row['index']}", f"C{row['index'] % 10}"
        sends = row["input_timeline"]
        if sends:
            xs = [s["send_started_at_s"] - t0 for s in sends]
            top.step(xs, [(i + 1) * FRAME_PERIOD_S for i in range(len(xs))], where="post", linestyle=":",
                     color=color, label=f"{label} input sent")
            bottom.plot(xs, [max(0.0, s["send_started_at_s"] - s["planned_at_s"]) * 1000 for s in sends],
                        color=color, label=label)
        packets = row["audio_packet_timeline"]
        if packets:
            total, ys = 0, []
            for p in packets:
                total += p["samples"]
                ys.append(total / SAMPLE_RATE_HZ)
            top.step([p["received_at_s"] - t0 for p in packets], ys, where="post", color=color,
                     label=f"{label} audio received")
    top.set_ylabel("seconds of audio")
    top.set_title(f"{result['requested_sessions']} paced sessions ({'PASS' if result['ok'] else 'FAIL'})")
    if top.get_legend_handles_labels()[0]:
        top.legend(fontsize="small", ncol=2)
    bottom.axhline(FRAME_PERIOD_S * 1000, color="red", linestyle="--", linewidth=0.8, label="pacing warning")
    bottom.set_ylabel("send lateness (ms)")
    bottom.set_xlabel("seconds since shared input start (client monotonic clock)")
    bottom.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
