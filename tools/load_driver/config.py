"""The driver's whole configuration, in one typed place.

`python -m tools.load_driver --help` maps one flag to each field (dashes for underscores) and LOAD_DRIVER_<FIELD>
to each from the environment (services/common/config.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.config import option
from services.common.frame import FRAME_SAMPLES, SAMPLE_RATE as SAMPLE_RATE_HZ

FRAME_PERIOD_S = FRAME_SAMPLES / SAMPLE_RATE_HZ  # 0.08
# Continuity: the player-starvation budget of the shared continuity helper (100 ms).
UNDERRUN_THRESHOLD_S = 0.1
# Lateness above this re-anchors a session's send schedule (a stall); smaller jitter is absorbed by
# the absolute schedule. So consecutive sends are never closer than FRAME_PERIOD_S - RESYNC_S.
RESYNC_S = 0.02
# `--procs auto`: one driver process per this many sessions, at most one per CPU. One event loop's send
# jitter grows with its sessions (own lateness p99 25 ms at 100 sessions, 8 ms at 25 on a 2-core box),
# so 20 keeps each process well inside the 40 ms validity bound.
SESSIONS_PER_AUTO_PROC = 20


ENV_PREFIX = "LOAD_DRIVER_"
TRAFFIC = ("together", "arrivals", "burst")
OPENS = ("autostart0", "sdk")


def parse_procs(text: str) -> int | str:
    """'auto' or a count."""
    if text.strip() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a count or auto, got {text[:20]!r}") from None


@dataclass(frozen=True)
class DriverConfig:
    """Drive a Realtime duplex endpoint: the lifecycle scenario, or paced load with N sessions."""

    url: str = option("ws://127.0.0.1:8000/v1/realtime?duplex=1", help="Realtime duplex endpoint")
    model: str | None = option(None, help="model name for the URL and session.update (omitted when not given)")
    input_wav: Path | None = option(None, help="input speech (integer PCM WAV; resampled to 24 kHz mono); "
                                               "default: a synthetic speech-like signal")
    input_format: str = option("pcm_f32le", help="pcm_f32le | pcm16")
    voice: str = option("NATF2.pt", help="every session's voice")
    # Short personas: they must also fit the embedded tiny model's 32-frame prompt window.
    persona: str = option("You are a helpful assistant.", help="the (first) session's instructions")
    secondary_persona: str = option("You are a calm assistant.", help="lifecycle mode: the second session's")
    replacement_persona: str = option("You are a cheerful travel guide.", help="lifecycle mode: the replacement's")

    # Mode: None = lifecycle (admission, slot reuse); N = paced load with N sessions.
    sessions: int | None = option(None, help="load mode with N sessions; omit for the lifecycle (admission/slot "
                                             "reuse) scenario")
    procs: int | str = option(1, parse=parse_procs, help="load mode: spread the sessions over K driver processes "
                                                         "(merged into one result), or 'auto': one per 20 sessions, "
                                                         "at most one per CPU")
    load_frames: int = option(1000, help="load mode: at most this many 80 ms input frames per session (the WAV is "
                                         "never looped)")
    # Traffic (load mode; tools/load_driver/traffic.py defines each pattern).
    traffic: str = option("together", help="together: every session opens, then all stream from one shared start "
                                           "(a comparison); arrivals: N lines dialled at --arrival-rate, each "
                                           "caller streams once its own open is done, then churn; burst: N "
                                           "callers within --burst-window-s, one call each")
    open: str = option("autostart0", help="autostart0: connect with ?autostart=0, stream after the session.created "
                                          "that answers session.update; sdk: connect with ?model= (the server "
                                          "autostarts), send session.update at once, stream after the first "
                                          "session.updated (the openai SDK, LiveKit's openai plugin, pipecat)")
    arrivals: str = option("poisson", help="arrivals: steady (one every 1/rate s) | poisson (exponential gaps)")
    arrival_rate: float = option(2.0, help="arrivals: callers per second in the ramp")
    burst_window_s: float = option(2.0, help="burst: every caller dials within this many seconds")
    hold_s: float = option(60.0, help="arrivals: the traffic goes on this long after the ramp's last arrival; "
                                      "burst: after the burst window")
    settle_s: float = option(2.0, help="arrivals: the steady window starts this long after the ramp's last "
                                       "arrival")
    call_mean_s: float = option(0.0, help="arrivals, burst: mean call length, --call-min-s + exponential (churn: "
                                          "the line dials again after a hang-up); 0: every call lasts until the "
                                          "end")
    call_min_s: float = option(10.0, help="the shortest call; no caller dials with less than this left")
    redial_gap_s: float = option(1.0, help="arrivals with churn: a line's next caller dials this long after a "
                                           "hang-up")
    traffic_seed: int = option(0, help="seed of the arrivals, call lengths and send phases")
    max_tries: int = option(20, help="arrivals, burst: a caller refused with a typed retry-later tries at most "
                                     "this often")
    retry_for_s: float = option(30.0, help="arrivals, burst: a refused caller retries (after the delay the server "
                                           "gave, else 1 s) until this long after its first try")
    lifecycle_frames: int = option(50, help="lifecycle mode: frames streamed in each of its two streaming phases")
    capacity: int = option(2, help="lifecycle mode: the server's session limit; session capacity+1 must be refused")
    drain_s: float = option(2.0, help="fixed observation window after the last input frame")
    timeout_s: float = option(180.0, help="bound on admission, each send, and the lifecycle's coverage waits")
    cleanup_timeout_s: float = option(5.0, help="bound on session.close + session.closed, and separately on the "
                                                "WebSocket close")

    # Acceptance of one session's audio.
    max_frame_deficit: int = option(4, help="output frames a session may end short of its input frames")
    min_voiced_frames: int = option(5, help="output frames above the RMS threshold a session must have")
    minimum_audio_chunks: int = option(2, help="audio packets a session must receive")
    voiced_frame_rms_threshold: float = option(1e-3, help="RMS above which an output frame counts as voiced")
    max_client_rtf: float | None = option(None, help="optional acceptance ceiling on client_stream_rtf "
                                                     "(diagnostic by default)")
    # Server bounds of the load verdict (FAIL beyond them).
    max_underrun_s: float = option(0.5, help="load verdict FAILs when any session's output starves longer than "
                                             "this")
    # ITU-T G.114's limit for interactive speech is 400 ms one way; the H200 target is 250 ms.
    max_frame_latency_p99_ms: float = option(400.0, help="load verdict FAILs when the p99 over all frames of input "
                                                         "frame i sent -> output frame i received exceeds this")

    # Reporting.
    output_dir: Path | None = option(None, help="directory for load-result.json / lifecycle-result.json (never "
                                                "overwritten) and the plot")
    server_revision: str | None = option(None, help="operator-reported server commit (recorded, not verified)")
    server_hardware: str | None = option(None, help="operator-reported server hardware (recorded, not verified)")
    plot: bool = option(False, help="also write load-timeline.png (needs matplotlib and --output-dir)")
    progress: bool = option(True, help="live progress line on stderr")
    input_seed: int = option(0, help="seed of the synthetic input signal")

    @property
    def mode(self) -> str:
        return "lifecycle" if self.sessions is None else "paced_multi_session"

    def resolved_procs(self) -> int:
        """Driver processes for this run: `procs`, or for "auto" one per SESSIONS_PER_AUTO_PROC
        sessions, at most one per CPU."""
        if self.procs != "auto":
            return int(self.procs)
        wanted = math.ceil((self.sessions or 1) / SESSIONS_PER_AUTO_PROC)
        return max(1, min(wanted, os.cpu_count() or 1))

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)  # before any connection is made

        check(self.url.startswith(("ws://", "wss://")), f"--url must be ws:// or wss://, got {self.url[:80]!r}")
        check(self.input_format in ("pcm_f32le", "pcm16"), "--input-format must be pcm_f32le or pcm16")
        check(self.traffic in TRAFFIC, f"--traffic must be one of {', '.join(TRAFFIC)}")
        check(self.open in OPENS, f"--open must be one of {', '.join(OPENS)}")
        check(self.arrivals in ("steady", "poisson"), "--arrivals must be steady or poisson")
        for name in ("arrival_rate", "burst_window_s", "hold_s", "call_min_s", "retry_for_s"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')} must be finite and > 0")
        for name in ("settle_s", "call_mean_s", "redial_gap_s"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, f"--{name.replace('_', '-')} must be finite and >= 0")
        check(not self.call_mean_s or self.call_mean_s >= self.call_min_s, "--call-mean-s must be 0 or >= --call-min-s")
        check(self.traffic == "together" or self.call_min_s < self.hold_s, "--call-min-s must be shorter than --hold-s")
        check(1 <= self.max_tries <= 1000, "--max-tries must be in [1, 1000]")
        if self.sessions is not None:
            check(1 <= self.sessions <= 256, "--sessions must be in [1, 256]")
            check(1 <= self.load_frames <= 100_000, "--load-frames must be in [1, 100000]")
        if self.procs != "auto":
            check(isinstance(self.procs, int) and 1 <= self.procs <= 256, "--procs must be auto or in [1, 256]")
            check(self.procs == 1 or self.sessions is not None, "--procs applies to load mode (--sessions N)")
            check(self.sessions is None or self.procs <= self.sessions, "--procs must not exceed --sessions")
        check(1 <= self.lifecycle_frames <= 100_000, "--lifecycle-frames must be in [1, 100000]")
        check(2 <= self.capacity <= 256, "--capacity must be in [2, 256]")
        for name in ("drain_s", "timeout_s", "cleanup_timeout_s"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, f"--{name.replace('_', '-')} must be finite and >= 0")
        check(self.timeout_s > 0 and self.cleanup_timeout_s > 0, "timeouts must be positive")
        check(self.max_frame_deficit >= 0, "--max-frame-deficit must be >= 0")
        check(self.min_voiced_frames >= 1, "--min-voiced-frames must be >= 1")
        check(self.minimum_audio_chunks >= 1, "--minimum-audio-chunks must be >= 1")
        check(
            math.isfinite(self.voiced_frame_rms_threshold) and self.voiced_frame_rms_threshold >= 0,
            "--voiced-frame-rms-threshold must be finite and >= 0",
        )
        if self.max_client_rtf is not None:
            check(math.isfinite(self.max_client_rtf) and self.max_client_rtf > 0, "--max-client-rtf must be > 0")
        for name in ("max_underrun_s", "max_frame_latency_p99_ms"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')} must be finite and > 0")
        check(not (self.plot and self.output_dir is None), "--plot needs --output-dir")
